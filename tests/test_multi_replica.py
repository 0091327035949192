"""Several ``kvrouter serve`` processes sharing state in a real redis-server, in front of a
simulated fleet: balanced in-flight load across replicas, no phantom load from a killed
replica, warm start from index snapshots, and survival of a Redis outage."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import yaml
from redis_server import RedisServer, redis_server
from test_router_support import until, words

from simulator.testing import WorkerInfo, find_port_block, running_fleet

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

# Slow prefill so requests overlap: ~800 tokens take ~0.8 s before the first token.
SLOW = {"prefill_tps": 1000, "decode_ms": 5, "step_overhead_ms": 0.5, "num_gpu_blocks": 1024}


@pytest.fixture(scope="module")
def fleet() -> Iterator[list[WorkerInfo]]:
    with running_fleet(4, **SLOW) as workers:
        yield workers


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    with redis_server() as srv:
        yield srv


class RouterProc:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, log_path: str) -> None:
        self.proc = proc
        self.url = url
        self.log_path = log_path

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        """The router's log without its per-request access lines, the last 3,000 characters."""
        with open(self.log_path, errors="replace") as f:
            return "".join(line for line in f if "kvrouter.access" not in line)[-3000:]


@asynccontextmanager
async def router(
    fleet: list[WorkerInfo], redis: dict[str, Any] | None = None, **policy: Any
) -> AsyncIterator[RouterProc]:
    """``kvrouter serve`` in its own process, ready (a live event subscription) on return."""
    cfg: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "log_level": "info"},
        "workers": [
            {"url": w.url, "events": w.events_endpoint, "replay": w.replay_endpoint} for w in fleet
        ],
        "policy": {"name": "kvrouter", **policy},
    }
    if redis is not None:
        cfg["redis"] = redis
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(cfg, f)
        path = f.name
    log_path = path + ".log"
    port = find_port_block(1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTER_")}
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "serve", "--config", path, "--port", str(port)],
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    r = RouterProc(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        async with httpx.AsyncClient(timeout=2) as c:

            async def ready() -> bool:
                if proc.poll() is not None:
                    raise AssertionError(f"router exited: {r.log()}")
                with contextlib.suppress(httpx.HTTPError):
                    return (await c.get(r.url + "/ready")).status_code == 200
                return False

            await until(ready, 30, "router ready")
        yield r
    finally:
        r.stop()
        for p in (path, log_path):
            with contextlib.suppress(OSError):
                os.unlink(p)


async def debug(c: httpx.AsyncClient, r: RouterProc) -> dict[str, Any]:
    resp = await c.get(r.url + "/debug/index")
    assert resp.status_code == 200, resp.text
    return resp.json()


def local_inflight(d: dict[str, Any]) -> int:
    return sum(e["load"]["inflight_requests"] for w in d["workers"] for e in w["engines"])


def remote_inflight(d: dict[str, Any]) -> int:
    return sum(d["shared_state"].get("remote_inflight", {}).values())


async def redis_up(c: httpx.AsyncClient, r: RouterProc) -> float | None:
    text = (await c.get(r.url + "/metrics")).text
    for line in text.splitlines():
        if line.startswith("kvrouter_redis_up "):
            return float(line.split()[1])
    return None


def completion(prompt: str, max_tokens: int = 4) -> dict[str, Any]:
    return {"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens}


async def imbalance(
    c: httpx.AsyncClient, a: RouterProc, b: RouterProc, shared: bool, rounds: int, tag: str
) -> int:
    """Per round: 2 cold requests through A, then (once they are in flight, and with Redis
    once B's view has them) 2 through B, all overlapping on 4 workers. One router deciding
    would use 4 distinct workers; returns the sum over rounds of (max per worker - 1)."""
    total = 0
    for i in range(rounds):
        prompts = [words(800, f"{tag}-{i}-{j}") for j in range(4)]
        ta = [asyncio.create_task(c.post(a.url + "/v1/completions", json=completion(p)))
              for p in prompts[:2]]  # fmt: skip
        await until(lambda: _gte(c, a, local_inflight, 2), 20, "A's requests in flight")
        if shared:
            await until(lambda: _gte(c, b, remote_inflight, 2), 20, "B to see A's load")
        tb = [asyncio.create_task(c.post(b.url + "/v1/completions", json=completion(p)))
              for p in prompts[2:]]  # fmt: skip
        results = await asyncio.gather(*ta, *tb)
        assert all(r.status_code == 200 for r in results), [r.text for r in results]
        per = Counter(r.headers["x-kvrouter-worker"] for r in results)
        total += max(per.values()) - 1
        await until(lambda: _idle(c, a, b), 20, "routers idle between rounds")
    return total


async def _gte(c: httpx.AsyncClient, r: RouterProc, f: Any, n: int) -> bool:
    return f(await debug(c, r)) >= n


async def _idle(c: httpx.AsyncClient, a: RouterProc, b: RouterProc) -> bool:
    da, db = await debug(c, a), await debug(c, b)
    return local_inflight(da) == 0 and local_inflight(db) == 0 and remote_inflight(db) == 0


async def test_two_replicas_balance_in_flight_load_only_with_redis(
    fleet: list[WorkerInfo], redis: RedisServer
) -> None:
    rounds = 7
    async with httpx.AsyncClient(timeout=60) as c:
        async with router(fleet) as a, router(fleet) as b:
            without = await imbalance(c, a, b, False, rounds, "solo")
        rc = {"url": redis.url, "key_prefix": "{kvt-balance}"}
        async with router(fleet, rc) as a, router(fleet, rc) as b:
            await until(lambda: _up(c, a, b), 20, "both replicas on Redis")
            with_redis = await imbalance(c, a, b, True, rounds, "shared")
    # Without shared load B picks among "idle" workers at random: 5 in 6 rounds collide.
    assert with_redis == 0, (with_redis, without)
    assert without >= 2, (with_redis, without)


async def _up(c: httpx.AsyncClient, *rs: RouterProc) -> bool:
    return all([await redis_up(c, r) == 1.0 for r in rs])


async def test_killed_replica_leaves_no_phantom_load(
    fleet: list[WorkerInfo], redis: RedisServer
) -> None:
    ttl = 1.0
    rc = {"url": redis.url, "key_prefix": "{kvt-kill}", "heartbeat_ttl_s": ttl}
    async with httpx.AsyncClient(timeout=60) as c, router(fleet, rc) as b:
        async with router(fleet, rc) as a:
            await until(lambda: _up(c, a, b), 20, "both replicas on Redis")
            body = completion(words(3000, "phantom"), max_tokens=200)  # ~3 s prefill
            tasks = [asyncio.create_task(c.post(a.url + "/v1/completions", json=body))
                     for _ in range(3)]  # fmt: skip
            await until(lambda: _gte(c, b, remote_inflight, 3), 20, "B to see A's load")
            a.kill()  # SIGKILL: no goodbye, its Redis hash lingers until the TTL
            killed = time.monotonic()
            await asyncio.gather(*tasks, return_exceptions=True)
        await until(lambda: _eq0(c, b), ttl + 4.0, "A's contribution to expire (TTL + refresh)")
        assert time.monotonic() - killed <= ttl + 4.0
        e = (await c.post(b.url + "/debug/route", json=completion("hello there"))).json()
        assert all(w["load"]["inflight_requests"] == 0 for w in e["workers"])
        assert all(w["load"]["queued_prefill_tokens"] == 0 for w in e["workers"])


async def _eq0(c: httpx.AsyncClient, b: RouterProc) -> bool:
    return remote_inflight(await debug(c, b)) == 0


async def test_late_replica_starts_warm_from_snapshots(
    fleet: list[WorkerInfo], redis: RedisServer
) -> None:
    rc = {"url": redis.url, "key_prefix": "{kvt-warm}", "snapshot_interval_s": 0.3}
    prompt = words(200, "warm-start-prompt")
    async with httpx.AsyncClient(timeout=60) as c, router(fleet, rc) as a:
        r = await c.post(a.url + "/v1/completions", json=completion(prompt, 2))
        assert r.status_code == 200
        target = r.headers["x-kvrouter-worker"]

        async def indexed() -> bool:
            e = (await c.post(a.url + "/debug/route", json=completion(prompt))).json()
            return any(w["url"] == target and w["gpu_hit_tokens"] >= 176 for w in e["workers"])

        await until(indexed, 20, "A's index to hold the prompt")
        seen_at = time.time()

        async def snapshotted() -> bool:
            st = (await debug(c, a))["shared_state"]
            return (st.get("last_snapshot_at") or 0) > seen_at + 0.05

        await until(snapshotted, 20, "a snapshot written after that")
        async with router(fleet, rc) as b:
            e = (await c.post(b.url + "/debug/route", json=completion(prompt))).json()
            hit = {w["url"]: w["gpu_hit_tokens"] for w in e["workers"]}
            assert hit[target] >= 176, hit
            assert e["chosen"] == target
            warm = (await debug(c, b))["shared_state"]["warm_start"]
            assert warm["warm"] and warm["engines_loaded"] >= 1 and warm["blocks"] >= 11, warm
            assert warm["max_snapshot_age_s"] is not None and warm["max_snapshot_age_s"] < 30
            # Events continue from the snapshot's seq: a new prompt through B is indexed
            # exactly, without a reset of the warm engine.
            p2 = prompt + " " + words(100, "second")
            r = await c.post(b.url + "/v1/completions", json=completion(p2, 2))
            assert r.status_code == 200 and r.headers["x-kvrouter-worker"] == target

            async def indexed2() -> bool:
                e = (await c.post(b.url + "/debug/route", json=completion(p2))).json()
                return any(w["url"] == target and w["gpu_hit_tokens"] >= 288 for w in e["workers"])

            await until(indexed2, 20, "B to index the follow-up from live events")
            d = await debug(c, b)
            eng = next(w for w in d["workers"] if w["url"] == target)["engines"][0]
            assert not eng["degraded"] and eng["subscriber"]["resets"] == 0, eng


async def test_redis_outage_requests_succeed_and_gauge_follows(
    fleet: list[WorkerInfo], redis: RedisServer
) -> None:
    rc = {"url": redis.url, "key_prefix": "{kvt-outage}"}
    async with httpx.AsyncClient(timeout=60) as c, router(fleet, rc) as a, router(fleet, rc) as b:
        await until(lambda: _up(c, a, b), 20, "both replicas on Redis")
        stop = asyncio.Event()
        statuses: list[int] = []

        async def load(r: RouterProc, tag: str) -> None:
            i = 0
            while not stop.is_set():
                i += 1
                body = completion(words(60, f"{tag}-{i}"), 2)
                statuses.append((await c.post(r.url + "/v1/completions", json=body)).status_code)

        tasks = [asyncio.create_task(load(r, f"{n}-{k}")) for n, r in (("a", a), ("b", b))
                 for k in range(2)]  # fmt: skip
        try:
            await until(lambda: len(statuses) >= 8, 20, "load running")
            redis.kill()
            await until(lambda: _down(c, a, b), 10, "kvrouter_redis_up to drop to 0")
            n = len(statuses)
            await until(lambda: len(statuses) >= n + 8, 20, "requests while Redis is down")
            redis.restart()
            await until(lambda: _up(c, a, b), 20, "kvrouter_redis_up back to 1")
            n = len(statuses)
            await until(lambda: len(statuses) >= n + 8, 20, "requests after Redis is back")
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        assert statuses and all(s == 200 for s in statuses), Counter(statuses)
        for r in (a, b):
            text = r.log()
            assert text.count("Redis shared state lost") == 1, text
            assert text.count("Redis shared state reachable") == 2, text


async def _down(c: httpx.AsyncClient, *rs: RouterProc) -> bool:
    return all([await redis_up(c, r) == 0.0 for r in rs])
