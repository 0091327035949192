"""A chat's ``documents`` and ``reasoning_effort`` reach vLLM's chat template but not
``/tokenize``'s unless passed inside ``chat_template_kwargs``: the router passes them there
(router/tokenize.py ``template_arguments``) and counts the tokens vLLM prefills, against
simulated workers whose template reads them as vLLM 0.32 hands them over. The same for an
assistant turn's reasoning under the deprecated ``reasoning_content``, which the chat endpoint
renames and ``/tokenize`` does not (``chat_messages``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from test_router_support import (
    FAST,
    TOOLS_TEMPLATE,
    config_for,
    serve_router,
    served_again_as_predicted,
    until,
    write_tokenizer,
)

from router.tokenize import PromptTokenizer, chat_messages, template_arguments
from simulator.testing import running_fleet

pytestmark = pytest.mark.timeout(120)

DOCS = [{"title": "manual", "text": "the pump starts when the valve opens"}]


def test_what_the_template_sees_beside_the_kwargs() -> None:
    assert template_arguments({}) == {}
    assert template_arguments({"reasoning_effort": "none"}) == {
        "reasoning_effort": "none",
        "enable_thinking": False,
    }
    assert template_arguments({"reasoning_effort": "high"})["enable_thinking"] is True
    # The client's own enable_thinking stands; documents override the kwargs' documents.
    body = {
        "reasoning_effort": "none",
        "documents": DOCS,
        "chat_template_kwargs": {"enable_thinking": True, "documents": []},
    }
    assert template_arguments(body) == {"reasoning_effort": "none", "documents": DOCS}
    assert template_arguments({"documents": DOCS, "chat_template_kwargs": "bad"}) == {}
    payload = PromptTokenizer.tokenize_payload(
        {"model": "m", "messages": [], "reasoning_effort": "low", "chat_template_kwargs": None},
        True,
    )
    assert isinstance(payload, dict)
    assert payload["chat_template_kwargs"] == {"reasoning_effort": "low", "enable_thinking": True}


async def test_a_thinking_switch_and_documents_are_counted_as_the_worker_renders_them() -> None:
    with running_fleet(1, **FAST) as ws:
        url = ws[0].url
        async with (
            serve_router(config_for(ws)) as (base, router),
            httpx.AsyncClient(timeout=30) as c,
        ):
            await until(lambda: all(w.subscribed for w in router.registry.workers.values()), 20)
            question = " ".join(f"q{i}" for i in range(120))
            chat: dict[str, Any] = {
                "model": "sim-model",
                "messages": [{"role": "user", "content": question}],
                "max_tokens": 1,
            }
            plain = (await c.post(base + "/debug/route", json=chat)).json()["prompt_tokens"]
            for extra in ({"reasoning_effort": "none"}, {"documents": DOCS}):
                body = {**chat, **extra}
                for turn in range(2):
                    e = (await c.post(base + "/debug/route", json=body)).json()
                    r = await c.post(base + "/v1/chat/completions", json=body)
                    assert r.status_code == 200, r.text
                    usage = r.json()["usage"]
                    assert e["prompt_tokens"] == usage["prompt_tokens"] != plain, (extra, e)
                    (row,) = e["workers"]
                    cached = usage["prompt_tokens_details"]["cached_tokens"]
                    assert row["gpu_hit_tokens"] == cached, (extra, turn, row, cached)
                    if turn == 0:
                        await until(
                            lambda b=body: _hit(c, base, b),
                            10,
                            "the chat's events",
                        )
                    else:
                        assert cached > 0
            st = router.verifier.state((url, 0))
            assert (st.tokens_mismatches, st.over, st.under) == (0, 0, 0)


async def _hit(c: httpx.AsyncClient, base: str, body: dict[str, Any]) -> bool:
    e = (await c.post(base + "/debug/route", json=body)).json()
    return e["workers"][0]["gpu_hit_tokens"] > 0


async def test_tools_are_rendered_in_the_clients_key_order(tmp_path: Path) -> None:
    """vLLM renders a chat's tools with the keys in the order the client sent them; a
    tokenize request re-encoded with sorted keys counts the same tokens in another order, and
    matches nothing past the tools. The second of two identical chats: predicted == cached."""
    model = write_tokenizer(tmp_path / "model", template=TOOLS_TEMPLATE)
    props = {f"arg{i}": {"type": "string", "description": f"argument {i}"} for i in range(12)}
    tool = {
        "type": "function",
        "function": {
            "name": "run",
            "description": "Run it",
            "parameters": {"type": "object", "properties": props, "required": ["arg0"]},
        },
    }
    chat = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "use the tool"}],
        "tools": [tool],
        "max_tokens": 1,
    }
    with running_fleet(1, tokenizer=model, **FAST) as ws:
        async with (
            serve_router(config_for(ws)) as (base, router),
            httpx.AsyncClient(timeout=30) as c,
        ):
            await until(lambda: all(w.subscribed for w in router.registry.workers.values()), 20)
            first = await c.post(base + "/v1/chat/completions", json=chat)
            assert first.status_code == 200, first.text
            n = first.json()["usage"]["prompt_tokens"]
            assert await served_again_as_predicted(c, base, chat, n) > 200


def test_reasoning_reaches_the_template_under_both_names_and_only_for_the_assistant() -> None:
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert chat_messages(plain) is plain  # nothing to rename: the same list, no copy
    sent = [
        {"role": "user", "content": "hi", "reasoning_content": "not rendered"},
        {"role": "assistant", "content": "yo", "reasoning_content": "old name"},
        {"role": "assistant", "content": "", "reasoning": "new", "reasoning_content": "lost"},
        {"role": "assistant", "content": "x", "reasoning": None, "reasoning_content": "kept"},
        {"role": "assistant", "content": "y", "reasoning": ""},
    ]
    assert chat_messages(sent) == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo", "reasoning": "old name",
         "reasoning_content": "old name"},
        {"role": "assistant", "content": "", "reasoning": "new", "reasoning_content": "new"},
        {"role": "assistant", "content": "x", "reasoning": "kept", "reasoning_content": "kept"},
        {"role": "assistant", "content": "y", "reasoning": "", "reasoning_content": ""},
    ]  # fmt: skip
    assert sent[1] == {"role": "assistant", "content": "yo", "reasoning_content": "old name"}
    payload = PromptTokenizer.tokenize_payload({"messages": sent}, True)
    assert isinstance(payload, dict) and payload["messages"] == chat_messages(sent)


THINKING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['reasoning_content'] is defined and m['reasoning_content'] %}"
    "<think>{{ m['reasoning_content'] }}</think>{% endif %}{{ m['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""Reads the reasoning as Qwen3's and DeepSeek-R1's templates do, as ``reasoning_content``."""


