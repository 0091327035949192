"""A request answered whole (``stream: false``) shows the router no first token: its prefill is
released by the worker's own first-token count at each poll (``Worker.observe_first_tokens``),
not when the whole answer is back. The rule on its own, the simulator's histogram, and end to
end over HTTP against a simulated worker whose decode is slow."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from test_router_support import config_for, offline_worker, serve_router, until, words

from router.config import ConfigError, parse_config
from router.proxy import Ticket
from router.workers import parse_vllm_metrics
from simulator.testing import running_fleet


def test_first_token_counts_release_the_oldest_buffered_requests() -> None:
    w = offline_worker()
    ld = w.load(0)
    assert w.observe_first_tokens(0, 10) == 0  # the engine's history: only the baseline
    a, b, c = (Ticket(w, 0, 100, buffered=True) for _ in range(3))
    stream = Ticket(w, 0, 50)
    stream.first_token()  # the router saw this one itself
    assert ld.queued_prefill_tokens == 300
    # Two first tokens counted, one of them the stream's: the oldest buffered one goes.
    assert w.observe_first_tokens(0, 12) == 1
    assert ld.queued_prefill_tokens == 200 and ld.prefilling_requests == 2
    # More counted than this router has waiting (other clients'): never more than its own.
    assert w.observe_first_tokens(0, 20) == 2
    assert ld.queued_prefill_tokens == 0 and ld.prefilling_requests == 0
    for t in (a, b, c, stream):
        t.finish()
    assert ld.inflight_requests == 0
    assert w.observe_first_tokens(0, 20) == 0  # answers already released count nothing
    # An answer back before any poll counted it is the router's own sighting.
    d = Ticket(w, 0, 10, buffered=True)
    d.finish()
    e = Ticket(w, 0, 10, buffered=True)
    assert w.observe_first_tokens(0, 21) == 0 and ld.queued_prefill_tokens == 10
    # A restarted engine counts from zero: a new baseline, nothing released on it.
    assert w.observe_first_tokens(0, 3) == 0 and ld.queued_prefill_tokens == 10
    # Another client's first token, with this router's request still waiting: it stays.
    assert w.observe_first_tokens(0, 4, waiting=1) == 0 and ld.queued_prefill_tokens == 10
    assert w.observe_first_tokens(0, 5, waiting=0) == 1 and ld.queued_prefill_tokens == 0
    # Released by the count, it is still told of a stall until its answer is back.
    told: list[str] = []
    e.on_stall = lambda: told.append("aborted")
    e.stall("stalled")
    assert told == ["aborted"]
    e.finish()
    assert ld.inflight_requests == 0 and not w.awaiting_first[0]


def test_a_request_with_n_choices_is_counted_as_vllm_counts_it() -> None:
    """vLLM runs ``n`` child requests for a request with ``n`` choices: its waiting gauge and
    first-token count count each. A buffered request with n = 4 needs four first tokens to be
    released, and holds four of the waiting; a stream of n = 3 seen by the router is three."""
    w = offline_worker()
    ld = w.load(0)
    assert w.observe_first_tokens(0, 0) == 0
    four = Ticket(w, 0, 100, buffered=True, sequences=4)
    one = Ticket(w, 0, 50, buffered=True)
    assert ld.prefilling_requests == 5
    # Three children have their first token: not yet the whole request.
    assert w.observe_first_tokens(0, 3) == 0 and ld.queued_prefill_tokens == 150
    # The fourth: released; the next one (one sequence, still waiting) stays.
    assert w.observe_first_tokens(0, 4, waiting=1) == 1
    assert ld.queued_prefill_tokens == 50 and ld.prefilling_requests == 1
    # Four waiting sequences: the newest requests holding them (here both) are not released.
    five = Ticket(w, 0, 10, buffered=True, sequences=3)
    assert w.observe_first_tokens(0, 9, waiting=4) == 0
    assert w.observe_first_tokens(0, 10, waiting=3) == 1 and ld.queued_prefill_tokens == 10
    # A stream with three choices the router saw start: three of the engine's count.
    stream = Ticket(w, 0, 20, sequences=3)
    stream.first_token()
    assert w.observe_first_tokens(0, 13) == 0 and ld.queued_prefill_tokens == 10
    assert w.observe_first_tokens(0, 16) == 1 and ld.queued_prefill_tokens == 0
    for t in (four, one, five, stream):
        t.finish()
    assert ld.inflight_requests == 0 and ld.prefilling_requests == 0


@pytest.mark.parametrize("n", [1, 4])
async def test_a_buffered_requests_prefill_is_released_while_it_decodes(n: int) -> None:
    """Also with ``n`` choices: vLLM counts each child's first token, the router all of them."""
    with running_fleet(1, prefill_tps=20_000, decode_ms=100) as ws:
        cfg = config_for(ws, server={"worker_poll_s": 0.25})
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=60) as c:
            assert router.registry.poll_interval_s == 0.25
            body = {"model": "sim-model", "prompt": words(300, "b"), "max_tokens": 150, "n": n}
            answer = asyncio.create_task(c.post(base + "/v1/completions", json=body))

            async def load() -> dict:
                doc = (await c.get(base + "/debug/index")).json()
                return doc["workers"][0]["engines"][0]["load"]

            # Its 150 tokens take 15 s to decode; a poll (every 0.25 s) sees its first token.
            await until(lambda: _released(load), 5, "its prefill released by the poll")
            assert not answer.done()
            assert (await load())["prefilling_requests"] == 0
            text = (await c.get(ws[0].url + "/metrics")).text
            assert parse_vllm_metrics(text)[0]["first_tokens"] >= 1.0  # the self-check's too
            assert 'vllm:time_to_first_token_seconds_bucket{engine="0"' in text
            answer.cancel()
            await asyncio.gather(answer, return_exceptions=True)


async def test_the_self_checks_own_first_tokens_release_no_buffered_request() -> None:
    """The self-check's probes are answered after the registry's first poll set the engine's
    first-token baseline: the next poll counts them, and they are the router's own, so a
    buffered request still prefilling there keeps its prefill counted."""
    with running_fleet(1, prefill_tps=300, decode_ms=1) as ws:
        cfg = config_for(ws)  # polls every 1 s: the probes and the request fall between two
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=60) as c:
            body = {"model": "sim-model", "prompt": words(1500, "slow"), "max_tokens": 1}
            answer = asyncio.create_task(c.post(base + "/v1/completions", json=body))
            (w,) = router.registry.workers.values()
            ld = w.load(0)
            await until(lambda: ld.inflight_requests == 1, 5, "the request sent")
            polled = w.metrics_ts
            await until(lambda: w.metrics_ts > polled + 1.5, 5, "two polls more")
            # Its 1,500 tokens take 5 s at 300 tokens/s: still prefilling, still counted.
            assert ld.prefilling_requests == 1 and ld.queued_prefill_tokens >= 1500
            assert (await answer).status_code == 200
            assert ld.prefilling_requests == 0 and ld.queued_prefill_tokens == 0


def test_the_worker_poll_interval_is_a_setting() -> None:
    assert parse_config({}).server.worker_poll_s == 1.0
    assert parse_config({"server": {"worker_poll_s": 0.25}}).server.worker_poll_s == 0.25
    with pytest.raises(ConfigError, match=r"server\.worker_poll_s: must be >= 0\.05"):
        parse_config({"server": {"worker_poll_s": 0.01}})


async def _released(load) -> dict | None:  # type: ignore[no-untyped-def]
    ld = await load()  # in flight on the engine, its prefill no longer counted
    return ld if ld["inflight_requests"] == 1 and ld["queued_prefill_tokens"] == 0 else None
