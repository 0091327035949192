"""Responses API bodies read as vLLM renders them: instructions, message items and their text
parts, function calls and their output, reasoning items, tools.

Ground truth is vLLM's own conversion, recorded from vLLM 0.32.0
(``scripts/record_request_conversions.py`` -> ``tests/fixtures/vllm-captures/
responses-conversion.json``). vLLM hands its renderer the items as the client sent them; the
router sends ``/tokenize`` the form it takes (text parts typed ``text``, no item ``type``),
which vLLM's renderer reads the same way: the comparison below reads vLLM's side so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from router.responses_input import chat_request

FIXTURE = Path(__file__).parent / "fixtures/vllm-captures/responses-conversion.json"
CASES = json.loads(FIXTURE.read_text())["cases"]


def _as_rendered(msg: dict[str, Any]) -> dict[str, Any]:
    """A message as vLLM 0.32's chat parser (``_parse_chat_message_content``) hands it on: its
    role and content, every text part a ``text`` part, an assistant's tool calls and
    reasoning, a tool message's call id, a string ``name`` and ``task``, a developer message's
    ``tools``; other keys (an item's ``type``, ``id``, ``status``) dropped."""
    role = msg.get("role")
    kept = {"role", "content"}
    kept |= {"tool_calls", "reasoning"} if role == "assistant" else set()
    kept |= {"tool_call_id"} if role == "tool" else set()
    kept |= {"tools"} if role == "developer" else set()
    out = {k: v for k, v in msg.items() if k in kept and (v is not None or k == "content")}
    out |= {k: msg[k] for k in ("name", "task") if isinstance(msg.get(k), str)}
    if isinstance(out.get("content"), list):
        out["content"] = [{"type": "text", "text": p["text"]} for p in out["content"]]
    return out


def _as_dumped(tool: dict[str, Any]) -> dict[str, Any]:
    """A chat tool as ``/tokenize``'s function model dumps it: ``description`` and
    ``parameters`` always, ``strict`` and ``defer_loading`` when set."""
    fn = tool["function"]
    out = {k: fn.get(k) for k in ("name", "description", "parameters")}
    out |= {k: fn[k] for k in ("strict", "defer_loading") if fn.get(k) is not None}
    return {"type": "function", "function": out}


@pytest.mark.parametrize("case", CASES, ids=[c["label"] for c in CASES])
def test_bodies_read_as_vllm_converts_them(case: dict[str, Any]) -> None:
    got = chat_request(case["request"])
    if "error" in case:  # vLLM refuses it: the router routes it by load
        assert got is None, case["error"]
        return
    assert got is not None
    msgs, tools = got
    assert msgs == [_as_rendered(m) for m in case["messages"]]
    assert (tools and [_as_dumped(t) for t in tools]) == case["tools"]


def test_the_fixture_covers_what_agents_send() -> None:
    labels = {c["label"] for c in CASES}
    assert {"agent-turns", "parts", "encrypted-reasoning", "custom-and-namespaced-tools",
            "builtin-tools-only"} <= labels  # fmt: skip
    agent = next(c for c in CASES if c["label"] == "agent-turns")
    roles = [m["role"] for m in agent["messages"]]
    assert roles.count("tool") == 3 and any("tool_calls" in m for m in agent["messages"])


def test_a_prompt_the_router_cannot_reproduce_is_routed_by_load() -> None:
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    grammar = {"type": "custom", "name": "g", "format": {"type": "grammar", "definition": "x"}}
    refused = [
        {"input": [{"role": "user", "content": [image]}]},
        {"input": "x", "previous_response_id": "resp_1"},
        {"input": "x", "tools": [grammar]},
        {"input": "x", "tools": [{"type": "namespace", "name": "ns", "tools": 5}]},
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "namespace": "ns"}]},
        {"input": [{"type": "custom_tool_call", "call_id": "c", "name": "f", "input": 5}]},
        {"input": []},
        {"input": 5},
        {"instructions": 5, "input": "x"},
        {"input": [{"type": "message", "role": "user", "content": [{"type": ["x"], "text": "a"}]}]},
    ]
    for body in refused:
        assert chat_request(body) is None, body
