"""``truncate_prompt_tokens``: the router matches, credits and verifies the window vLLM keeps
(router/truncation.py), against simulated vLLM workers that truncate as vLLM 0.32 does; a
window it cannot know is routed by load and never counted against the index."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from test_router_support import config_for, serve_router, until, words

from router.tokenize import PromptTokenizer, Tokenized
from router.truncation import Window, prefilled_window
from simulator.testing import running_fleet

pytestmark = pytest.mark.timeout(120)

FAST = {"decode_ms": 1, "prefill_tps": 400000, "step_overhead_ms": 0.1}
BS = 16


def _window(body: dict[str, Any], n: int, specials: bool = False) -> tuple[int, int, bool] | str:
    w = prefilled_window(body, n, text_with_specials=specials)
    return w if isinstance(w, str) else (w.start, w.stop, w.verifiable)


def test_the_window_vllm_keeps() -> None:
    assert _window({}, 100) == (0, 100, True)
    assert _window({"truncate_prompt_tokens": None}, 100) == (0, 100, True)
    assert _window({"truncate_prompt_tokens": 40}, 100) == (60, 100, True)  # left by default
    assert _window({"truncate_prompt_tokens": 40, "truncation_side": "right"}, 100) == (0, 40, True)
    assert _window({"truncate_prompt_tokens": 100}, 100) == (0, 100, True)  # fits: uncut
    assert _window({"truncate_prompt_tokens": 100}, 100, specials=True) == (0, 100, True)
    # An explicit side slices the full tokens, special tokens and all.
    assert _window(
        {"truncate_prompt_tokens": 40, "truncation_side": "left"}, 100, specials=True
    ) == (60, 100, True)
    # -1: cut only past the model's context, a length the router does not know.
    assert _window({"truncate_prompt_tokens": -1}, 100) == (0, 100, False)
    for unknown in (
        ({"truncate_prompt_tokens": 40}, True),  # the tokenizer truncates, then adds specials
        ({"truncate_prompt_tokens": 0}, False),
        ({"truncate_prompt_tokens": -2}, False),
        ({"truncate_prompt_tokens": True}, False),
        ({"truncate_prompt_tokens": "40"}, False),
        ({"truncate_prompt_tokens": 40, "truncation_side": "middle"}, False),
    ):
        assert isinstance(_window(unknown[0], 100, unknown[1]), str), unknown
    assert Window(0, 5).whole(5) and not Window(1, 5).whole(5)


def test_which_prompts_are_text_with_special_tokens() -> None:
    specials = PromptTokenizer.text_with_specials
    assert specials({"prompt": "a b"}, False)
    assert specials({"prompt": ["a b"]}, False)
    assert not specials({"prompt": "a b", "add_special_tokens": False}, False)
    assert not specials({"prompt": [1, 2, 3]}, False)
    assert not specials({"messages": []}, True)
    assert specials({"messages": [], "add_special_tokens": True}, True)


def test_a_truncated_text_prompt_goes_to_the_worker_as_text() -> None:
    """vLLM's tokenizer truncates text (a BOS stays first) where it slices ids: the router's
    ids would change what the model sees."""
    tok = PromptTokenizer(unit=BS)
    got = Tokenized(3, b"\x01\x00\x00\x00" * 3, [], 0, "remote", ids_json=b"[1,1,1]")
    assert tok.upstream_ids({"prompt": "a b c"}, got) is not None
    assert tok.upstream_ids({"prompt": "a b c", "truncate_prompt_tokens": 2}, got) is None


async def _predicted(c: httpx.AsyncClient, base: str, body: dict[str, Any]) -> dict[str, Any]:
    return (await c.post(base + "/debug/route", json=body)).json()


async def _served(c: httpx.AsyncClient, base: str, body: dict[str, Any]) -> tuple[str, int, int]:
    r = await c.post(base + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    return (
        r.headers["x-kvrouter-worker"],
        u["prompt_tokens"],
        u["prompt_tokens_details"]["cached_tokens"],
    )


async def test_the_router_predicts_what_a_truncating_worker_caches() -> None:
    with running_fleet(1, **FAST) as ws:
        url = ws[0].url
        engine = (url, 0)
        async with (
            serve_router(config_for(ws)) as (base, router),
            httpx.AsyncClient(timeout=30) as c,
        ):
            await until(lambda: all(w.subscribed for w in router.registry.workers.values()), 20)
            text = words(300, "truncated")
            r = await c.post(url + "/tokenize", json={"model": "sim-model", "prompt": text})
            ids = r.json()["tokens"]
            n = len(ids)
            base_body = {"model": "sim-model", "max_tokens": 1}
            await _served(c, base, {**base_body, "prompt": text})
            await until(lambda: router.index.resident_blocks(engine) >= n // BS, 10, "events")
            ver = router.verifier
            assert ver is not None
            bodies = [
                # the last 200 ids: a window no request has computed, then the same again
                {**base_body, "prompt": ids, "truncate_prompt_tokens": 200},
                {**base_body, "prompt": ids, "truncate_prompt_tokens": 200},
                # the first 200: the head of the warm prompt
                {**base_body, "prompt": text, "add_special_tokens": False,
                 "truncate_prompt_tokens": 200, "truncation_side": "right"},
                # text without special tokens, cut from the left: the same window as the ids
                {**base_body, "prompt": text, "add_special_tokens": False,
                 "truncate_prompt_tokens": 200},
                {**base_body, "prompt": text, "truncate_prompt_tokens": 5000},  # fits: uncut
            ]  # fmt: skip
            want_cached = [0, 192, 192, 192, n // BS * BS]
            for i, (body, want) in enumerate(zip(bodies, want_cached, strict=True)):
                before = ver.state(engine).samples
                stored = router.index.churn(engine)[0]
                e = await _predicted(c, base, body)
                (row,) = e["workers"]
                assert e["tokenization"].endswith("+truncated") == (i < 4), e
                worker, prompt_tokens, cached = await _served(c, base, body)
                assert worker == url and prompt_tokens == (200 if i < 4 else n)
                assert row["gpu_hit_tokens"] == cached == want, (body, row, cached)
                assert ver.state(engine).samples == before + 1
                if i == 0:  # the one window not computed before
                    await until(
                        lambda s=stored: router.index.churn(engine)[0] >= s + 200 // BS,
                        10,
                        "the window's events",
                    )
            st = ver.state(engine)
            assert (st.over, st.under, st.unverified, st.index_resets) == (0, 0, False, {})


async def test_a_window_the_router_cannot_know_is_routed_by_load_and_not_verified() -> None:
    """Text with special tokens cut without an explicit side: the tokenizer decides what stays.
    Repeated, it neither counts against the index nor resets it."""
    with running_fleet(2, **FAST) as ws:
        async with (
            serve_router(config_for(ws)) as (base, router),
            httpx.AsyncClient(timeout=30) as c,
        ):
            await until(lambda: all(w.subscribed for w in router.registry.workers.values()), 20)
            text = words(300, "unknowable")
            warm = {"model": "sim-model", "max_tokens": 1, "prompt": text}
            url, _, _ = await _served(c, base, warm)
            await until(lambda: router.index.resident_blocks((url, 0)) > 0, 10, "events")
            body = {**warm, "truncate_prompt_tokens": 100, "truncation_side": None}
            e = await _predicted(c, base, body)
            assert e["tokenization"] == "failed" and "special tokens" in e["tokenize_error"], e
            assert all(w["gpu_hit_tokens"] == 0 for w in e["workers"])
            ver = router.verifier
            assert ver is not None
            for _ in range(6):
                _, prompt_tokens, _ = await _served(c, base, body)
                assert prompt_tokens == 100
            for w in ws:
                st = ver.state((w.url, 0))
                assert (st.samples, st.unverified, st.index_resets) == (
                    int(w.url == url),
                    False,
                    {},
                )
            # -1 leaves a prompt that fits whole: matched as it is, not verified.
            whole = {**warm, "truncate_prompt_tokens": -1}
            e = await _predicted(c, base, whole)
            assert next(w for w in e["workers"] if w["url"] == url)["gpu_hit_tokens"] >= 288
            before = ver.state((url, 0)).samples
            assert (await _served(c, base, whole))[0] == url
            assert ver.state((url, 0)).samples == before
            refused = await c.post(
                base + "/v1/completions", json={**warm, "truncate_prompt_tokens": 0}
            )
            assert refused.status_code == 400, refused.text
