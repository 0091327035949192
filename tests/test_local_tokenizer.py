"""``tokenizer.mode: local``: the router tokenizes with the model's own tokenizer files.

The model directory (byte-level BPE + chat template) is trained here with ``tokenizers``; the
simulated workers load the same files (``kvrouter-sim --tokenizer``), so they tokenize as vLLM
would with that model. Real HTTP on loopback, real ZMQ events.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_router_support import (
    CHAT_TEMPLATE,
    config_for,
    serve_router,
    served_again_as_predicted,
    until,
    words,
    write_tokenizer,
)

from router.tokenize import LocalTokenizer, PromptTokenizer, TokenizeError
from simulator.testing import running_fleet

pytestmark = pytest.mark.timeout(120)

FAST = {"decode_ms": 1, "prefill_tps": 400000, "step_overhead_ms": 0.1, "num_gpu_blocks": 512}


async def _tokenize(c: httpx.AsyncClient, url: str, payload: dict[str, Any]) -> list[int]:
    r = await c.post(url + "/tokenize", json=payload)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


async def _tokenize_calls(c: httpx.AsyncClient, workers: list[Any]) -> int:
    n = 0
    for w in workers:
        n += (await c.get(w.url + "/sim/state")).json()["tokenize_calls"]
    return n


async def test_local_tokenizer_agrees_with_the_workers_and_saves_their_tokenize(tmp_path: Path):
    model = write_tokenizer(tmp_path / "model")
    with running_fleet(2, tokenizer=model, **FAST) as fleet:
        cfg = config_for(fleet, tokenizer={"mode": "local", "path": model})
        prompt = words(300, "local")
        chat = {"messages": [{"role": "system", "content": words(200, "sys")},
                             {"role": "user", "content": "What is 2+2?"}]}  # fmt: skip
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            await until(lambda: c.get(base + "/ready"), 20)
            assert router.tokenizer.local is not None  # verified against a worker at start
            want_prompt = await _tokenize(c, fleet[0].url, {"prompt": prompt})
            want_chat = await _tokenize(c, fleet[0].url, chat)
            assert want_prompt[0] == 2  # the worker adds BOS to prompts, as vLLM does
            before = await _tokenize_calls(c, fleet)
            e = (await c.post(base + "/debug/route", json={"prompt": prompt})).json()
            assert (e["tokenization"], e["prompt_tokens"]) == ("local", len(want_prompt))
            # the hit-loss budget's state: nothing spent before the first window of decisions
            assert e["hit_loss"] == {"budget": 0.003, "debt_tokens": 0.0, "added_weight": 0.0}
            e = (await c.post(base + "/debug/route", json=chat)).json()
            assert (e["tokenization"], e["prompt_tokens"]) == ("local", len(want_chat))
            assert await _tokenize_calls(c, fleet) == before  # no worker was asked

            # Routing on local tokens is exact: the prompt's blocks, stored by the worker from
            # its own tokenization, are found under the router's keys.
            body = {"model": "sim-model", "prompt": prompt, "max_tokens": 1}
            first = (await c.post(base + "/v1/completions", json=body)).headers["x-kvrouter-worker"]

            async def indexed() -> Any:
                e = (await c.post(base + "/debug/route", json=body)).json()
                w = next(x for x in e["workers"] if x["url"] == first)
                return e if w["gpu_hit_tokens"] >= len(want_prompt) // 16 * 16 - 16 else None

            e = await until(indexed, 20, "the prompt's blocks in the index")
            assert e["chosen"] == first
            r = await c.post(base + "/v1/completions", json=body)
            assert r.headers["x-kvrouter-worker"] == first
            usage = r.json()["usage"]
            assert usage["prompt_tokens"] == len(want_prompt)
            assert usage["prompt_tokens_details"]["cached_tokens"] == e["predicted_hit_tokens"]


async def test_local_tokenizer_that_differs_from_the_workers_is_not_used(tmp_path: Path):
    """Same vocabulary, another chat template: the start-up check finds the chat probe differs,
    so the router tokenizes through the workers instead (and says so in the log)."""
    model = write_tokenizer(tmp_path / "model")
    other = write_tokenizer(
        tmp_path / "other", template=CHAT_TEMPLATE.replace("<|end|>", "<|end|><|end|>")
    )
    with running_fleet(1, tokenizer=other, **FAST) as fleet:
        cfg = config_for(fleet, tokenizer={"mode": "local", "path": model})
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            await until(lambda: c.get(base + "/ready"), 20)
            assert router.tokenizer.local is None
            e = (await c.post(base + "/debug/route", json={"prompt": words(50, "x")})).json()
            assert e["tokenization"] == "remote"


AGENT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\n{{ tools | tojson }}<|end|>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% if m['tool_calls'] is defined %}{% for c in m['tool_calls'] %}<call>"
    "{{ c['function']['name'] }} {{ c['function']['arguments'] | tojson }}</call>{% endfor %}"
    "{% endif %}<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""Renders tools, content and tool calls as agent models' templates do."""


