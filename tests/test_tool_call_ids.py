"""A worker on vLLM's Mistral tokenizer (``--tokenizer-mode mistral``) renders an agent's chat
with each tool-call id cut to its last 9 characters (vLLM 0.32 ``truncate_tool_call_ids``, in
the chat endpoint only), and its ``/tokenize`` refuses the same chat with the ids as sent
(mistral-common: "Tool call id was ... but must be a-z, A-Z, 0-9, with a length of 9."). The
router learns that from the refusal, tokenizes the chat with the ids cut, and predicts what
the worker prefills; on other workers the ids stay as sent. Simulated workers with a template
that writes the ids, as Mistral's does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from test_router_support import (
    FAST,
    config_for,
    serve_router,
    served_again_as_predicted,
    until,
    write_tokenizer,
)

from router.messages import error_of
from router.tokenize import short_tool_call_ids
from simulator.testing import running_fleet

pytestmark = pytest.mark.timeout(120)

IDS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% if m['tool_calls'] is defined %}{% for c in m['tool_calls'] %}"
    "[CALL {{ c['id'] }}] {{ c['function']['name'] }}{% endfor %}{% endif %}"
    "{% if m['tool_call_id'] is defined %}[RESULT {{ m['tool_call_id'] }}]{% endif %}"
    "<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""Writes each tool call's id and each result's, as Mistral's tool-call format does."""

LONG = "call_Zq8TfR2mWx4kLp9Vb"  # an OpenAI-style id: the worker keeps "R2mWx4kLp9Vb"[-9:]


def agent_chat(call_id: str) -> dict[str, Any]:
    question = " ".join(f"q{i}" for i in range(80))
    call = {"id": call_id, "type": "function",
            "function": {"name": "ls", "arguments": "{}"}}  # fmt: skip
    return {
        "model": "sim-model",
        "messages": [
            {"role": "user", "content": question},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": "a.py b.py"},
            {"role": "user", "content": "which is larger"},
        ],
        "max_tokens": 1,
    }


def test_ids_are_cut_as_the_chat_endpoint_cuts_them() -> None:
    msgs = agent_chat(LONG)["messages"]
    cut = short_tool_call_ids(msgs)
    assert cut is not None and cut[0] is msgs[0] and cut[3] is msgs[3]
    assert cut[1]["tool_calls"][0]["id"] == cut[2]["tool_call_id"] == LONG[-9:]
    assert msgs[1]["tool_calls"][0]["id"] == LONG  # the client's body is not changed
    assert short_tool_call_ids(agent_chat("abcdef123")["messages"]) is None
    assert short_tool_call_ids("not a list") is None
    odd = [{"role": "assistant", "tool_calls": [None, {"id": 7}]}, {"role": "tool"}, "x"]
    assert short_tool_call_ids(odd) is None


def test_a_refusal_quotes_the_workers_message() -> None:
    vllm = b'{"error": {"message": "Tool call id was x but must be", "code": 400}}'
    assert error_of(vllm)[0] == "Tool call id was x but must be"
    assert error_of(b'{"detail": "Not Found"}')[0] == "Not Found"
    assert error_of(b"<html>" + b"x" * 1000)[0] == "<html>" + "x" * 294
    assert error_of(b"[1, 2]")[0] == "[1, 2]"


@pytest.mark.parametrize("mode", ["mistral", "auto"])
async def test_an_agents_chat_is_counted_as_a_mistral_worker_renders_it(
    tmp_path: Path, mode: str
) -> None:
    model = write_tokenizer(tmp_path / "model", template=IDS_TEMPLATE)
    chat = agent_chat(LONG)
    with running_fleet(1, tokenizer=model, tokenizer_mode=mode, **FAST) as ws:
        async with (
            serve_router(config_for(ws)) as (base, router),
            httpx.AsyncClient(timeout=30) as c,
        ):
            await until(lambda: all(w.subscribed for w in router.registry.workers.values()), 20)
            sent = await c.post(ws[0].url + "/tokenize", json=chat)
            assert sent.status_code == (400 if mode == "mistral" else 200), sent.text
            plan = (await c.post(base + "/debug/route", json=chat)).json()
            assert plan["prompt_tokens"] is not None, plan
            learned = router.tokenizer.short_tool_call_ids.covers("sim-model")
            assert learned is (mode == "mistral")
            shown = (await c.get(base + "/debug/index")).json()["model"]["tool_call_ids_cut"]
            assert shown == (["sim-model"] if learned else [])
            first = await c.post(base + "/v1/chat/completions", json=chat)
            assert first.status_code == 200, first.text
            n = first.json()["usage"]["prompt_tokens"]
            assert plan["prompt_tokens"] == n
            assert await served_again_as_predicted(c, base, chat, n) > 0
            # The same chat with ids of 9 characters: the Mistral worker's prompt is the one
            # it rendered for the long ids, every block of it cached.
            short = agent_chat(LONG[-9:])
            again = (await c.post(base + "/debug/route", json=short)).json()
            assert (again["prompt_tokens"] == n) is (mode == "mistral"), again
            # An id that is not 9 letters or digits once cut: the worker refuses the chat,
            # and the router routes it by load rather than by a prompt it cannot know.
            bad = agent_chat("call_1")
            r = await c.post(base + "/v1/chat/completions", json=bad)
            assert r.status_code == (400 if mode == "mistral" else 200), r.text
