"""vLLM's sleep mode behind the router, against simulated workers that sleep as vLLM 0.32 does
(``POST /sleep?level=N``, ``POST /wake_up``, ``vllm:engine_sleep_state``): an engine asleep
takes requests and runs none, so the router routes around it from the next poll; at level 1
or 2 its prefix cache is gone, announced by vLLM only with its first step after waking, so the
router forgets it when it sees the engine asleep."""

from __future__ import annotations

import httpx
import pytest
from test_router_support import config_for, serve_router, until, words

from simulator.testing import running_fleet

pytestmark = pytest.mark.timeout(120)

FAST = {"decode_ms": 1, "prefill_tps": 400000, "step_overhead_ms": 0.1}


async def _hits(c: httpx.AsyncClient, base: str, body: dict) -> dict[str, int]:
    e = (await c.post(base + "/debug/route", json=body)).json()
    return {w["url"]: w["gpu_hit_tokens"] for w in e["workers"]}


@pytest.mark.parametrize("level", [0, 1])
async def test_an_engine_asleep_is_routed_around_and_forgotten_when_its_cache_goes(
    level: int,
) -> None:
    with running_fleet(2, **FAST) as ws:
        cfg = config_for(ws, server={"worker_poll_s": 0.2})
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            await until(lambda: all(w.subscribed for w in router.registry.workers.values()), 20)
            body = {"model": "sim-model", "prompt": words(300, f"asleep{level}"), "max_tokens": 1}
            r = await c.post(base + "/v1/completions", json=body)
            a = r.headers["x-kvrouter-worker"]
            other = next(w.url for w in ws if w.url != a)

            async def held() -> bool:
                return (await _hits(c, base, body))[a] >= 288

            await until(held, 10, "the prompt's events")
            assert (await c.post(a + "/sleep", params={"level": str(level)})).status_code == 200
            assert (await c.get(a + "/is_sleeping")).json() == {"is_sleeping": True}
            worker = router.registry.workers[a]
            await until(lambda: worker.stalled, 10, "the router to see the engine asleep")
            assert "asleep" in worker.stalled and "/wake_up" in worker.stalled
            # Its cache is the best, but nothing runs there: the request goes elsewhere.
            r = await c.post(base + "/v1/completions", json=body)
            assert r.status_code == 200 and r.headers["x-kvrouter-worker"] == other
            ver = router.verifier
            assert ver is not None
            resets = ver.state((a, 0)).index_resets
            blocks = router.index.resident_blocks((a, 0))
            if level == 0:  # scheduling paused, the cache kept
                assert resets == {} and blocks >= 18, (resets, blocks)
            else:
                assert resets == {"sleep": 1} and blocks == 0, (resets, blocks)
            assert (await c.post(a + "/wake_up")).status_code == 200
            await until(lambda: not worker.stalled, 10, "the router to see the engine awake")
            predicted = (await _hits(c, base, body))[a]
            r = await c.post(a + "/v1/completions", json=body)
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == predicted == (288 if level == 0 else 0), (cached, predicted)
            assert ver.state((a, 0)).index_resets == resets  # once per sleep
