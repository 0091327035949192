"""GPT-OSS chats: the router renders them in harmony, to the ids vLLM prefills.

Ground truth: ``tests/fixtures/vllm-captures/harmony-chats.json``, each body rendered by vLLM
0.32's own chat request model and harmony method (``scripts/record_harmony_chats.py``), with
system messages as developer instructions (vLLM's default) and as system instructions
(``VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS``), refusals included. The opt-in real-vLLM suite
routes a GPT-OSS model's chats through the router end to end (kind ``sinks``).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_router_support import config_for, serve_router, until, write_tokenizer

from router import harmony
from router.config import Config, ConfigError
from router.config_rules import validate
from router.core import _harmony
from router.harmony import HarmonyChats, HarmonyError, HarmonyRenderer
from router.tokenize import PromptTokenizer, TokenizeError
from simulator.harmony_chat import HarmonyChat, HarmonyChatError
from simulator.testing import running_fleet

pytestmark = pytest.mark.timeout(120)

FIXTURE = Path(__file__).parent / "fixtures/vllm-captures/harmony-chats.json"
DOC = json.loads(FIXTURE.read_text())
CASES = DOC["cases"]
DATE = DOC["start_date"]


@pytest.fixture(scope="module")
def renderers() -> dict[bool, HarmonyRenderer]:
    return {si: HarmonyRenderer(DATE, system_instructions=si) for si in (False, True)}


def test_the_fixture_covers_what_it_claims():
    assert DOC["vllm_version"] == "0.32.0"
    names = {c["name"] for c in CASES}
    assert {"system", "tool-round-trip", "reasoning-turns", "later-system"} <= names
    assert {c["system_instructions"] for c in CASES} == {False, True}
    assert sum("error" in c for c in CASES) == 4  # two refusals, both modes


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c['name']}-si{int(c['system_instructions'])}"
)
def test_each_chat_renders_to_the_ids_vllm_prefills(case: dict[str, Any], renderers):
    r = renderers[case["system_instructions"]]
    if "error" in case:
        with pytest.raises(HarmonyError):
            r.render(case["body"])
    else:
        assert r.render(case["body"]) == case["prompt_token_ids"]


def test_messages_render_once_and_the_cache_keeps_its_bound(monkeypatch: pytest.MonkeyPatch):
    """A message's ids come from the cache the second time (with or without function tools in
    the conversation, which changes how the library renders it), and equal vLLM's; a cache of
    64 tokens holds at most 64 and renders the same ids."""
    rendered = [c for c in CASES if "error" not in c and not c["system_instructions"]]
    warm = HarmonyRenderer(DATE)
    for case in rendered + rendered:
        assert warm.render(case["body"]) == case["prompt_token_ids"], case["name"]
    assert warm._cached_tokens == sum(max(len(v), 64) for v in warm._messages.values()) > 64
    monkeypatch.setattr(harmony, "MESSAGE_CACHE_TOKENS", 64)
    tiny = HarmonyRenderer(DATE)
    for case in rendered + rendered:
        assert tiny.render(case["body"]) == case["prompt_token_ids"], case["name"]
        assert tiny._cached_tokens <= 64


async def test_a_long_first_render_gives_the_event_loop_turns(renderers):
    """The library holds the GIL while it renders: a conversation of many turns seen for the
    first time is rendered a slice at a time, the loop serving others in between, and the ids
    are the same as in one go."""
    for case in CASES:
        if "error" not in case:
            got = await renderers[case["system_instructions"]].render_async(case["body"])
            assert got == case["prompt_token_ids"], case["name"]
    messages: list[dict[str, Any]] = []
    for i in range(400):
        messages.append({"role": "user", "content": " ".join(f"u{i}w{j}" for j in range(60))})
        messages.append({"role": "assistant", "content": f"answer {i}"})
    messages.append({"role": "user", "content": "and now?"})
    turns = 0
    rendering = True

    async def other_requests() -> None:
        nonlocal turns
        while rendering:
            turns += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(other_requests())
    await asyncio.sleep(0)
    fresh = HarmonyRenderer(DATE)
    ids = await fresh.render_async({"messages": messages})
    rendering = False
    await ticker
    assert ids == HarmonyRenderer(DATE).render({"messages": messages})
    assert turns > 10, turns


def test_the_template_and_harmony_part_where_the_router_used_to_lose_a_system_prompt(renderers):
    """The GPT-OSS template closes the developer message with a blank line; vLLM (harmony)
    does not: the ids part right after the system prompt's text."""
    case = next(c for c in CASES if c["name"] == "system" and not c["system_instructions"])
    text = renderers[False]._enc.decode(case["prompt_token_ids"])
    assert "# Instructions\n\nBe brief.<|end|>" in text
    assert "Be brief.\n\n<|end|>" not in text


