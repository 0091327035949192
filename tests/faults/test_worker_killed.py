"""A worker killed mid-stream (SIGKILL of its simulator process)."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from harness import FAST, SimProc, all_connected, engine_row
from test_router_support import config_for, serve_router, until, words

pytestmark = pytest.mark.timeout(150)

SLOW_DECODE = {**FAST, "decode_ms": 40}  # 60 tokens: ~2.4 s per stream


async def _route(c: httpx.AsyncClient, base: str, body: dict[str, Any]) -> dict[str, Any]:
    r = await c.post(base + "/debug/route", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _hit(e: dict[str, Any], url: str) -> int:
    return next(w["gpu_hit_tokens"] for w in e["workers"] if w["url"] == url)


async def _warm(c: httpx.AsyncClient, base: str, url: str, prompt: str, wait: bool = True) -> None:
    """Cache ``prompt`` on ``url`` directly and wait until the router's index shows it."""
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 1}
    assert (await c.post(url + "/v1/completions", json=body)).status_code == 200
    if not wait:
        return

    async def shown() -> bool:
        return _hit(await _route(c, base, body), url) >= 256

    await until(shown, 20, f"index to show the prompt on {url}")


async def test_worker_killed_mid_stream() -> None:
    a = SimProc(dict(SLOW_DECODE, num_gpu_blocks=512)).start()
    b = SimProc(dict(SLOW_DECODE, num_gpu_blocks=512)).start()
    try:
        cfg = config_for([a, b], policy={"speculative_ttl_s": 0.0})
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            await until(lambda: all_connected(router), 20, "event subscriptions")
            pa, pb = words(300, "kill-a"), words(300, "kill-b")
            await _warm(c, base, a.url, pa)
            await _warm(c, base, b.url, pb)
            req = {"model": "sim-model", "max_tokens": 60, "stream": True}
            sa = await c.send(
                c.build_request("POST", base + "/v1/completions", json={**req, "prompt": pa}),
                stream=True,
            )
            sb = await c.send(
                c.build_request("POST", base + "/v1/completions", json={**req, "prompt": pb}),
                stream=True,
            )
            assert sa.headers["x-kvrouter-worker"] == a.url
            assert sb.headers["x-kvrouter-worker"] == b.url
            ia, ib = sa.aiter_raw(), sb.aiter_raw()
            got_a = await ia.__anext__()
            got_b = await ib.__anext__()
            t_kill = time.monotonic()
            a.kill()
            # The stream on the killed worker ends with the router's error event, cleanly.
            clean = True
            try:
                async for chunk in ia:
                    got_a += chunk
            except httpx.RemoteProtocolError:
                clean = False  # died mid-event: connection closed without the last chunk
            t_err = time.monotonic() - t_kill
            assert clean, got_a[-300:]
            tail = got_a.rsplit(b"data: ", 2)
            assert b'"error"' in tail[-2] and b'"code":502' in tail[-2], got_a[-300:]
            assert got_a.endswith(b"data: [DONE]\n\n")
            wa = router.registry.workers[a.url]
            await until(lambda: not wa.healthy, 10, "killed worker to be unhealthy")
            t_unhealthy = time.monotonic() - t_kill
            # The other stream is unaffected: every token, then [DONE].
            async for chunk in ib:
                got_b += chunk
            assert got_b.endswith(b"data: [DONE]\n\n") and b'"error"' not in got_b
            assert got_b.count(b"data: ") == 60 + 1
            await sa.aclose()
            await sb.aclose()
            # Marked unhealthy, index state dropped, routing avoids it.
            wa = router.registry.workers[a.url]
            await until(lambda: not wa.healthy, 10, "killed worker to be unhealthy")
            await until(
                lambda: (
                    not next(
                        s for s in router.subscriber.status() if s.worker_id == a.url
                    ).connected
                ),
                10,
                "event socket of the dead worker to disconnect",
            )

            async def dropped() -> dict[str, Any] | None:
                row = engine_row((await c.get(base + "/debug/index")).json(), a.url)
                return row if row["resident_blocks"] == 0 and row["degraded"] else None

            await until(dropped, 10, "index state of the dead worker to be dropped")
            e = await _route(c, base, {"model": "sim-model", "prompt": pa})
            assert e["chosen"] == b.url and all(w["url"] != a.url for w in e["workers"])
            for i in range(4):
                body = {"model": "sim-model", "prompt": pa + f" again {i}", "max_tokens": 1}
                r = await c.post(base + "/v1/completions", json=body)
                assert r.status_code == 200 and r.headers["x-kvrouter-worker"] == b.url
            # It comes back (a new process on the same ports): taken back, restart detected.
            a.start()
            await until(lambda: wa.healthy, 15, "restarted worker to be healthy again")
            # (ZMQ drops what a PUB sends before the SUB has reconnected: events flow only
            # once the subscription is back, and then the seqs tell the restart.)
            sub_a = next(s for s in router.subscriber.status() if s.worker_id == a.url)
            await until(
                lambda: (
                    next(s for s in router.subscriber.status() if s.worker_id == a.url).connected
                ),
                20,
                "event socket to reconnect",
            )
            assert sub_a is not None
            sent = 0

            async def rebuilt() -> dict[str, Any] | None:
                nonlocal sent
                if sent < 40:  # keep events flowing: one short request per poll
                    sent += 1
                    await _warm(c, base, a.url, pa if sent == 1 else pa[:200], wait=False)
                row = engine_row((await c.get(base + "/debug/index")).json(), a.url)
                sub = row["subscriber"]
                return row if sub["restarts"] >= 1 and not row["degraded"] else None

            try:
                row = await until(rebuilt, 20, "restart to be detected from sequence numbers")
            except AssertionError:
                print(engine_row((await c.get(base + "/debug/index")).json(), a.url))
                raise
            pc = words(300, "kill-c")  # cached only on the restarted worker
            await _warm(c, base, a.url, pc)
            e = await _route(c, base, {"model": "sim-model", "prompt": pc})
            assert e["chosen"] == a.url and _hit(e, a.url) >= 256
            print(
                f"kill->error event {t_err:.3f}s, kill->unhealthy {t_unhealthy:.3f}s, "
                f"restarts={row['subscriber']['restarts']} resets={row['subscriber']['resets']}"
            )
    finally:
        a.stop()
        b.stop()
