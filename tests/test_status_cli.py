"""``kvrouter status``: a running router's fleet as a table, read over HTTP like an operator."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
from test_router_support import config_for, serve_router, until, words

from router.status import format_status, rows
from simulator.testing import running_fleet


async def _status(*args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "kvrouter.cli", "status", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_status_shows_every_engine_and_exits_by_fleet_health() -> None:
    with running_fleet(2, dp_size=2, decode_ms=1, prefill_tps=400000) as ws:
        cfg = config_for(ws, server={"api_keys": ["k1"]})
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            auth = {"authorization": "Bearer k1"}
            await until(
                lambda: all(w.subscribed for w in router.registry.workers.values()), 20, "subs"
            )
            body = {"model": "sim-model", "prompt": words(200, "st"), "max_tokens": 1}
            assert (await c.post(base + "/v1/completions", json=body, headers=auth)).is_success

            def live() -> bool:
                doc = httpx.get(base + "/debug/index", headers=auth).json()
                return all(r["events"] == "live" for r in rows(doc))

            await until(lambda: asyncio.to_thread(live), 20, "every engine live")
            doc = (await c.get(base + "/debug/index", headers=auth)).json()
            table = rows(doc)
            assert [(r["worker"], r["dp"]) for r in table] == [
                (w.url, str(rank)) for w in ws for rank in range(2)
            ]
            assert sum(int(r["GPU blocks"]) for r in table) > 0
            text = format_status(doc)
            assert text.splitlines()[0].split()[:3] == ["worker", "dp", "health"]
            assert "2/2 workers healthy" in text

            denied = await _status(base)
            assert denied.returncode == 2 and "--token" in denied.stderr
            ok = await _status(base, "--token", "k1")
            assert ok.returncode == 0, ok.stdout + ok.stderr
            assert all(w.url in ok.stdout for w in ws)

            # A worker that stops answering: the table says so and the exit code is 1.
            await c.post(ws[0].url + "/sim/faults", json={"stall_http": True})
            await until(lambda: not router.registry.workers[ws[0].url].healthy, 20, "down")
            bad = await _status(base, "--token", "k1")
            assert bad.returncode == 1 and "DOWN" in bad.stdout
            await c.post(ws[0].url + "/sim/faults", json={"stall_http": False})

    gone = await _status("http://127.0.0.1:9")
    assert gone.returncode == 2 and "cannot reach" in gone.stderr
