"""Garbage on the router's event socket (bind topology: anyone who reaches it can send)."""

from __future__ import annotations

import asyncio
import multiprocessing
import time

import httpx
import pytest
from harness import FAST, flood, percentile
from test_router_support import config_for, serve_router, until, words
from vllm_publisher import Chains, VllmPublisher

from router.config import WorkerSpec
from simulator.testing import running_fleet

pytestmark = pytest.mark.timeout(120)

TOPIC = "w0"
FLOOD_S = 10.0
N_ROUTES = 300
# Stated bound on /debug/route latency during a ~40k msg/s flood. On a 2-core machine the
# flooding process, the router's ZMQ I/O thread and its event loop share the cores; measured
# p50 1-2 ms -> 15-21 ms, p99 6-10 ms -> 41-44 ms. The loop's share is bounded by the reader's
# per-turn budget (indexer.subscriber.RECV_BUDGET_S); the rest is CPU contention. The p99 is
# the fourth slowest of 300 sequential requests: a busy CI runner has stalled the whole
# process once or twice in a run (0.22 and 0.34 s, p50 unmoved), which is the machine's, not
# the reader's; a reader holding the loop would slow every request.
P50_BOUND_S = 0.060
P99_BOUND_S = 0.200


async def _route_latencies(c: httpx.AsyncClient, base: str, n: int) -> list[float]:
    out = []
    for i in range(n):
        body = {"model": "sim-model", "prompt": words(64, f"g{i % 10}")}
        t = time.perf_counter()
        r = await c.post(base + "/debug/route", json=body)
        out.append(time.perf_counter() - t)
        assert r.status_code == 200
    return out


async def test_garbage_frames_are_counted_and_leave_the_index_alone() -> None:
    with running_fleet(1, num_gpu_blocks=256, topic=TOPIC, **FAST) as ws:
        cfg = config_for(ws, events={"bind": "tcp://127.0.0.1:*"})
        # events= only to skip /kv_event_sources; with events.bind the worker connects to us.
        cfg.workers = [WorkerSpec(url=ws[0].url, events="tcp://127.0.0.1:1", topic=TOPIC)]
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            sub = router.subscriber
            engine = (ws[0].url, 0)
            await until(lambda: sub.bound_endpoint is not None and sub.status(), 20, "bound")
            pub = VllmPublisher(sub.bound_endpoint, None, topic=TOPIC)
            try:
                chains = Chains(7)
                # sync: publish until the first batch lands (PUB/SUB handshake)
                await until(
                    lambda: (
                        pub.publish(chains.request(4)) is not None
                        and router.index.resident_blocks(engine) > 0
                    ),
                    20,
                    "legit events to arrive",
                )
                for _ in range(20):
                    pub.publish(chains.request(4))
                await until(lambda: sub.status()[0].last_seq == pub.seq - 1, 20, "applied")
                st0 = sub.status()[0]  # (degraded "joined mid-stream": the first batch raced
                # the PUB/SUB handshake; that is before the flood and stays as it is)
                before = router.index.export_engine(engine)
                blocks = router.index.resident_blocks(engine)
                await _route_latencies(c, base, 20)  # warm the tokenizer cache
                base_lat = await _route_latencies(c, base, N_ROUTES)
                sent = multiprocessing.get_context("spawn").Value("q", 0)
                proc = multiprocessing.get_context("spawn").Process(
                    target=flood, args=(sub.bound_endpoint, TOPIC.encode(), FLOOD_S, 1, sent)
                )
                proc.start()
                try:
                    await until(
                        lambda: sub.unrouted_frames + sub.status()[0].garbage_frames > 1000,
                        20,
                        "the flood to reach the router",
                    )
                    flood_lat = await _route_latencies(c, base, N_ROUTES)
                    assert proc.is_alive(), "the flood ended before the last request"
                finally:
                    await asyncio.to_thread(proc.join, FLOOD_S + 20)
                st = sub.status()[0]
                counted = sub.unrouted_frames + st.garbage_frames
                assert (st.resets, st.decode_errors, st.gaps) == (st0.resets, 0, st0.gaps)
                assert st.degraded == st0.degraded
                assert router.index.export_engine(engine) == before
                assert router.index.resident_blocks(engine) == blocks
                # legit events still flow after the flood
                for _ in range(5):
                    pub.publish(chains.request(4))
                await until(lambda: sub.status()[0].last_seq == pub.seq - 1, 20, "applied after")
                assert router.index.resident_blocks(engine) == blocks + 5 * 4
                b50, b99 = percentile(base_lat, 50), percentile(base_lat, 99)
                f50, f99 = percentile(flood_lat, 50), percentile(flood_lat, 99)
                print(
                    f"garbage: sent={sent.value} counted={counted} "
                    f"(unrouted={sub.unrouted_frames} garbage={st.garbage_frames}); "
                    f"/debug/route p50 {b50 * 1e3:.2f}->{f50 * 1e3:.2f} ms, "
                    f"p99 {b99 * 1e3:.2f}->{f99 * 1e3:.2f} ms"
                )
                assert counted > 1000
                assert f50 <= P50_BOUND_S and f99 <= P99_BOUND_S
            finally:
                pub.close()
