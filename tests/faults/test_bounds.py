"""Every configured bound, pushed past. The router runs under uvicorn with the same
options as ``kvrouter serve`` (``router.limits.uvicorn_options``)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
import uvicorn
from harness import FAST, all_connected
from test_router_support import config_for, until, words

from router.app import create_apps
from router.config import Config
from router.core import Router
from router.limits import uvicorn_options
from simulator.testing import running_fleet

pytestmark = pytest.mark.timeout(120)


@asynccontextmanager
async def serve_cli_like(cfg: Config) -> AsyncIterator[tuple[str, Router]]:
    app, _admin, router = create_apps(cfg, seed=0)
    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=0, log_level="warning", lifespan="on",
            access_log=False, **uvicorn_options(cfg.server.max_header_bytes),
        )
    )  # fmt: skip
    task = asyncio.create_task(server.serve())
    try:
        await until(lambda: server.started or task.done(), 20, "server start")
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}", router
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 15)


async def test_body_and_header_size() -> None:
    with running_fleet(1, num_gpu_blocks=128, **FAST) as ws:
        cfg = config_for(ws, server={"max_body_bytes": 4096, "max_header_bytes": 8192})
        async with serve_cli_like(cfg) as (base, _r), httpx.AsyncClient(timeout=30) as c:
            url = base + "/v1/completions"
            r = await c.post(url, json={"model": "sim-model", "prompt": "x" * 5000})
            assert r.status_code == 413
            r = await c.post(url, json={"model": "sim-model", "prompt": "ok", "max_tokens": 1})
            assert r.status_code == 200
            r = await c.post(url, json={"prompt": "x"}, headers={"x-big": "a" * 9000})
            assert r.status_code == 431 and r.json()["error"]["code"] == 431
            # many small headers add up the same way
            many = {f"x-h{i}": "b" * 100 for i in range(100)}
            r = await c.post(url, json={"prompt": "x"}, headers=many)
            assert r.status_code == 431
            # a 4 MB header block is cut off after the bound, not buffered
            reader, writer = await asyncio.open_connection(*base[7:].split(":"))
            writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\nx-a: " + b"a" * 64_000)
            await writer.drain()
            head = await asyncio.wait_for(reader.read(64), 10)
            assert head.startswith(b"HTTP/1.1 431")
            writer.close()
            r = await c.get(base + "/health")
            assert r.status_code == 200


async def test_connections_per_worker_wait_then_503() -> None:
    with running_fleet(1, num_gpu_blocks=256, **{**FAST, "decode_ms": 50}) as ws:
        cfg = config_for(ws, server={"max_connections_per_worker": 2, "pool_timeout_s": 0.5})
        async with serve_cli_like(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            await until(lambda: all_connected(router), 20, "event subscriptions")
            body = {"model": "sim-model", "max_tokens": 60, "stream": True}  # ~3 s each
            held = []
            for i in range(2):
                b = {**body, "prompt": words(20, f"hold{i}")}
                r = await c.send(
                    c.build_request("POST", base + "/v1/completions", json=b), stream=True
                )
                assert r.status_code == 200
                held.append(r)
            t = time.monotonic()
            r = await c.post(
                base + "/v1/completions",
                json={"model": "sim-model", "prompt": "third", "max_tokens": 1},
            )
            waited = time.monotonic() - t
            assert r.status_code == 503, r.text
            assert 0.4 <= waited < 3.0
            assert router.registry.workers[ws[0].url].healthy  # busy is not broken
            for h in held:
                await h.aclose()
            r = await c.post(
                base + "/v1/completions",
                json={"model": "sim-model", "prompt": "fourth", "max_tokens": 1},
            )
            assert r.status_code == 200
            print(f"3rd request over max_connections_per_worker=2: 503 after {waited:.2f}s")


async def test_tokenizer_cache_bounds() -> None:
    with running_fleet(1, num_gpu_blocks=128, **FAST) as ws:
        cfg = config_for(ws, tokenizer={"cache_entries": 40, "cache_tokens": 4000})
        async with serve_cli_like(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            peak_entries = peak_tokens = 0
            for i in range(120):
                n = 30 if i < 60 else 200
                body = {"model": "sim-model", "prompt": words(n, f"tok{i}")}
                assert (await c.post(base + "/debug/route", json=body)).status_code == 200
                peak_entries = max(peak_entries, len(router.tokenizer))
                peak_tokens = max(peak_tokens, router.tokenizer._cached_tokens)
            assert peak_entries <= 40 and peak_tokens <= 4000
            print(f"tokenizer cache peak: {peak_entries} entries, {peak_tokens} tokens")


async def test_index_cap_resets_and_degrades() -> None:
    with running_fleet(1, num_gpu_blocks=1024, **FAST) as ws:
        cfg = config_for(ws, index={"max_blocks": 100})
        async with serve_cli_like(cfg) as (_base, router), httpx.AsyncClient(timeout=30) as c:
            await until(lambda: all_connected(router), 20, "event subscriptions")
            engine = (ws[0].url, 0)
            peak = 0
            stop = asyncio.Event()

            async def sample() -> None:
                nonlocal peak
                while not stop.is_set():
                    peak = max(peak, router.index.total_entries)
                    await asyncio.sleep(0)

            sampler = asyncio.create_task(sample())
            for i in range(12):  # 12 x 20 blocks = 240 > 100
                body = {"model": "sim-model", "prompt": words(320, f"cap{i}"), "max_tokens": 1}
                assert (await c.post(ws[0].url + "/v1/completions", json=body)).status_code == 200
            await until(
                lambda: router.subscriber.status()[0].resets >= 1, 20, "the cap to reset the engine"
            )
            stop.set()
            await sampler
            st = router.subscriber.status()[0]
            assert peak <= 100 and router.index.total_entries <= 100
            assert st.degraded and st.degraded_reason == "index cap"
            assert router.subscriber.is_degraded(engine)
            print(f"index cap 100: peak {peak} entries, resets={st.resets}")


async def test_event_queue_overflow_is_a_counted_gap_repaired_by_replay() -> None:
    with running_fleet(1, num_gpu_blocks=512, **FAST) as ws:
        url = ws[0].url
        cfg = config_for(ws, events={"queue_depth": 4})
        async with serve_cli_like(cfg) as (_base, router), httpx.AsyncClient(timeout=30) as c:
            await until(lambda: all_connected(router), 20, "event subscriptions")
            published = threading.Event()

            def burst() -> None:  # 30 batches while the router's loop is blocked
                with httpx.Client(timeout=30) as sc:
                    for i in range(30):
                        b = {"model": "sim-model", "prompt": words(40, f"q{i}"), "max_tokens": 1}
                        sc.post(url + "/v1/completions", json=b)
                published.set()

            th = threading.Thread(target=burst)
            th.start()
            published.wait(60)
            time.sleep(0.3)  # (deliberately blocks the router's loop: the events pile up)
            th.join()

            async def caught_up() -> bool:
                st = (await c.get(url + "/sim/state")).json()["engines"][0]
                row = router.subscriber.status()[0]
                return row.last_seq == st["next_seq"] - 1 and not row.replaying

            await until(caught_up, 30, "replay to repair the overflow")
            row = router.subscriber.status()[0]
            assert row.queue_overflows > 0 and row.gaps >= 1 and row.replays_ok >= 1
            assert not row.degraded
            pool = (await c.get(url + "/sim/state")).json()["engines"][0]["cached_blocks"]
            assert router.index.resident_blocks((url, 0)) == pool
            print(f"queue_depth 4: overflows={row.queue_overflows} gaps={row.gaps}")