@pytest.mark.parametrize("tokenizer", ["remote", "local"])
@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
async def test_an_earlier_turns_reasoning_is_counted_as_the_chat_endpoint_renders_it(
    tmp_path: Path, field: str, tokenizer: str
) -> None:
    """An agent's next request repeats the assistant turn with its reasoning, under either
    field name; the worker's chat endpoint renders it (the built-in template, or one reading
    ``reasoning_content``), and the router counts and matches the same tokens, asking the
    worker's ``/tokenize`` or rendering the template itself."""
    model = write_tokenizer(tmp_path / "model", template=THINKING_TEMPLATE)
    fleet_args: dict[str, Any] = {"tokenizer": model} if tokenizer == "local" else {}
    sections = {"tokenizer": {"mode": "local", "path": model}} if tokenizer == "local" else {}
    thought = " ".join(f"t{i}" for i in range(80))
    question = " ".join(f"q{i}" for i in range(60))
    turn = {"role": "assistant", "content": "Let me check.", field: thought}
    chat: dict[str, Any] = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": question}, turn,
                     {"role": "user", "content": "and then?"}],
        "max_tokens": 1,
    }  # fmt: skip
    bare = {**chat, "messages": [chat["messages"][0], {**turn, field: None}, chat["messages"][2]]}
    with running_fleet(1, **fleet_args, **FAST) as ws:
        async with (
            serve_router(config_for(ws, **sections)) as (base, router),
            httpx.AsyncClient(timeout=30) as c,
        ):
            await until(lambda: all(w.subscribed for w in router.registry.workers.values()), 20)
            if tokenizer == "local":
                assert router.tokenizer.local is not None  # agreed with the worker at start
            first = await c.post(base + "/v1/chat/completions", json=chat)
            assert first.status_code == 200, first.text
            n = first.json()["usage"]["prompt_tokens"]
            without = (await c.post(base + "/debug/route", json=bare)).json()
            assert without["tokenization"] == tokenizer
            assert n > without["prompt_tokens"] + 60  # the reasoning is in what was prefilled
            assert await served_again_as_predicted(c, base, chat, n) > 0


async def _selfcheck(c: httpx.AsyncClient, base: str) -> dict[str, Any]:
    async def checked() -> Any:
        d = (await c.get(base + "/debug/index")).json()["workers"][0]["selfcheck"] or {}
        return d if d.get("events") not in (None, "pending") else None

    return await until(checked, 30, "the self-check")


@pytest.mark.parametrize("excluded", [False, True])
async def test_a_chat_with_tool_choice_none_is_counted_as_the_worker_renders_it(
    tmp_path: Path, excluded: bool
) -> None:
    """vLLM's ``--exclude-tools-when-tool-choice-none`` drops a ``tool_choice: "none"``
    chat's tools from the chat endpoint's template, not from ``/tokenize``: the self-check
    learns which the worker does (``dropped`` / ``kept``), and the chat is predicted as the
    worker prefills it; the same chat with ``tool_choice`` unset keeps its tools either way."""
    model = write_tokenizer(tmp_path / "model", template=TOOLS_TEMPLATE)
    props = {f"arg{i}": {"type": "string", "description": f"argument {i}"} for i in range(12)}
    tool = {"type": "function", "function": {"name": "run", "parameters": {
        "type": "object", "properties": props}}}  # fmt: skip
    question = " ".join(f"q{i}" for i in range(60))
    chat = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": question}],
        "tools": [tool],
        "max_tokens": 1,
    }
    flags = {"exclude_tools_when_tool_choice_none": excluded}
    with running_fleet(1, tokenizer=model, **flags, **FAST) as ws:
        async with (
            serve_router(config_for(ws)) as (base, router),
            httpx.AsyncClient(timeout=30) as c,
        ):
            check = await _selfcheck(c, base)
            assert check["tools_with_choice_none"] == ("dropped" if excluded else "kept"), check
            assert router.tokenizer.tools_dropped.covers("sim-model") is excluded
            plain = (await c.post(base + "/debug/route", json=chat)).json()["prompt_tokens"]
            bare = {**chat, "tools": None}
            without = (await c.post(base + "/debug/route", json=bare)).json()["prompt_tokens"]
            assert without < plain - 100
            none = {**chat, "tool_choice": "none"}
            first = await c.post(base + "/v1/chat/completions", json=none)
            assert first.status_code == 200, first.text
            n = first.json()["usage"]["prompt_tokens"]
            assert n == (without if excluded else plain)
            assert await served_again_as_predicted(c, base, none, n) > 0
            first = await c.post(base + "/v1/chat/completions", json=chat)
            assert first.json()["usage"]["prompt_tokens"] == plain
