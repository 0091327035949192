"""Shortest prefill first through vLLM's request priority: the class the router writes, the order
a simulated worker running ``--scheduling-policy priority`` then serves requests in (end to end
over HTTP), a client's own priority kept, a worker that refuses priorities getting none, the
router's aging of a request passed over too long, and the counts in /metrics."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx
from test_router_support import config_for, serve_router, until, words, worker_load

from router.prefill_priority import (
    PRIORITY_UNIT_TOKENS,
    prefill_class,
    prefill_priority,
    with_prefill_priority,
)
from simulator.testing import running_fleet

PREFILL_TPS = 1500  # simulated prefill: the 3,000-token blocker holds its engine 2 s
BLOCKER_TOKENS = 3000
LONG_TOKENS = 1500
SHORT_TOKENS = 60


def test_the_class_is_the_power_of_two_of_the_uncached_prefill() -> None:
    u = PRIORITY_UNIT_TOKENS
    assert [prefill_class(n) for n in (-5, 0, u - 1)] == [0, 0, 0]
    assert [prefill_class(n) for n in (u, 2 * u - 1, 2 * u, 4 * u - 1, 4 * u)] == [1, 1, 2, 2, 3]
    assert prefill_class(131_072) == 9
    body = {"prompt": "x", "max_tokens": 1}
    assert with_prefill_priority(body, 2) == {**body, "priority": 2}
    assert "priority" not in body  # a new body; the parsed one is left as it was
    assert with_prefill_priority({**body, "priority": 0}, 2) is None  # the client's own


@dataclass
class _Sent:
    uncached: int
    sent_s: float
    prefill_pending: bool = True


def test_a_request_waiting_past_its_allowance_is_passed_by_no_later_one() -> None:
    """Once a request has waited ``max_wait_s`` beyond its own prefill, later requests to its
    engine get no class below its own: they queue behind it (arrival order within a class)."""
    u = PRIORITY_UNIT_TOKENS
    rule = {"max_wait_s": 10.0, "tokens_per_s": 1000.0}
    long = _Sent(8 * u, sent_s=0.0)  # class 4, its prefill alone ~4.1 s at 1,000 tokens/s
    assert prefill_priority(100, [long], 14.0, **rule) == 0  # 14 - 4.1 < 10: still passed over
    assert prefill_priority(100, [long], 14.2, **rule) == 4  # now behind it
    assert prefill_priority(20 * u, [long], 14.2, **rule) == 5  # a longer one keeps its class
    started = _Sent(8 * u, sent_s=0.0, prefill_pending=False)  # first token counted
    shorter = _Sent(u, sent_s=0.0)  # class 1, overdue too
    assert prefill_priority(100, [started, shorter], 100.0, **rule) == 1
    assert prefill_priority(100, [], 100.0, **rule) == 0


def _body(n: int, seed: Any, **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "prompt": words(n, seed), "max_tokens": 1, **extra}


async def _finish_order(base: str, worker_url: str, c: httpx.AsyncClient) -> list[str]:
    """A blocker prefilling, then a long request, three short ones and a short one carrying the
    client's own low priority queued behind it: the order their answers come back in."""
    finished: list[str] = []

    async def send(label: str, body: dict[str, Any]) -> None:
        r = await c.post(base + "/v1/completions", json=body)
        assert r.status_code == 200, (label, r.text)
        finished.append(label)

    # Each run's router listens on its own port: the prompts differ, nothing is cached.
    blocker = asyncio.create_task(send("blocker", _body(BLOCKER_TOKENS, f"b{base}")))
    await until(lambda: worker_load(c, worker_url, "running"), 10, "the blocker running")
    rest = [asyncio.create_task(send("long", _body(LONG_TOKENS, f"l{base}")))]
    await until(lambda: worker_load(c, worker_url, "waiting"), 10, "the long request waiting")
    rest += [
        asyncio.create_task(send(f"short{i}", _body(SHORT_TOKENS, f"s{i}{base}"))) for i in range(3)
    ]
    rest.append(asyncio.create_task(send("own", _body(SHORT_TOKENS, f"o{base}", priority=20))))
    await asyncio.gather(blocker, *rest)
    return finished