async def test_an_agents_chat_is_counted_as_the_worker_renders_it(tmp_path: Path):
    """vLLM's parser hands the template an absent content as "", text parts joined, tool-call
    arguments as objects, and a system prompt without Claude Code's billing line; its request
    model hands it tools as it dumps them (its own key order, absent fields null, unknown keys
    gone), and transformers cuts a continued final message where it ends. The router renders
    locally the shapes it hands over the same way and sends the others to a worker's
    ``/tokenize``; either way it counts what the worker prefills and finds it cached."""
    model = write_tokenizer(tmp_path / "model", template=AGENT_TEMPLATE)
    call = {"id": "c1", "type": "function",
            "function": {"name": "ls", "arguments": '{"path": "/srv"}'}}  # fmt: skip
    system = {"role": "system", "content": words(60, "agent")}
    user = {"role": "user", "content": words(40, "ask")}
    chats = {
        "plain": ("local", [system, user]),
        "billing line": (
            "local",
            [{"role": "system", "content": "x-anthropic-billing-header: cch=1;\n" + words(60, "b")},
             user],
        ),
        "tool round trip": (
            "remote",
            [system, user, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "c1", "content": "a b c"}],
        ),
        "text parts": (
            "remote",
            [system, {"role": "user", "content": [{"type": "text", "text": words(30, "p1")},
                                                  {"type": "text", "text": words(30, "p2")}]}],
        ),
        "tools": ("local", [system, user]),
        "continued": ("local", [system, user, {"role": "assistant", "content": "The files: "}]),
    }  # fmt: skip
    tools = [{"type": "function", "function": {"parameters": {"type": "object"}, "name": "ls",
                                               "x-origin": "mcp"}}]  # fmt: skip
    with running_fleet(1, tokenizer=model, **FAST) as fleet:
        cfg = config_for(fleet, tokenizer={"mode": "local", "path": model})
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            await until(lambda: c.get(base + "/ready"), 20)
            assert router.tokenizer.local is not None
            for label, (source, messages) in chats.items():
                body = {"model": "sim-model", "messages": messages, "max_tokens": 1}
                if label == "tools":
                    body |= {"tools": tools, "tool_choice": "none"}
                if label == "continued":
                    body |= {"continue_final_message": True, "add_generation_prompt": False}
                e = (await c.post(base + "/debug/route", json=body)).json()
                assert e["tokenization"].split("+")[0] == source, label
                r = await c.post(base + "/v1/chat/completions", json=body)
                assert r.status_code == 200, (label, r.text)
                n = r.json()["usage"]["prompt_tokens"]
                assert e["prompt_tokens"] == n, label
                assert await served_again_as_predicted(c, base, body, n) > 0, label