def test_the_simulator_renders_harmony_as_vllm_does(monkeypatch: pytest.MonkeyPatch):
    """The simulated GPT-OSS worker writes the harmony text itself (no tools): on every such
    body of the fixture, the ids vLLM prefills; bodies with tools it refuses."""
    monkeypatch.setenv("VLLM_SYSTEM_START_DATE", DATE)
    sim = HarmonyChat()
    rendered = 0
    for c in CASES:
        if c["system_instructions"] or "error" in c:
            continue
        if c["body"].get("tools") or any(m["role"] == "tool" for m in c["body"]["messages"]):
            with pytest.raises(HarmonyChatError):
                sim.render(c["body"])
            continue
        assert sim.render(c["body"]) == c["prompt_token_ids"], c["name"]
        rendered += 1
    assert rendered == 16


def test_the_date_is_the_workers_today_unless_pinned():
    want = next(c for c in CASES if c["name"] == "user" and not c["system_instructions"])
    body = want["body"]
    today = HarmonyRenderer(today=lambda: "2031-01-02")
    assert today.start_date() == "2031-01-02"
    pinned = HarmonyRenderer("2026-03-14", today=lambda: "2031-01-02")
    assert pinned.start_date() == "2026-03-14"
    assert pinned.render(body) == want["prompt_token_ids"]
    assert today.render(body) != want["prompt_token_ids"]
    assert today.render(body, "2026-03-14") == want["prompt_token_ids"]


@pytest.mark.parametrize(
    "body",
    [
        {"messages": "hi"},
        {"messages": [{"role": "user", "content": "hi"}], "tools": {"x": 1}},
        {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
        {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "max"},
        {"messages": [{"role": "assistant", "tool_calls": "x", "content": "hi"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        {"messages": [{"role": "user", "content": 5}]},
        {"messages": [{"role": 7, "content": "hi"}]},
    ],
)
def test_a_body_vllm_refuses_is_a_clear_error_never_a_crash(body: dict[str, Any], renderers):
    with pytest.raises(HarmonyError):
        renderers[False].render(body)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3)
    ),
    max_leaves=12,
)
_field = st.sampled_from(["role", "content", "tool_calls", "tool_call_id", "reasoning", "text"])
_function = st.fixed_dictionaries({"name": st.text(max_size=5)}, optional={"parameters": _json})
_role = st.sampled_from(["user", "assistant", "tool", "system", "developer"])
_content = (
    st.none() | st.text(max_size=8) | st.lists(st.fixed_dictionaries({"text": st.text(max_size=5)}))
)
_call = st.fixed_dictionaries({"id": st.text(max_size=3), "function": _function})
_turn = st.fixed_dictionaries(
    {"role": _role, "content": _content},
    optional={"reasoning": st.text(max_size=5), "tool_calls": st.lists(_call, max_size=2)},
)
_message = _turn | st.dictionaries(
    _field, _json | st.sampled_from(["user", "assistant", "tool", "system"])
)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    messages=st.lists(_message, max_size=4),
    tools=st.none() | st.lists(st.fixed_dictionaries({"function": _function}), max_size=2) | _json,
    effort=st.none() | st.sampled_from(["low", "high", "none"]) | _json,
)
def test_any_body_renders_or_is_refused(messages, tools, effort, renderers):
    body = {"messages": messages, "tools": tools, "reasoning_effort": effort}
    try:
        ids = renderers[False].render(body)
    except HarmonyError:
        return
    assert ids and all(isinstance(i, int) for i in ids)