async def test_a_priority_worker_serves_short_prefills_before_an_earlier_long_one() -> None:
    with running_fleet(1, prefill_tps=PREFILL_TPS, decode_ms=1, scheduling_policy="priority") as ws:
        async with httpx.AsyncClient(timeout=60) as c:
            cfg = config_for(ws, policy={"prefill_priority": True})
            async with serve_router(cfg) as (base, router):
                assert router.selfcheck is not None
                assert router.selfcheck.results[ws[0].url]["priority"] == "ok"
                route = await c.post(base + "/debug/route", json=_body(LONG_TOKENS, "explain"))
                assert route.json()["prefill_priority"] == 2  # about 1,500 tokens: [1024, 2048)
                own = _body(LONG_TOKENS, "explain", priority=7)
                route = await c.post(base + "/debug/route", json=own)
                assert route.json()["prefill_priority"] is None  # the client's is kept
                order = await _finish_order(base, ws[0].url, c)
                text = (await c.get(base + "/metrics")).text
            # Written: the blocker's class 3, the long one's 2, the three short ones' 0; none for
            # the request that carried its own. /debug/route's answers are not counted.
            for cls, n in (("0", 3), ("2", 1), ("3", 1)):
                line = f'kvrouter_prefill_priority_total{{class="{cls}",lifted="false"}} {n}.0'
                assert line in text, text
            assert 'lifted="true"' not in text
            # The short prefills (class 0) pass the long one (class 2) queued before them; the
            # short request whose client asked for priority 20 keeps it and comes last.
            assert order[0] == "blocker" and order[-2:] == ["long", "own"], order
            assert sorted(order[1:4]) == ["short0", "short1", "short2"], order

            async with serve_router(config_for(ws)) as (base, _router):
                order = await _finish_order(base, ws[0].url, c)
            # Without it every request the router sends has priority 0: arrival order, so the
            # long one is served second and the short ones wait for its whole prefill.
            assert order[:2] == ["blocker", "long"] and order[-1] == "own", order


async def test_a_worker_refusing_priorities_gets_none_and_its_requests_succeed() -> None:
    """vLLM's V0 engine answers a non-zero priority 400 without priority scheduling; its V1
    engine takes it and ignores it. The self-check tells them apart; a request that may go to
    the refusing worker (first choice or retry) carries none, and every request succeeds."""
    fast = {"prefill_tps": 20_000, "decode_ms": 1}
    with running_fleet(1, reject_priority=True, **fast) as v0, running_fleet(1, **fast) as v1:
        cfg = config_for([*v0, *v1], policy={"prefill_priority": True})
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=60) as c:
            assert router.selfcheck is not None
            res = router.selfcheck.results[v0[0].url]
            assert res["priority"] == "refused", res
            assert "--scheduling-policy priority" in res["priority_detail"]
            assert "Priority scheduling is not enabled" in res["priority_detail"]
            assert router.registry.workers[v0[0].url].priority_refused == res["priority_detail"]
            assert router.selfcheck.results[v1[0].url]["priority"] == "ok"
            assert router.registry.workers[v1[0].url].priority_refused is None
            # Long prompts would be class >= 1, which the V0 worker answers 400: with two
            # workers each request may reach it, so none carries a priority.
            for i in range(4):
                r = await c.post(base + "/v1/completions", json=_body(LONG_TOKENS, f"r{i}"))
                assert r.status_code == 200, r.text
            route = await c.post(base + "/debug/route", json=_body(LONG_TOKENS, "refused"))
            assert route.json()["prefill_priority"] is None
            index = (await c.get(base + "/debug/index")).json()
            by_url = {w["url"]: w["selfcheck"]["priority"] for w in index["workers"]}
            assert by_url == {v0[0].url: "refused", v1[0].url: "ok"}


async def test_later_requests_queue_behind_one_that_waited_past_its_allowance() -> None:
    """Over HTTP: a blocker prefilling on a priority worker has no first token yet; once it is
    ``prefill_priority_max_wait_s`` past its own prefill time (at the configured rate), the
    priority written for a short prompt to that worker is the blocker's class, not its own."""
    with running_fleet(1, prefill_tps=PREFILL_TPS, decode_ms=1, scheduling_policy="priority") as ws:
        policy = {"prefill_priority": True, "prefill_priority_max_wait_s": 0.3}
        cfg = config_for(ws, policy=policy)
        async with serve_router(cfg) as (base, _router), httpx.AsyncClient(timeout=60) as c:
            short = _body(SHORT_TOKENS, "short")

            async def written() -> int | None:
                r = await c.post(base + "/debug/route", json=short)
                return r.json()["prefill_priority"]

            assert await written() == 0
            blocker = asyncio.create_task(
                c.post(base + "/v1/completions", json=_body(BLOCKER_TOKENS, "blocker"))
            )
            # 3,000 tokens: class 3; overdue 0.3 s after its 0.375 s at 8,000 tokens/s, while
            # its 2 s prefill still runs.
            await until(lambda: _is(written, 3), 10, "the blocker's class written")
            sent = await c.post(base + "/v1/completions", json=_body(SHORT_TOKENS, "lifted"))
            assert sent.status_code == 200 and (await blocker).status_code == 200
            text = (await c.get(base + "/metrics")).text
            assert 'kvrouter_prefill_priority_total{class="3",lifted="true"} 1.0' in text
            await until(lambda: _is(written, 0), 10, "its own class once the blocker answered")


async def _is(value: Any, expected: int) -> bool:
    return await value() == expected
