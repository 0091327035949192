"""Where each engine's prefill queue stands: the router's own requests there in the order they
were sent, the oldest (the head) being prefilled since the engine's clock last restarted (the
last first token there, or the send that found nothing queued), and the engine's prefill rate
sampled from its streamed first tokens over that clock.
The rule on the router's tickets, and end to end over HTTP against a simulated worker whose
prefill rate is known."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from test_router_support import config_for, offline_worker, serve_router, until, words

from router.proxy import Ticket
from simulator.testing import running_fleet


def test_the_clock_restarts_at_each_first_token_and_times_the_prefill() -> None:
    w = offline_worker()
    ld = w.load(0)
    a = Ticket(w, 0, 1000, now=0.0)
    b = Ticket(w, 0, 2000, now=1.0)
    assert (ld.head_tokens, ld.head_since) == (1000, 0.0)  # a queued first: the engine's head
    a.first_token(2.0, prefilled=True)
    assert (ld.prefilled_tokens, ld.prefill_seconds) == (1000, 2.0)
    assert (ld.head_tokens, ld.head_since) == (2000, 2.0)  # b waited for a: begun at a's token
    b.first_token(2.5)  # a failure, or a whole answer: no sample, the clock restarts
    assert (ld.prefilled_tokens, ld.prefill_seconds) == (1000, 2.0)
    assert ld.head_tokens == 0 and ld.queued_prefill_tokens == 0
    c = Ticket(w, 0, 500, now=5.0)  # an idle engine starts it when it is sent
    assert (ld.head_tokens, ld.head_since) == (500, 5.0)
    d = Ticket(w, 0, 800, now=5.5)
    # d passes the head (priority scheduling): the engine's time since 5.0 went to d, and it
    # turns back to c now.
    d.first_token(6.0, prefilled=True)
    assert (ld.prefilled_tokens, ld.prefill_seconds) == (1800, 3.0)
    assert (ld.head_tokens, ld.head_since) == (500, 6.0)
    c.first_token(6.5, prefilled=True)
    assert (ld.prefilled_tokens, ld.prefill_seconds) == (2300, 3.5)
    assert ld.head_tokens == 0
    for t in (a, b, c, d):
        t.finish(7.0)
    assert ld.inflight_requests == 0 and not w.prefilling[0]
    assert ld.head_since == 6.5  # finishing after the first token changes nothing


def test_a_buffered_request_released_by_the_poll_is_a_late_sample() -> None:
    """Without the engine's TTFT sum the poll sees a first token up to a poll interval late:
    its sample errs long (a low rate, the safe side), the next request is taken to begin then,
    and a fleet of clients that ask for whole answers still teaches the router its engines'
    rates."""
    w = offline_worker()
    ld = w.load(0)
    assert w.observe_first_tokens(0, 0, now=0.0) == 0  # the baseline
    a = Ticket(w, 0, 3000, buffered=True, now=0.0)
    Ticket(w, 0, 4000, now=0.5)
    assert w.observe_first_tokens(0, 1, now=2.0) == 1
    assert (ld.prefilled_tokens, ld.prefill_seconds) == (3000, 2.0)
    assert (ld.head_tokens, ld.head_since) == (4000, 2.0)
    a.finish(9.0)  # its whole answer back: already released, nothing more
    assert (ld.prefilled_tokens, ld.head_tokens) == (3000, 4000)


def test_the_engines_ttft_sum_times_a_first_token_the_poll_releases() -> None:
    """The sum's growth over the count's is the mean time to first token since the last poll:
    a released request's first token is put at its send plus that (never before the last poll
    nor after this one), so its sample holds its prefill and not the rest of the interval."""
    w = offline_worker()
    ld = w.load(0)
    assert w.observe_first_tokens(0, 0, now=0.0, ttft_sum=0.0) == 0  # the baseline
    a = Ticket(w, 0, 3000, buffered=True, now=0.2)
    Ticket(w, 0, 4000, now=0.5)
    assert w.observe_first_tokens(0, 1, now=1.0, ttft_sum=0.4) == 1
    assert ld.prefilled_tokens == 3000 and ld.prefill_seconds == pytest.approx(0.4)
    assert (ld.head_tokens, ld.head_since) == (4000, pytest.approx(0.6))
    a.finish(3.0)

    # A stream's time to first token, seen by the router, is not one of the unseen's.
    w = offline_worker()
    ld = w.load(0)
    w.observe_first_tokens(0, 0, now=0.0, ttft_sum=0.0)
    Ticket(w, 0, 500, now=0.0).first_token(0.1, prefilled=True)
    Ticket(w, 0, 3000, buffered=True, now=0.2)
    assert w.observe_first_tokens(0, 2, now=1.0, ttft_sum=0.7) == 1
    assert ld.prefilled_tokens == 3500 and ld.prefill_seconds == pytest.approx(0.1 + 0.6)

    # A mean that would put the first token before the last poll: the poll's time instead.
    w = offline_worker()
    ld = w.load(0)
    w.observe_first_tokens(0, 0, now=0.0, ttft_sum=0.0)
    Ticket(w, 0, 1000, buffered=True, now=0.1)
    assert w.observe_first_tokens(0, 0, now=1.0, ttft_sum=0.0) == 0  # not yet
    assert w.observe_first_tokens(0, 1, now=2.0, ttft_sum=0.2) == 1
    assert ld.prefill_seconds == pytest.approx(0.9)  # from its send to the last poll

    # A stream that got its first token after the buffered one's: its sample held both
    # prefills, so the buffered one adds its tokens and no time.
    w = offline_worker()
    ld = w.load(0)
    w.observe_first_tokens(0, 0, now=0.0, ttft_sum=0.0)
    Ticket(w, 0, 3000, buffered=True, now=0.0)
    b = Ticket(w, 0, 4000, now=0.1)
    b.first_token(0.5, prefilled=True)
    assert (ld.prefilled_tokens, ld.prefill_seconds) == (4000, 0.5)
    assert w.observe_first_tokens(0, 2, now=1.0, ttft_sum=0.7) == 1
    assert (ld.prefilled_tokens, ld.prefill_seconds) == (7000, 0.5)
    assert (ld.head_tokens, ld.head_since) == (0, 0.5)


async def test_a_streamed_requests_prefill_time_is_the_workers_rate() -> None:
    """A simulated worker prefilling 4,000 tokens/s: a streamed prompt's sample is its uncached
    tokens over about the time they take there, so the learned rate is the worker's."""
    with running_fleet(1, prefill_tps=4000, decode_ms=5) as ws:
        cfg = config_for(ws)
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=60) as c:
            body = {
                "model": "sim-model",
                "prompt": words(3000, "clock"),
                "max_tokens": 2,
                "stream": True,
            }
            async with c.stream("POST", base + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for _ in r.aiter_bytes():
                    pass
            ld = router.registry.workers[ws[0].url].load(0)
            await until(lambda: ld.inflight_requests == 0, 10, "the request finished")
            assert ld.prefilled_tokens > 2000  # the prompt, less the self-check's cached prefix
            rate = ld.prefilled_tokens / ld.prefill_seconds
            assert rate == pytest.approx(4000, rel=0.35), (ld.prefilled_tokens, ld.prefill_seconds)
            doc = (await c.get(base + "/debug/index")).json()
            shown = doc["workers"][0]["engines"][0]["load"]
            assert shown["prefilled_tokens"] == ld.prefilled_tokens
            assert shown["head_tokens"] == 0 and shown["head_age_s"] is None


async def test_an_answer_that_comes_whole_teaches_the_workers_rate() -> None:
    """The same prompt answered whole, decoding for seconds after its first token: the poll
    that releases its prefill (every 2 s) times its first token by the worker's TTFT sum, so
    the learned rate is the worker's, not its tokens over the wait for the poll."""
    with running_fleet(1, prefill_tps=4000, decode_ms=5) as ws:
        cfg = config_for(ws, server={"worker_poll_s": 2.0})
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=60) as c:
            body = {"model": "sim-model", "prompt": words(3000, "whole"), "max_tokens": 1000}
            sent = asyncio.create_task(c.post(base + "/v1/completions", json=body))
            ld = router.registry.workers[ws[0].url].load(0)
            await until(lambda: ld.prefilled_tokens > 2000, 10, "the poll to release it")
            assert ld.inflight_requests == 1  # released while still decoding
            rate = ld.prefilled_tokens / ld.prefill_seconds
            assert rate == pytest.approx(4000, rel=0.35), (ld.prefilled_tokens, ld.prefill_seconds)
            assert (await sent).status_code == 200


