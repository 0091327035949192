"""A client that leaves mid-stream: the worker aborts the request, the router frees its load."""

from __future__ import annotations

import httpx
import pytest
from harness import FAST, all_connected, engine_row
from test_router_support import config_for, serve_router, until, words

from simulator.testing import running_fleet

pytestmark = pytest.mark.timeout(60)


async def test_client_disconnect_aborts_upstream_and_releases_load() -> None:
    with running_fleet(1, num_gpu_blocks=256, **{**FAST, "decode_ms": 20}) as ws:
        url = ws[0].url
        async with (
            serve_router(config_for(ws)) as (base, router),
            httpx.AsyncClient(timeout=30) as c,
        ):
            await until(lambda: all_connected(router), 20, "event subscriptions")
            body = {"model": "sim-model", "prompt": words(100, "leave"), "max_tokens": 2000}
            async with c.stream(
                "POST", base + "/v1/completions", json={**body, "stream": True}
            ) as r:
                it = r.aiter_raw()
                await it.__anext__()
                await it.__anext__()

                async def running() -> bool:
                    return (await c.get(url + "/sim/state")).json()["engines"][0]["running"] == 1

                assert await running()
                row = engine_row((await c.get(base + "/debug/index")).json(), url)
                assert row["load"]["inflight_requests"] == 1
            # left after 2 of 2000 tokens (40 s of decoding)

            async def aborted() -> bool:
                e = (await c.get(url + "/sim/state")).json()["engines"][0]
                return e["running"] == 0 and e["waiting"] == 0

            await until(aborted, 20, "the worker to abort the request")
            row = engine_row((await c.get(base + "/debug/index")).json(), url)
            assert row["load"]["inflight_requests"] == 0
            assert row["load"]["queued_prefill_tokens"] == 0
            m = (await c.get(base + "/metrics")).text
            assert 'code="499"' in m or "499" in m
