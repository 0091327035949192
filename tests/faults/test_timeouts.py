"""A worker that answers slowly (``slowdown``) and one that never answers (``stall_http``)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from harness import FAST, all_connected
from test_router_support import config_for, serve_router, until, words

from simulator.testing import running_fleet

pytestmark = pytest.mark.timeout(120)


async def _timed(c: httpx.AsyncClient, url: str, body: dict) -> tuple[int, float, bytes, str]:
    t = time.monotonic()
    if body.get("stream"):
        async with c.stream("POST", url, json=body) as r:
            data = b"".join([x async for x in r.aiter_raw()])
            return r.status_code, time.monotonic() - t, data, r.headers.get("x-kvrouter-worker", "")
    r = await c.post(url, json=body)
    return r.status_code, time.monotonic() - t, r.content, r.headers.get("x-kvrouter-worker", "")


async def test_slow_worker_hits_the_total_timeout_others_unaffected() -> None:
    with running_fleet(2, num_gpu_blocks=256, **{**FAST, "decode_ms": 10}) as ws:
        slow, fast = ws[0].url, ws[1].url
        cfg = config_for(
            ws,
            policy={"name": "round_robin"},
            server={"request_timeout_s": 2.0, "first_byte_timeout_s": 30.0},
        )
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            await until(lambda: all_connected(router), 20, "event subscriptions")
            # slowdown 100: 1 s per decode step, so 8 tokens take ~8 s (> 2 s budget)
            await c.post(slow + "/sim/faults", json={"slowdown": 100})
            bodies = []
            for i in range(8):
                b = {"model": "sim-model", "prompt": words(30, f"slow{i}"), "max_tokens": 8}
                bodies.append({**b, "stream": i % 2 == 1})
            res = await asyncio.gather(*[_timed(c, base + "/v1/completions", b) for b in bodies])
            timed_out = [r for r in res if r[1] > 1.5]
            ok = [r for r in res if r[1] <= 1.5]
            assert len(timed_out) == 4 and len(ok) == 4, [(r[0], r[1], r[3]) for r in res]
            for status, dt, data, _ in timed_out:
                assert dt < 3.5
                if status == 200:  # a stream: headers came, then the router's timeout event
                    assert b'"type":"timeout"' in data and b'"code":504' in data
                    assert data.endswith(b"data: [DONE]\n\n")
                else:
                    assert status == 504
            for status, _, data, worker in ok:
                assert status == 200 and worker == fast and b'"error"' not in data
            w = router.registry.workers[slow]
            assert w.healthy  # slow is not dead
            await until(lambda: w.inflight == 0, 10, "load released")
            print("slow: " + ", ".join(f"{r[0]}@{r[1]:.2f}s" for r in res))


async def test_stalled_worker_times_out_is_not_rerun_and_is_avoided() -> None:
    with running_fleet(2, num_gpu_blocks=256, **FAST) as ws:
        stalled, live = ws[0].url, ws[1].url
        cfg = config_for(ws, policy={"name": "round_robin"}, server={"first_byte_timeout_s": 1.0})
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            await until(lambda: all_connected(router), 20, "event subscriptions")
            await c.post(stalled + "/sim/faults", json={"stall_http": True})
            lat = []
            timed_out = 0
            for i in range(10):
                body = {"model": "sim-model", "prompt": words(20, f"stall{i}"), "max_tokens": 1}
                status, dt, _, worker = await _timed(c, base + "/v1/completions", body)
                # The stalled worker read the request and may still run it: the client gets
                # 504 after one first-byte timeout, and no second worker runs it again.
                assert (status, worker) == (200, live) or status == 504, (status, worker)
                timed_out += status == 504
                lat.append(dt)
            assert max(lat) < 1.0 + 0.5
            assert 1 <= timed_out <= 2, "the timeout re-probes the worker, which is then avoided"
            w = router.registry.workers[stalled]
            await until(lambda: not w.healthy, 10, "stalled worker to fail its health probe")
            await until(
                lambda: router.subscriber.is_degraded((stalled, 0)), 10, "its index dropped"
            )
            t = time.monotonic()
            body = {"model": "sim-model", "prompt": words(20, "after"), "max_tokens": 1}
            r = await c.post(base + "/v1/completions", json=body)
            assert r.status_code == 200 and time.monotonic() - t < 0.8
            await c.post(stalled + "/sim/faults", json={"stall_http": False})
            await until(lambda: w.healthy, 10, "unstalled worker back")
            print("stall latencies: " + ", ".join(f"{x:.2f}" for x in lat))