async def test_the_debug_views_show_how_long_the_engine_has_been_on_its_head() -> None:
    """While a 3,000-word prompt prefills at 1,500 tokens/s, ``/debug/index`` and
    ``/debug/route`` show the head's age in seconds (the clock itself is the process's own)."""
    with running_fleet(1, prefill_tps=1500, decode_ms=5) as ws:
        cfg = config_for(ws)
        async with serve_router(cfg) as (base, _router), httpx.AsyncClient(timeout=60) as c:
            body = {"model": "sim-model", "prompt": words(3000, "age"), "max_tokens": 1}
            sent = asyncio.create_task(c.post(base + "/v1/completions", json=body))

            async def shown() -> dict | None:
                doc = (await c.get(base + "/debug/index")).json()
                load = doc["workers"][0]["engines"][0]["load"]
                return load if load["head_tokens"] else None

            first = await until(shown, 10, "the prompt at the head")
            assert 0.0 <= first["head_age_s"] < 1.0
            later = await until(
                lambda: _older(shown, first["head_age_s"] + 0.2), 10, "the head to age"
            )
            assert later["head_tokens"] == first["head_tokens"]
            route = (
                await c.post(base + "/debug/route", json={"model": "sim-model", "prompt": "x"})
            ).json()
            ages = [w["load"]["head_age_s"] for w in route["workers"]]
            assert ages[0] is not None and ages[0] >= later["head_age_s"]
            assert (await sent).status_code == 200
            doc = (await c.get(base + "/debug/index")).json()
            assert doc["workers"][0]["engines"][0]["load"]["head_age_s"] is None


async def _older(shown: Any, age: float) -> dict | None:
    load = await shown()
    return load if load is not None and load["head_age_s"] >= age else None
