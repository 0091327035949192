"""Anthropic ``/v1/messages`` bodies read as vLLM renders them: system blocks, Claude Code's
billing header and reminders, tool calls and results, thinking, tools and tool changes.

Ground truth is vLLM's own conversion, recorded from vLLM 0.32.0
(``scripts/record_request_conversions.py`` -> ``tests/fixtures/vllm-captures/
anthropic-conversion.json``). The template probe runs against simulated workers that render
with real jinja chat templates (``kvrouter-sim --tokenizer``), over real HTTP.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_router_support import CHAT_TEMPLATE, config_for, serve_router, until, write_tokenizer

from router import template_probe
from router.anthropic import chat_request, template_dependent
from router.passthrough import chat_prompt, describe
from router.tokenize import TokenIds, TokenizeError, TokenizeRefused
from simulator.testing import running_fleet

pytestmark = pytest.mark.timeout(120)

FIXTURE = Path(__file__).parent / "fixtures/vllm-captures/anthropic-conversion.json"
CASES = json.loads(FIXTURE.read_text())["cases"]

FAST = {"decode_ms": 1, "prefill_tps": 400000, "step_overhead_ms": 0.1, "num_gpu_blocks": 512}

SYSTEM_FIRST = (
    "{{ bos_token }}"
    "{% if reasoning_effort is defined and reasoning_effort == 'none' %}"
    "{{ raise_exception('reasoning_effort none is not supported') }}{% endif %}"
    "{% if tools %}<|system|>\ntools: {{ tools | tojson }}<|end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}"
    "<call>{{ c['function']['name'] }} {{ c['function']['arguments'] }}</call>{% endfor %}"
    "<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if reasoning_effort is defined %}effort {{ reasoning_effort }}\n{% endif %}{% endif %}"
)
"""Qwen-like: a system message only first, tools and tool calls rendered; refuses the
``"none"`` effort and writes any other (vLLM then disables thinking with ``"low"``)."""

THINKING = CHAT_TEMPLATE.replace(
    "<|assistant|>\n{% endif %}",
    "<|assistant|>\n{% if not enable_thinking %}<think></think>{% endif %}{% endif %}",
)
"""Inline system messages where they are; thinking switched off by ``"none"`` (Qwen3's
``enable_thinking``), so vLLM disables thinking with ``"none"``."""


def _case(label: str, merge: bool) -> dict[str, Any]:
    return next(c for c in CASES if c["label"] == label and c["merge_inline_system"] == merge)


@pytest.mark.parametrize(
    "case", CASES, ids=[f"{c['label']}-merge={c['merge_inline_system']}" for c in CASES]
)
def test_bodies_read_as_vllm_converts_them(case: dict[str, Any]) -> None:
    got = chat_request(case["request"], case["merge_inline_system"])
    assert got == (case["messages"], case["tools"])


def test_a_prompt_the_router_cannot_reproduce_is_routed_by_load() -> None:
    user = {"role": "user", "content": "hi"}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}
    clock_id = {"type": "tool_use", "name": "Bash", "input": {}}  # vLLM names it from the clock
    pic = {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}
    shot = {"type": "tool_result", "tool_use_id": "t", "content": [pic]}
    unknown = {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "Nope"}}
    refused = [
        {"messages": [{"role": "user", "content": [image]}]},
        {"messages": [user, {"role": "assistant", "content": [clock_id]}]},
        {"messages": [{"role": "user", "content": [shot]}]},
        {"messages": [user, {"role": "system", "content": [unknown]}]},
        {"messages": [{"role": "user", "content": [unknown]}]},  # vLLM: system messages only
        {"messages": [{"role": "tool", "content": "x"}]},
        {"messages": [{"role": "user", "content": [{"type": "audio"}]}]},
        {"messages": []},
        {"messages": [user], "tools": [{"name": "t"}]},  # no input_schema
        {"messages": [user], "system": [{"type": "text", "text": 5}]},
        {"messages": [{"role": "user", "content": [{"type": ["text"]}]}]},  # unhashable types
        {"messages": [user], "system": [{"type": {}}]},
    ]
    for body in refused:
        assert chat_request(body, False) is None, body
        assert chat_prompt("/v1/messages", body) is None
    # An image without a source is no image to vLLM: it is skipped, not refused.
    bare = {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a"}]}
        ]
    }
    assert chat_request(bare, False) == ([{"role": "user", "content": "a"}], None)


def test_what_depends_on_the_template_is_named() -> None:
    user = {"role": "user", "content": "a"}
    assert not template_dependent({"messages": [user]})
    assert template_dependent({"messages": [user, {"role": "system", "content": "r"}]})
    assert template_dependent({"messages": [user], "thinking": {"type": "disabled"}})
    assert not template_dependent({"messages": [user], "thinking": {"type": "enabled"}})
    case = _case("agent-turns", False)
    prompt = chat_prompt("/v1/messages", case["request"])
    assert prompt is not None
    assert describe("/v1/messages", prompt).startswith("by cache: the /v1/messages prompt read as")
    assert describe("/v1/messages", prompt).endswith("9 chat messages and 3 tools")


async def _tokenize(c: httpx.AsyncClient, url: str, payload: dict[str, Any]) -> list[int]:
    r = await c.post(url + "/tokenize", json=payload)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


async def _calls(c: httpx.AsyncClient, url: str) -> int:
    return (await c.get(url + "/sim/state")).json()["tokenize_calls"]


@pytest.mark.parametrize(
    ("template", "merge", "effort"),
    [(SYSTEM_FIRST, True, "low"), (CHAT_TEMPLATE, False, "low"), (THINKING, False, "none")],
    ids=["system-first", "inline-system", "thinking-switch"],
)
async def test_the_router_learns_the_template_as_vllm_does(
    tmp_path: Path, template: str, merge: bool, effort: str
) -> None:
    """A Claude Code turn (billing header, tools, tool results, a reminder as an inline system
    message, thinking disabled) is tokenized as vLLM renders it for that template: reminders
    merged into the system prompt where the template wants it first, and the disabled
    effort that template takes. The probe runs once per model."""
    model = write_tokenizer(tmp_path / "model", template=template)
    case = _case("agent-turns", merge)
    body = {**case["request"], "model": "sim-model", "max_tokens": 8}
    body["thinking"] = {"type": "disabled"}
    with running_fleet(1, tokenizer=model, **FAST) as fleet:
        url = fleet[0].url
        async with (
            serve_router(config_for(fleet)) as (base, _r),
            httpx.AsyncClient(timeout=30) as c,
        ):
            await until(lambda: c.get(base + "/ready"), 20)
            kwargs = {"reasoning_effort": effort, "enable_thinking": effort != "none"}
            want = await _tokenize(
                c,
                url,
                {
                    "messages": case["messages"],
                    "tools": case["tools"],
                    "chat_template_kwargs": kwargs,
                },
            )
            before = await _calls(c, url)
            r = await c.post(base + "/debug/route?path=/v1/messages", json=body)
            got = r.json()
            assert got["routing"].startswith("by cache"), got["routing"]
            assert got["prompt_tokens"] == len(want)
            probes = await _calls(c, url) - before - 1
            assert probes >= 2  # the inline-system render and at least two efforts

            # A second turn of another conversation asks no probe again.
            again = {**body, "system": "other"}
            before = await _calls(c, url)
            r = await c.post(base + "/debug/route?path=/v1/messages", json=again)
            assert r.json()["prompt_tokens"] > 0
            assert await _calls(c, url) == before + 1


async def test_the_probe_runs_once_per_model_within_its_bounds() -> None:
    """Concurrent requests share one probe; answers last ``TTL_S`` and at most ``MAX_MODELS``
    models are kept; a probe that reached no worker is not kept. The worker's ``/tokenize`` is
    a stand-in here: a template refusing ``"none"`` and inline system messages."""
    now = [0.0]
    calls: list[str] = []
    down = {"down"}

    async def tokenize(body: dict[str, Any]) -> TokenIds:
        calls.append(body["model"])
        await asyncio.sleep(0.01)
        if body["model"] in down:
            raise TokenizeError("no healthy worker")
        if body.get("reasoning_effort") == "none" or body["messages"][2:3]:
            raise TokenizeRefused("400")
        return TokenIds(b"\x01\x00\x00\x00", b"[1]")

    probe = template_probe.TemplateProbe(clock=lambda: now[0])
    got = await asyncio.gather(*(probe.traits("m", tokenize) for _ in range(50)))
    assert {(t.merge_inline_system, t.disabled_thinking_effort) for t in got} == {(True, "low")}
    once = len(calls)
    assert once == 2  # the inline-system render, then "none" refused
    await probe.traits("m", tokenize)
    assert len(calls) == once
    now[0] += template_probe.TTL_S + 1
    await probe.traits("m", tokenize)
    assert len(calls) == 2 * once
    assert await probe.traits("down", tokenize) is None
    assert await probe.traits("down", tokenize) is None
    assert calls.count("down") == 2  # not kept: asked again
    for i in range(template_probe.MAX_MODELS + 10):
        await probe.traits(f"model-{i}", tokenize)
    assert len(probe._known) == template_probe.MAX_MODELS
