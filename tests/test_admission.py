"""Admission: under overload requests wait in a router-side queue ordered by priority and fair
between API keys; a full queue or a wait past the deadline answers 429 with Retry-After; a
client that leaves gives its place back; with admission off nothing waits. End to end over HTTP
against simulated workers that prefill slowly, plus the queue's ordering and the simulator's
priority scheduling on their own."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from starlette.requests import ClientDisconnect
from test_router_support import config_for, serve_router, until, words

from router.admission import Admission, FairQueue, ShortestFirstQueue, headroom, priority_of
from router.config import ConfigError, parse_config
from router.core import Router
from simulator.engine import EngineConfig, SimEngine
from simulator.testing import running_fleet

PREFILL_TPS = 1500  # simulated prefill: a 3,000-token blocker holds its engine 2 s
BLOCKER_TOKENS = 3000
SMALL_TOKENS = 60


# ---------------------------------------------------------------- the queue's order


def test_fair_queue_orders_by_priority_then_round_robin_between_keys_then_fifo() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(4):
        q.push(0, "a", f"a{i}")
    q.push(0, "b", "b0")
    q.push(0, "b", "b1")
    q.push(5, "c", "low")
    q.push(-1, "a", "urgent")
    assert len(q) == 8 and q.depths() == {-1: 1, 0: 6, 5: 1}
    assert q.ahead_of(0) == 7
    order = [q.pop_first() for _ in range(8)]
    assert order == ["urgent", "a0", "b0", "a1", "b1", "a2", "a3", "low"]
    assert q.pop_first() is None and len(q) == 0 and q.depths() == {}


def test_fair_queue_skips_heads_that_do_not_fit_and_removes_anywhere() -> None:
    q: FairQueue[tuple[str, str]] = FairQueue()
    q.push(0, "a", ("m1", "a0"))
    q.push(0, "a", ("m2", "a1"))
    q.push(0, "b", ("m2", "b0"))
    q.push(1, "c", ("m2", "c0"))
    # Model m1's engines are full: the next item of another model goes, but never one queued
    # behind the blocked head of its own key (FIFO within a key).
    assert q.pop_first(lambda x: x[0] == "m2") == ("m2", "b0")
    assert q.pop_first(lambda x: x[0] == "m2") == ("m2", "c0")
    assert q.pop_first(lambda x: x[0] == "m2") is None
    assert q.remove(0, "a", ("m2", "a1")) and not q.remove(0, "a", ("m2", "a1"))
    assert not q.remove(7, "zz", ("m1", "a0"))
    assert len(q) == 1 and q.pop_first() == ("m1", "a0")
    assert priority_of(-3) == -3 and priority_of(True) == 0 and priority_of("1") == 0


def test_shortest_first_queue_orders_by_priority_then_size_and_the_overdue_go_first() -> None:
    q: ShortestFirstQueue[str] = ShortestFirstQueue(max_wait_s=5.0)
    q.push(0, "a", "long", size=9000, since=0.0)
    q.push(0, "b", "short", size=100, since=1.0)
    q.push(0, "a", "mid", size=2000, since=2.0)
    q.push(0, "a", "short-later", size=100, since=3.0)
    q.push(-1, "c", "urgent-long", size=50_000, since=4.0)
    assert len(q) == 5 and q.depths() == {-1: 1, 0: 4} and q.ahead_of(0) == 5
    # Priority first; within one, the smallest body, equal sizes in arrival order; API keys
    # play no part.
    assert q.pop_first(now=4.0) == "urgent-long"
    assert q.pop_first(now=4.0) == "short"
    # "long" has waited 5 s at t=5: it goes ahead of every later arrival, however small.
    assert q.pop_first(now=5.0) == "long"
    # A head that does not fit is skipped, not waited for.
    assert q.pop_first(lambda x: x != "short-later", now=5.0) == "mid"
    assert q.remove(0, "a", "short-later") and not q.remove(0, "a", "short-later")
    assert len(q) == 0 and q.pop_first(now=6.0) is None and q.depths() == {}


def test_headroom_counts_room_below_the_threshold_less_what_is_in_transit() -> None:
    assert headroom([0, 9000, 4000], 4096) == 4096 + 96
    assert headroom([0, 9000], 4096, in_transit_tokens=4096) == 0  # not > 0: wait
    assert headroom([5000], 4096) == 0
    assert headroom([], 4096) > 0  # no engine: routing answers the request


def test_admission_config_is_off_by_default_and_checked() -> None:
    assert parse_config({}).admission.queued_prefill_tokens_threshold is None
    cfg = parse_config(
        {"admission": {"max_queue": 5}},
        env={"KVROUTER_ADMISSION_QUEUED_PREFILL_TOKENS_THRESHOLD": "4096"},
    )
    assert cfg.admission.queued_prefill_tokens_threshold == 4096 and cfg.admission.max_queue == 5
    with pytest.raises(ConfigError, match=r"admission\.max_wait_s"):
        parse_config({"admission": {"max_wait_s": 0}})
    with pytest.raises(ConfigError, match=r"admission\.queued_prefill_tokens_threshold"):
        parse_config({"admission": {"queued_prefill_tokens_threshold": 0}})
    with pytest.raises(ConfigError, match=r"unknown key admission\.threshold"):
        parse_config({"admission": {"threshold": 1}})
    assert parse_config({}).admission.order == "fair"
    with pytest.raises(ConfigError, match=r"admission\.order: one of fair, shortest_prompt"):
        parse_config({"admission": {"order": "sjf"}})
    with pytest.raises(ConfigError, match=r"admission\.shortest_first_max_wait_s"):
        parse_config({"admission": {"shortest_first_max_wait_s": 0}})


async def test_headroom_admits_several_at_once_and_waits_for_their_routes() -> None:
    loads = {"m": [0, 9000]}  # engine 2 is over the threshold, engine 1 idle
    cfg = parse_config({"admission": {"queued_prefill_tokens_threshold": 4096}}).admission
    adm = Admission(cfg, lambda model: loads.get(model, []))
    client_gone = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await client_gone.wait()
        return {"type": "http.disconnect"}

    # 4,096 tokens of headroom hold four prompts of the assumed 1,024 tokens before any route
    # is chosen; the fifth waits until one of them has its route.
    passes = [await adm.admit("m", 0, None, receive) for _ in range(4)]
    assert adm.counts["direct"] == 4
    fifth = asyncio.create_task(adm.admit("m", 0, None, receive))
    await until(lambda: len(adm.queue) == 1, 5, "the fifth queued")
    loads["m"] = [4000, 9000]  # the four routed: the idle engine is nearly full now
    for p in passes:
        p.release(1000)
    p5 = await asyncio.wait_for(fifth, 5)  # 96 tokens of room left: one more goes
    assert adm.counts["queue"] == 1
    sixth = asyncio.create_task(adm.admit("m", 0, None, receive))
    await until(lambda: len(adm.queue) == 1, 5, "the sixth queued")
    p5.release(1000)
    loads["m"] = [5000, 9000]
    await asyncio.sleep(0.05)
    assert not sixth.done()
    loads["m"] = [5000, 100]  # the busy engine drained (seen by the periodic re-check)
    (await asyncio.wait_for(sixth, 5)).release()
    # A model nobody serves is not held: routing answers it.
    (await adm.admit("other", 0, None, receive)).release()
    # A client that leaves while waiting is out of the queue.
    loads["m"] = [5000, 9000]
    seventh = asyncio.create_task(adm.admit("m", 0, None, receive))
    await until(lambda: len(adm.queue) == 1, 5, "the seventh queued")
    client_gone.set()
    with pytest.raises(ClientDisconnect):
        await asyncio.wait_for(seventh, 5)
    assert len(adm.queue) == 0 and adm.counts["abandoned"] == 1


# ---------------------------------------------------------------- the simulator's scheduler


def _first_tokens(eng: SimEngine) -> list[str]:
    """Run the engine dry; the request ids in the order of their first token."""
    order: list[str] = []
    now = 0.0
    while eng.has_work():
        now = eng.schedule(now)
        out = eng.finish_step()
        order += [r for r in out.new_tokens if r not in order]
    return order


def test_simulator_priority_scheduling_orders_waiting_by_priority_then_arrival() -> None:
    def engine(policy: str) -> SimEngine:
        return SimEngine(EngineConfig(scheduling_policy=policy, max_num_seqs=1))

    eng = engine("priority")
    eng.add_request("late-low", list(range(100, 164)), 1, 0.0, priority=5)
    eng.add_request("b", list(range(200, 264)), 1, 2.0, priority=0)
    eng.add_request("a", list(range(300, 364)), 1, 1.0, priority=0)
    eng.add_request("urgent", list(range(400, 464)), 1, 3.0, priority=-2)
    assert _first_tokens(eng) == ["urgent", "a", "b", "late-low"]
    fcfs = engine("fcfs")
    fcfs.add_request("x", list(range(100, 164)), 1, 0.0)
    fcfs.add_request("y", list(range(200, 264)), 1, 1.0)
    assert _first_tokens(fcfs) == ["x", "y"]
    # vLLM's V1 engine takes a priority under fcfs and ignores it; its V0 engine refused it.
    fcfs.add_request("z", list(range(300, 364)), 1, 2.0, priority=5)
    fcfs.add_request("w", list(range(400, 464)), 1, 3.0, priority=-3)
    assert _first_tokens(fcfs) == ["z", "w"]
    v0 = SimEngine(EngineConfig(reject_priority=True))
    with pytest.raises(ValueError, match="Got priority 1 but Priority scheduling is not enabled"):
        v0.add_request("z", list(range(300, 364)), 1, 2.0, priority=1)


def test_simulator_priority_preempts_the_lowest_priority_running_request() -> None:
    # 9 usable blocks of 16 tokens: two 64-token prompts (4 blocks each) run, then decoding
    # needs a fifth block each and one of them must go.
    eng = SimEngine(
        EngineConfig(scheduling_policy="priority", num_gpu_blocks=10, decode_s_per_token=0.001)
    )
    eng.add_request("low", list(range(100, 164)), 40, 0.0, priority=3)
    eng.add_request("high", list(range(200, 264)), 40, 1.0, priority=0)
    now = eng.schedule(0.0)
    eng.finish_step()
    while eng.has_work() and all(r.request_id != "low" for r in eng.waiting):
        now = eng.schedule(now)
        eng.finish_step()
    # The later but more urgent request kept running; FCFS would have preempted it (last in).
    assert [r.request_id for r in eng.running] == ["high"]


# ---------------------------------------------------------------- end to end


def _body(n: int, seed: Any, **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "prompt": words(n, seed), "max_tokens": 1, **extra}


def _admission(router: Router) -> Any:
    assert router.admission is not None
    return router.admission


class _Client:
    """Requests through the router, recording the order in which their answers arrive."""

    def __init__(self, base: str, c: httpx.AsyncClient) -> None:
        self.base = base
        self.c = c
        self.finished: list[str] = []

    async def send(self, label: str, body: dict[str, Any], key: str | None = None) -> int:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        r = await self.c.post(self.base + "/v1/completions", json=body, headers=headers)
        self.finished.append(label)
        return r.status_code

    def start(self, label: str, body: dict[str, Any], key: str | None = None) -> asyncio.Task[int]:
        return asyncio.create_task(self.send(label, body, key))


def _fleet(**flags: Any) -> Any:
    return running_fleet(
        1, prefill_tps=PREFILL_TPS, decode_ms=1, scheduling_policy="priority", **flags
    )


async def test_high_priority_requests_are_admitted_before_earlier_low_priority_ones() -> None:
    with _fleet() as ws:
        cfg = config_for(ws, admission={"queued_prefill_tokens_threshold": 1})
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=60) as c:
            adm = _admission(router)
            cl = _Client(base, c)
            blocker = cl.start("blocker", _body(BLOCKER_TOKENS, "blocker"))
            await until(lambda: adm.counts["direct"] == 1, 10, "the blocker admitted")
            low = [cl.start(f"low{i}", _body(SMALL_TOKENS, f"l{i}", priority=10)) for i in range(4)]
            await until(lambda: len(adm.queue) == 4, 10, "the low-priority requests queued")
            high = [
                cl.start(f"high{i}", _body(SMALL_TOKENS, f"h{i}", priority=-5)) for i in range(4)
            ]
            await until(lambda: len(adm.queue) == 8, 10, "the high-priority requests queued")
            assert adm.queue.depths() == {-5: 4, 10: 4}
            text = (await c.get(base + "/metrics")).text
            assert 'kvrouter_admission_queue_depth_by_priority{priority="-5"} 4.0' in text
            assert "kvrouter_admission_queue_depth 8.0" in text
            assert not blocker.done()  # everything queued behind the blocker's prefill
            codes = await asyncio.gather(blocker, *low, *high)
            assert codes == [200] * 9
            order = cl.finished
            assert order[0] == "blocker"
            assert {x[:-1] for x in order[1:5]} == {"high"}, order
            assert {x[:-1] for x in order[5:]} == {"low"}, order
            doc = (await c.get(base + "/debug/index")).json()["admission"]
            assert doc["waiting"] == 0 and doc["counts"]["queue"] == 8 and doc["order"] == "fair"
            text = (await c.get(base + "/metrics")).text
            assert 'kvrouter_admission_admitted_total{via="queue"} 8.0' in text
            assert "kvrouter_admission_wait_seconds_count 8.0" in text


async def test_shortest_prompt_order_sends_the_short_requests_before_an_earlier_long_one() -> None:
    with _fleet() as ws:
        cfg = config_for(
            ws, admission={"queued_prefill_tokens_threshold": 1, "order": "shortest_prompt"}
        )
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=60) as c:
            adm = _admission(router)
            cl = _Client(base, c)
            blocker = cl.start("blocker", _body(BLOCKER_TOKENS, "blocker"))
            await until(lambda: adm.counts["direct"] == 1, 10, "the blocker admitted")
            long = cl.start("long", _body(1500, "long"))
            await until(lambda: len(adm.queue) == 1, 10, "the long request queued")
            short = [cl.start(f"short{i}", _body(SMALL_TOKENS, f"s{i}")) for i in range(3)]
            await until(lambda: len(adm.queue) == 4, 10, "the short requests queued")
            assert await asyncio.gather(blocker, long, *short) == [200] * 5
            # In arrival order the long request would finish second; its prefill alone holds
            # the engine for a second, which each short one would have waited.
            assert cl.finished[0] == "blocker" and cl.finished[-1] == "long", cl.finished


async def test_two_keys_at_one_priority_take_turns() -> None:
    with _fleet() as ws:
        cfg = config_for(
            ws,
            server={"api_keys": ["key-a", "key-b"]},
            admission={"queued_prefill_tokens_threshold": 1},
        )
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=60) as c:
            adm = _admission(router)
            cl = _Client(base, c)
            blocker = cl.start("blocker", _body(BLOCKER_TOKENS, "blocker"), "key-a")
            await until(lambda: adm.counts["direct"] == 1, 10, "the blocker admitted")
            burst = [cl.start(f"a{i}", _body(SMALL_TOKENS, f"a{i}"), "key-a") for i in range(6)]
            await until(lambda: len(adm.queue) == 6, 10, "key a's burst queued")
            later = [cl.start(f"b{i}", _body(SMALL_TOKENS, f"b{i}"), "key-b") for i in range(3)]
            await until(lambda: len(adm.queue) == 9, 10, "key b's requests queued")
            assert await asyncio.gather(blocker, *burst, *later) == [200] * 10
            order = cl.finished[1:]
            # Turns: a, b, a, b, a, b, a, a, a. In arrival order key b would come last.
            where_b = [i for i, x in enumerate(order) if x.startswith("b")]
            assert where_b == [1, 3, 5], order


async def test_a_full_queue_answers_429_with_retry_after_from_the_drain_rate() -> None:
    with _fleet() as ws:
        cfg = config_for(
            ws,
            admission={"queued_prefill_tokens_threshold": 1, "max_queue": 2, "retry_after_s": 7},
        )
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=60) as c:
            adm = _admission(router)
            cl = _Client(base, c)
            first = [cl.start("blocker", _body(BLOCKER_TOKENS, "blocker"))]
            await until(lambda: adm.counts["direct"] == 1, 10, "the blocker admitted")
            first += [cl.start(f"w{i}", _body(SMALL_TOKENS, f"w{i}")) for i in range(2)]
            await until(lambda: len(adm.queue) == 2, 10, "two requests queued")
            r = await c.post(base + "/v1/completions", json=_body(SMALL_TOKENS, "over"))
            assert r.status_code == 429
            err = r.json()["error"]
            assert err["type"] == "rate_limit_exceeded" and err["code"] == 429
            assert "admission queue is full" in err["message"]
            assert r.headers["retry-after"] == "7"  # nothing drained yet: the configured value
            assert await asyncio.gather(*first) == [200] * 3
            # The queue has been seen draining: Retry-After is computed from that rate, which
            # here admits a request every few hundred milliseconds.
            assert adm.drain_rate() is not None
            again = [cl.start("blocker2", _body(BLOCKER_TOKENS, "blocker2"))]
            await until(lambda: adm.counts["direct"] == 2, 10, "the second blocker admitted")
            again += [cl.start(f"v{i}", _body(SMALL_TOKENS, f"v{i}")) for i in range(2)]
            await until(lambda: len(adm.queue) == 2, 10, "two requests queued again")
            r = await c.post(base + "/v1/completions", json=_body(SMALL_TOKENS, "over2"))
            assert r.status_code == 429
            assert 1 <= int(r.headers["retry-after"]) <= 5
            assert await asyncio.gather(*again) == [200] * 3
            text = (await c.get(base + "/metrics")).text
            assert 'kvrouter_admission_rejected_total{reason="queue_full"} 2.0' in text


async def test_a_request_waiting_past_the_deadline_gets_429() -> None:
    with _fleet() as ws:
        cfg = config_for(ws, admission={"queued_prefill_tokens_threshold": 1, "max_wait_s": 0.4})
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=60) as c:
            adm = _admission(router)
            cl = _Client(base, c)
            blocker = cl.start("blocker", _body(BLOCKER_TOKENS, "blocker"))
            await until(lambda: adm.counts["direct"] == 1, 10, "the blocker admitted")
            t = time.monotonic()
            r = await c.post(base + "/v1/completions", json=_body(SMALL_TOKENS, "late"))
            waited = time.monotonic() - t
            assert r.status_code == 429 and 0.35 < waited < 1.4
            assert "max_wait_s" in r.json()["error"]["message"]
            assert int(r.headers["retry-after"]) >= 1
            assert len(adm.queue) == 0 and not blocker.done()
            assert await blocker == 200
            text = (await c.get(base + "/metrics")).text
            assert 'kvrouter_admission_rejected_total{reason="deadline"} 1.0' in text


async def test_a_client_that_disconnects_while_queued_gives_its_place_back() -> None:
    with _fleet() as ws:
        cfg = config_for(ws, admission={"queued_prefill_tokens_threshold": 1, "max_queue": 1})
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=60) as c:
            adm = _admission(router)
            cl = _Client(base, c)
            blocker = cl.start("blocker", _body(BLOCKER_TOKENS, "blocker"))
            await until(lambda: adm.counts["direct"] == 1, 10, "the blocker admitted")
            async with httpx.AsyncClient(timeout=60) as impatient:
                gone = asyncio.create_task(
                    impatient.post(base + "/v1/completions", json=_body(SMALL_TOKENS, "gone"))
                )
                await until(lambda: len(adm.queue) == 1, 10, "the impatient request queued")
                gone.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await gone
            await until(lambda: len(adm.queue) == 0, 5, "the queue to notice the disconnect")
            assert adm.counts["abandoned"] == 1
            # Its place is free: the next request waits instead of being refused.
            nxt = cl.start("next", _body(SMALL_TOKENS, "next"))
            await until(lambda: len(adm.queue) == 1, 10, "the next request queued")
            assert not blocker.done()
            assert await asyncio.gather(blocker, nxt) == [200, 200]
            assert adm.counts["queue_full"] == 0 and adm.counts["queue"] == 1


async def test_admission_off_queues_nothing_and_the_worker_orders_by_priority() -> None:
    # One sequence at a time on the worker, so its (priority, arrival) order shows in the answers.
    with _fleet(max_num_seqs=1) as ws:
        cfg = config_for(ws)
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=60) as c:
            assert router.admission is None
            cl = _Client(base, c)
            tasks = [cl.start("blocker", _body(BLOCKER_TOKENS, "blocker"))]

            async def at_the_worker(n: int) -> bool:
                eng = (await c.get(ws[0].url + "/sim/state")).json()["engines"][0]
                return eng["running"] + eng["waiting"] == n

            await until(lambda: at_the_worker(1), 10, "the blocker forwarded")
            tasks += [
                cl.start(f"low{i}", _body(SMALL_TOKENS, f"l{i}", priority=3)) for i in range(3)
            ]
            await until(lambda: at_the_worker(4), 10, "the low-priority requests forwarded")
            tasks += [
                cl.start(f"high{i}", _body(SMALL_TOKENS, f"h{i}", priority=-1)) for i in range(3)
            ]
            await until(lambda: at_the_worker(7), 10, "every request forwarded at once")
            assert not tasks[0].done()  # nothing waited in the router behind the blocker
            assert await asyncio.gather(*tasks) == [200] * 7
            # The bodies reached vLLM with their priority, and its priority scheduling ran the
            # later, more urgent requests first.
            order = cl.finished
            assert order[0] == "blocker"
            assert {x[:-1] for x in order[1:4]} == {"high"}, order
            assert (await c.get(base + "/debug/index")).json()["admission"] is None
            assert "kvrouter_admission" not in (await c.get(base + "/metrics")).text