def test_templates_are_compiled_as_transformers_compiles_them(tmp_path: Path) -> None:
    """Loop controls, ``{% generation %}`` blocks and ``strftime_now`` (templates of Llama 3
    and of models trained with assistant masks) render locally; kwargs naming transformers'
    own arguments, and every chat of a template that does not compile, are left to the
    workers instead of being counted wrong or stopping the router."""
    template = (
        "{{ bos_token }}<|system|>\n{{ strftime_now('%Y') }}<|end|>\n"
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "<|{{ m['role'] }}|>\n{% generation %}{{ m['content'] }}{% endgeneration %}<|end|>\n"
        "{% endfor %}{% if documents is not none %}{{ documents | length }}{% endif %}"
    )
    local = LocalTokenizer(write_tokenizer(tmp_path / "ok", template=template))
    msgs = [{"role": "user", "content": f"m{i}"} for i in range(4)]
    year = str(datetime.date.today().year)
    text = f"<s><|system|>\n{year}<|end|>\n<|user|>\nm0<|end|>\n<|user|>\nm1<|end|>\n"
    assert local.encode_chat({"messages": msgs}) == local.encode_prompt(text, False)
    with pytest.raises(TokenizeError):  # vLLM passes these to the call: they cut the ids
        local.encode_chat({"messages": msgs, "chat_template_kwargs": {"max_length": 8}})
    broken = LocalTokenizer(write_tokenizer(tmp_path / "broken", template="{% if %}"))
    assert broken.template is None
    with pytest.raises(TokenizeError):
        broken.encode_chat({"messages": msgs})


def test_a_continued_final_message_is_cut_where_it_ends(tmp_path: Path) -> None:
    """transformers renders a continued final message with a tag after it and cuts the chat
    there: the end-of-turn after it is gone, and so is whitespace the template trims."""
    plain = LocalTokenizer(write_tokenizer(tmp_path / "plain", template=CHAT_TEMPLATE))
    trims = (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] | trim }}<|end|>\n{% endfor %}"
    )
    trimmed = LocalTokenizer(write_tokenizer(tmp_path / "trim", template=trims))
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The files: "}]
    body = {"messages": msgs, "continue_final_message": True, "add_generation_prompt": False}
    rendered = plain.template.render(messages=msgs, add_generation_prompt=False, **plain.special)
    cut = rendered[: rendered.rindex("The files: ") + len("The files: ")]
    assert plain.encode_chat(body) == plain.encode_prompt(cut, False)
    text = "<|user|>\nhi<|end|>\n<|assistant|>\nThe files:"
    assert trimmed.encode_chat(body) == trimmed.encode_prompt(text, False)
    with pytest.raises(TokenizeError):  # vLLM refuses both
        plain.encode_chat({**body, "add_generation_prompt": True})


def test_a_worker_with_a_model_folder_refuses_a_message_that_is_not_an_object(
    tmp_path: Path,
) -> None:
    """As vLLM: a 400 naming the message, and the worker keeps serving."""
    model = write_tokenizer(tmp_path / "model", template=CHAT_TEMPLATE)
    with running_fleet(1, tokenizer=model, **FAST) as (w,), httpx.Client(timeout=10) as c:
        for path in ("/v1/chat/completions", "/tokenize"):
            r = c.post(w.url + path, json={"messages": [[1, 2]], "max_tokens": 1})
            assert r.status_code == 400 and "role" in r.json()["error"]["message"], r.text
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        ok = c.post(w.url + "/v1/chat/completions", json=chat)
        assert ok.status_code == 200, ok.text


async def test_a_template_reading_the_clock_is_cached_for_the_day(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Llama 3's template writes today's date: a chat rendered yesterday is rendered again
    today (the worker renders today's date), not served from the tokenization cache."""
    template = "<|system|>\n{{ strftime_now('%d %b %Y') }}<|end|>\n" + CHAT_TEMPLATE
    local = LocalTokenizer(write_tokenizer(tmp_path / "m", template=template))
    tok = PromptTokenizer(16, local=local)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    first = await tok.tokenize(chat, True, 0, None)
    assert (first.source, (await tok.tokenize(chat, True, 0, None)).source) == ("local", "cache")

    class Tomorrow(datetime.datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return datetime.datetime.now(tz) + datetime.timedelta(days=1)

    class Dates(datetime.date):
        @classmethod
        def today(cls) -> Any:
            return datetime.date.today() + datetime.timedelta(days=1)

    clock = type("clock", (), {"datetime": Tomorrow, "date": Dates})
    monkeypatch.setattr("router.tokenize.datetime", clock)
    later = await tok.tokenize(chat, True, 0, None)
    assert later.source == "local" and later.data != first.data
    plain = PromptTokenizer(16, local=LocalTokenizer(write_tokenizer(tmp_path / "p")))
    assert plain._day(True) == b""
