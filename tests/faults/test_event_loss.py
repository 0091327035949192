"""10% of KV-event messages dropped by the publisher (``drop_event_fraction``)."""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest
from harness import FAST, all_connected
from test_router_support import config_for, serve_router, until, words

from router.config import WorkerSpec
from simulator.testing import running_fleet

pytestmark = pytest.mark.timeout(150)

N_REQUESTS = 80


def _prompts(seed: int, n: int) -> list[str]:
    """Shared prefixes with varied tails: hits, partial hits and (at 128 blocks) evictions."""
    rng = random.Random(seed)
    prefixes = [words(rng.choice((64, 128, 192)), f"pfx{seed}-{i}") for i in range(8)]
    return [
        f"{rng.choice(prefixes)} {words(rng.randrange(16, 160), f'tail{seed}-{j}')}"
        for j in range(n)
    ]


async def _send(c: httpx.AsyncClient, url: str, prompt: str) -> int:
    r = await c.post(
        url + "/v1/completions", json={"model": "sim-model", "prompt": prompt, "max_tokens": 1}
    )
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


async def _caught_up(c: httpx.AsyncClient, router: Any, url: str) -> bool:
    """The router applied every batch the worker published, and no replay is in flight."""
    st = (await c.get(url + "/sim/state")).json()["engines"][0]
    row = next(s for s in router.subscriber.status() if s.worker_id == url)
    return row.last_seq == st["next_seq"] - 1 and not row.replaying and row.queue_depth == 0


async def _predicted(c: httpx.AsyncClient, base: str, prompt: str, url: str) -> int:
    r = await c.post(base + "/debug/route", json={"model": "sim-model", "prompt": prompt})
    return next(w["gpu_hit_tokens"] for w in r.json()["workers"] if w["url"] == url)


async def test_replay_repairs_the_index_under_10pct_event_loss() -> None:
    with running_fleet(2, num_gpu_blocks=128, **FAST) as ws:
        lossy, clean = ws[0].url, ws[1].url
        cfg = config_for(ws, policy={"speculative_ttl_s": 0.0})
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            await until(lambda: all_connected(router), 20, "event subscriptions")
            r = await c.post(lossy + "/sim/faults", json={"drop_event_fraction": 0.1})
            assert r.status_code == 200
            prompts = _prompts(1, N_REQUESTS)
            for p in prompts:  # the same sequence on both: the clean one is the reference
                await _send(c, lossy, p)
                await _send(c, clean, p)
            # A loss in the very last batches is invisible until something follows them.
            await c.post(lossy + "/sim/faults", json={"drop_event_fraction": 0.0})
            flush = words(40, "flush")
            await _send(c, lossy, flush)
            await _send(c, clean, flush)
            for url in (lossy, clean):
                await until(lambda u=url: _caught_up(c, router, u), 30, f"{url} caught up")
            st = {s.worker_id: s for s in router.subscriber.status()}
            assert st[lossy].gaps > 0 and st[lossy].replays_ok > 0, st[lossy]
            assert st[lossy].resets == 0 and not st[lossy].degraded, st[lossy]
            assert st[clean].gaps == 0
            dropped = (await c.get(lossy + "/sim/state")).json()
            # 1. The index equals each worker's own block pool.
            for url in (lossy, clean):
                pool = (await c.get(url + "/sim/state")).json()["engines"][0]["cached_blocks"]
                assert router.index.resident_blocks((url, 0)) == pool, url
            # 2. Predictions for every prompt are the same on the lossy and the loss-free worker.
            preds = []
            for p in [*prompts, flush]:
                a = await _predicted(c, base, p, lossy)
                b = await _predicted(c, base, p, clean)
                assert a == b, p[:40]
                preds.append(a)
            assert sum(x > 0 for x in preds) > N_REQUESTS // 4
            # 3. Predictions equal what the worker then reports as cached.
            for p in prompts[-8:]:
                want = await _predicted(c, base, p, lossy)
                assert await _send(c, lossy, p) == want
                await until(lambda: _caught_up(c, router, lossy), 30, "caught up")
            print(
                f"lossy: gaps={st[lossy].gaps} replays_ok={st[lossy].replays_ok} "
                f"batches={st[lossy].batches} resident={router.index.resident_blocks((lossy, 0))}"
                f" faults={dropped['faults']}"
            )


async def test_without_replay_loss_degrades_and_routes_by_load() -> None:
    with running_fleet(2, num_gpu_blocks=128, **FAST) as ws:
        lossy, other = ws[0], ws[1]
        cfg = config_for(ws, policy={"speculative_ttl_s": 0.0})
        cfg.workers = [
            WorkerSpec(url=lossy.url, events=lossy.events_endpoint, replay=None),
            WorkerSpec(url=other.url),
        ]
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            await until(lambda: all_connected(router), 20, "event subscriptions")
            await c.post(lossy.url + "/sim/faults", json={"drop_event_fraction": 0.1})
            prompts = _prompts(2, 60)
            sent = 0

            async def degraded() -> bool:
                nonlocal sent
                if sent < len(prompts):
                    await _send(c, lossy.url, prompts[sent])
                    sent += 1
                return router.subscriber.is_degraded((lossy.url, 0))

            await until(degraded, 60, "a loss without replay to degrade the worker")
            # Degraded: never routed to a phantom cache; its hits count as zero (load only).
            for p in prompts[:sent]:
                r = await c.post(base + "/debug/route", json={"model": "sim-model", "prompt": p})
                row = next(w for w in r.json()["workers"] if w["url"] == lossy.url)
                assert row["gpu_hit_tokens"] == 0
            d = (await c.get(base + "/debug/index")).json()
            w = next(x for x in d["workers"] if x["url"] == lossy.url)
            assert w["degraded"] and w["engines"][0]["subscriber"]["resets"] >= 1
            # Rebuilt: losses stop, the cache is reset (AllBlocksCleared): exact again.
            await c.post(lossy.url + "/sim/faults", json={"drop_event_fraction": 0.0})
            assert (await c.post(lossy.url + "/reset_prefix_cache")).status_code == 200
            probe = words(200, "rebuilt")
            await _send(c, lossy.url, probe)
            await until(lambda: not router.subscriber.is_degraded((lossy.url, 0)), 20, "rebuilt")
            await until(lambda: _caught_up(c, router, lossy.url), 20, "caught up")
            want = await _predicted(c, base, probe, lossy.url)
            assert want >= 176 and await _send(c, lossy.url, probe) == want
            print(
                f"degraded after {sent} requests; resets={w['engines'][0]['subscriber']['resets']}"
            )
