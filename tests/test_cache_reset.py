"""``POST /reset_prefix_cache`` on the gateway (router/cache_reset.py) against simulated vLLM
workers: every worker reset, the index forgetting each confirmed one at once (vLLM itself
announces a reset only with the engine's next step), a refused reset reported and forgotten
nowhere, and a model no worker serves answered 404."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from test_router_support import config_for, serve_router, until, words

from simulator.testing import running_fleet

pytestmark = pytest.mark.timeout(120)

FAST = {"decode_ms": 1, "prefill_tps": 400000, "step_overhead_ms": 0.1}


async def _hits(c: httpx.AsyncClient, base: str, body: dict[str, Any]) -> dict[str, int]:
    e = (await c.post(base + "/debug/route", json=body)).json()
    return {w["url"]: w["gpu_hit_tokens"] + w["speculative_hit_tokens"] for w in e["workers"]}


async def test_the_gateway_resets_every_worker_and_forgets_what_they_held() -> None:
    with running_fleet(2, **FAST) as ws:
        async with (
            serve_router(config_for(ws)) as (base, router),
            httpx.AsyncClient(timeout=30) as c,
        ):
            await until(lambda: all(w.subscribed for w in router.registry.workers.values()), 20)
            body = {"model": "sim-model", "prompt": words(300, "held"), "max_tokens": 1}
            r = await c.post(base + "/v1/completions", json=body)
            url = r.headers["x-kvrouter-worker"]

            async def shown() -> bool:
                return router.index.resident_blocks((url, 0)) > 0

            await until(shown, 10, "the prompt's events")
            assert (await _hits(c, base, body))[url] >= 256
            r = await c.post(base + "/reset_prefix_cache", params={"reset_external": "true"})
            assert r.status_code == 200, r.text
            assert r.json() == {
                "success": True,
                "workers": {w.url: {"success": True} for w in ws},
            }
            # Forgotten at once: no engine step has announced the reset yet.
            assert all(n == 0 for n in (await _hits(c, base, body)).values())
            r = await c.post(base + "/v1/completions", json=body)
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            refused = await c.post(base + "/reset_prefix_cache", params={"model": "nope"})
            assert refused.status_code == 404 and "nope" in refused.text


async def test_a_reset_refused_while_blocks_are_held_forgets_nothing() -> None:
    """vLLM refuses a reset while a request holds blocks (``{"success": false}``): the answer
    names the worker, and its index is left as it is."""
    with running_fleet(1, decode_ms=50, prefill_tps=400000) as ws:
        url = ws[0].url
        async with (
            serve_router(config_for(ws)) as (base, router),
            httpx.AsyncClient(timeout=30) as c,
        ):
            await until(lambda: all(w.subscribed for w in router.registry.workers.values()), 20)
            body = {"model": "sim-model", "prompt": words(300, "busy"), "max_tokens": 200}
            async with c.stream("POST", base + "/v1/completions", json={**body, "stream": True}):
                await until(
                    lambda: router.index.resident_blocks((url, 0)) > 0,
                    10,
                    "the running request's events",
                )
                r = await c.post(base + "/reset_prefix_cache")
                assert r.status_code == 200, r.text
                doc = r.json()
                assert doc["success"] is False and doc["workers"][url]["success"] is False, doc
                assert router.index.resident_blocks((url, 0)) > 0