async def test_chats_tokenize_in_harmony_and_completions_do_not():
    tok = PromptTokenizer(16, harmony=HarmonyChats(DATE, everywhere=True))
    asked: list[Any] = []

    async def remote(payload: Any) -> Any:
        asked.append(payload)
        raise TokenizeError("no worker here")

    case = next(c for c in CASES if c["name"] == "tool-round-trip" and not c["system_instructions"])
    got = await tok.tokenize(case["body"], True, 0, remote)
    assert got.source == "harmony" and got.n_tokens == len(case["prompt_token_ids"])
    assert got.data == b"".join(i.to_bytes(4, "little") for i in case["prompt_token_ids"])
    assert (await tok.tokenize(case["body"], True, 0, remote)).source == "cache"
    assert not asked
    with pytest.raises(TokenizeError, match="no worker here"):
        await tok.tokenize({"prompt": "plain text"}, False, 0, remote)
    with pytest.raises(TokenizeError, match="reasoning_effort"):
        await tok.tokenize({**case["body"], "reasoning_effort": "none"}, True, 0, remote)


async def test_a_new_day_is_a_new_prompt_not_a_stale_cache_entry():
    day = ["2026-03-14"]
    tok = PromptTokenizer(16, harmony=HarmonyChats(everywhere=True, today=lambda: day[0]))
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    first = await tok.tokenize(body, True, 0, None)
    day[0] = "2026-03-15"
    second = await tok.tokenize(body, True, 0, None)
    assert second.source == "harmony" and second.data != first.data


def test_chat_format_is_checked_and_auto_reads_the_model_folder(tmp_path: Path):
    with pytest.raises(ConfigError, match="chat_format"):
        cfg = Config()
        cfg.model.chat_format = "jinja"
        validate(cfg)
    model = Path(write_tokenizer(tmp_path / "gptoss"))
    (model / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    local = Config()
    local.tokenizer.mode, local.tokenizer.path = "local", str(model)
    assert _harmony(local).everywhere  # type: ignore[union-attr]
    local.model.chat_format = "template"
    assert _harmony(local) is None
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    local.model.chat_format = "auto"
    auto = _harmony(local)
    assert auto is not None and not auto.everywhere and not auto.covers("sim-model")
    auto.learn(["gpt-oss", "oss-alias"], default=True)
    assert auto.covers("oss-alias") and auto.covers(None) and not auto.covers("llama")
    remote = Config()
    assert not _harmony(remote).everywhere  # type: ignore[union-attr]  # the self-check learns
    remote.model.chat_format, remote.model.harmony_start_date = "harmony", DATE
    assert _harmony(remote).renderer.start_date() == DATE  # type: ignore[union-attr]


FAST = {"decode_ms": 1, "prefill_tps": 400000, "step_overhead_ms": 0.1, "num_gpu_blocks": 512}


async def _selfcheck(c: httpx.AsyncClient, base: str) -> dict[str, Any]:
    async def checked() -> Any:
        d = (await c.get(base + "/debug/index")).json()["workers"][0]["selfcheck"] or {}
        return d if d.get("events") not in (None, "pending") else None

    return await until(checked, 30, "the self-check")


async def test_the_self_check_finds_harmony_workers_and_chats_are_predicted_exactly():
    """Default configuration (``chat_format: auto``, tokenizing through the workers) in front of
    simulated GPT-OSS workers, which render chat completions in harmony and ``/tokenize`` with
    the template, as vLLM does: the self-check's probe chat finds it, the router renders the
    model's chats in harmony, and a conversation's next turn is credited what the worker finds,
    whether it comes as a chat or as a Responses request (rendered from its items as vLLM
    renders them, to the same messages). An Anthropic request with thinking disabled gets the
    effort vLLM's harmony probe gives it ("low"), whatever the template writes for "none"."""
    with running_fleet(2, chat_format="harmony", **FAST) as fleet:
        cfg = config_for(fleet)
        async with serve_router(cfg) as (base, _router), httpx.AsyncClient(timeout=30) as c:
            await until(lambda: c.get(base + "/ready"), 20)
            assert (await _selfcheck(c, base))["chat_format"] == "harmony"
            system = {"role": "system", "content": " ".join(f"rule {i}." for i in range(60))}
            turns = [system, {"role": "user", "content": "Tell me about rain."}]
            body = {"model": "sim-model", "messages": turns, "max_tokens": 8}
            e = (await c.post(base + "/debug/route", json=body)).json()
            assert e["tokenization"] == "harmony"
            r = await c.post(base + "/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == e["prompt_tokens"]
            first = r.headers["x-kvrouter-worker"]
            answer = r.json()["choices"][0]["message"]["content"]
            turns = [*turns, {"role": "assistant", "content": answer}]
            body = {**body, "messages": [*turns, {"role": "user", "content": "And snow?"}]}

            async def credited() -> Any:
                e = (await c.post(base + "/debug/route", json=body)).json()
                return e if e["chosen"] == first and e["predicted_hit_tokens"] > 256 else None

            e = await until(credited, 20, "the first turn's blocks in the index")
            r = await c.post(base + "/v1/chat/completions", json=body)
            usage = r.json()["usage"]
            assert r.headers["x-kvrouter-worker"] == first
            assert usage["prompt_tokens"] == e["prompt_tokens"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == e["predicted_hit_tokens"]
            # The same conversation continued through the Responses API, which vLLM renders
            # from its items to the same harmony messages: credited on the same worker.
            items = [
                {"role": "user", "content": "Tell me about rain."},
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "And snow?"},
            ]
            resp = {"model": "sim-model", "instructions": system["content"], "input": items}
            e2 = (await c.post(base + "/debug/route?path=/v1/responses", json=resp)).json()
            assert e2["tokenization"] in ("harmony", "cache"), e2
            assert e2["routing"].startswith("by cache") and "harmony" in e2["routing"], e2
            now = (await c.post(base + "/debug/route", json=body)).json()
            assert e2["chosen"] == first and e2["prompt_tokens"] == now["prompt_tokens"]
            assert e2["predicted_hit_tokens"] == now["predicted_hit_tokens"] > 256
            # Anthropic's thinking disabled: vLLM probes the effort it becomes by rendering in
            # harmony, which refuses "none" (the worker's template writes it): "low". Its
            # prompt is the chat's at effort "low", whose blocks are credited.
            low = {"model": "sim-model", "messages": turns[:2], "reasoning_effort": "low"}
            r = await c.post(base + "/v1/chat/completions", json={**low, "max_tokens": 1})
            assert r.status_code == 200, r.text
            holder = r.headers["x-kvrouter-worker"]
            off = {"model": "sim-model", "max_tokens": 8, "system": system["content"],
                   "messages": [turns[1]], "thinking": {"type": "disabled"}}  # fmt: skip

            async def low_credited() -> Any:
                q = "/debug/route?path=/v1/messages"
                e = (await c.post(base + q, json=off)).json()
                return e if e["chosen"] == holder and e["predicted_hit_tokens"] > 256 else None

            e3 = await until(low_credited, 20, "the effort-low chat's blocks credited")
            assert e3["routing"].startswith("by cache"), e3
            assert e3["tokenization"] in ("harmony", "cache"), e3
            assert e3["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]


async def test_a_template_fleet_never_loads_harmony():
    with running_fleet(1, **FAST) as fleet:
        async with serve_router(config_for(fleet)) as (base, router), httpx.AsyncClient() as c:
            await until(lambda: c.get(base + "/ready"), 20)
            assert (await _selfcheck(c, base))["chat_format"] == "template"
            chat = {"messages": [{"role": "user", "content": "hi"}]}
            e = (await c.post(base + "/debug/route", json=chat)).json()
            assert e["tokenization"] == "remote"
            assert router.tokenizer.harmony is not None
            assert router.tokenizer.harmony._renderer is None  # 70 MB not paid


async def test_a_worker_rendering_chats_otherwise_is_named():
    """The router expects harmony's system instructions where the worker puts them in the
    developer message: neither count matches, and the self-check says so."""
    with running_fleet(1, chat_format="harmony", **FAST) as fleet:
        cfg = config_for(fleet, model={"harmony_system_instructions": True})
        async with serve_router(cfg) as (base, router), httpx.AsyncClient() as c:
            await until(lambda: c.get(base + "/ready"), 20)
            check = await _selfcheck(c, base)
            assert check["chat_format"] == "mismatch", check
            assert "harmony" in check["chat_format_detail"]
            assert not router.tokenizer.harmony.covers("sim-model")  # type: ignore[union-attr]
