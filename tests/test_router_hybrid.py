"""The router in front of hybrid workers (full attention + sliding window): real HTTP on
loopback, simulated vLLM workers with vLLM's sparse sliding-window retention, real ZMQ events."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from test_router_support import config_for, serve_router, until, words

from simulator.testing import running_fleet

pytestmark = pytest.mark.timeout(120)


def worker(explained: dict[str, Any], url: str) -> dict[str, Any]:
    return next(w for w in explained["workers"] if w["url"] == url)


async def test_a_shared_head_is_predicted_exactly_and_routed_to_its_junction():
    """A sibling sharing only the head of a prompt just served gets no hit on a hybrid engine:
    vLLM keeps the window's blocks at the first prompt's replay boundary, not at the head. The
    prediction says so (neither the index nor the speculative entry credits the head), the
    sibling still goes where the head's full-attention blocks are (computing it there pins
    the head as a junction), and the next prompt sharing the head hits it there."""
    fast = {"decode_ms": 1, "prefill_tps": 400000, "step_overhead_ms": 0.1}
    with running_fleet(2, num_gpu_blocks=1024, groups="full,swa:64", **fast) as workers:
        # A long speculative lifetime: the first prompt's entry is still live when the
        # sibling is asked about, whenever the events arrive.
        cfg = config_for(workers, policy={"speculative_ttl_s": 60.0})
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            await until(lambda: all(w.subscribed for w in router.registry.workers.values()), 20)
            head = words(512, "hybrid-head")

            def body(tail: str) -> dict[str, Any]:
                prompt = f"{head} {words(200, tail)}"
                return {"model": "sim-model", "prompt": prompt, "max_tokens": 1}

            r = await c.post(base + "/v1/completions", json=body("first"))
            assert r.status_code == 200, r.text
            first = r.headers["x-kvrouter-worker"]

            async def junction_known() -> dict[str, Any] | None:
                e = (await c.post(base + "/debug/route", json=body("second"))).json()
                return e if worker(e, first)["cost"]["junction_tokens"] >= 496 else None

            explained = await until(junction_known, 20, "the head's junction on the first worker")
            w = worker(explained, first)
            assert (w["gpu_hit_tokens"], w["speculative_hit_tokens"]) == (0, 0)
            assert explained["chosen"] == first and explained["predicted_hit_tokens"] == 0
            # The entry is there: a prompt extending the whole first one is credited up to its
            # replay boundary (its last token is computed again, the block it ends is not kept).
            n = (await c.post(base + "/debug/route", json=body("first"))).json()["prompt_tokens"]
            longer = body("first")
            longer["prompt"] += " " + words(50, "more")
            e = (await c.post(base + "/debug/route", json=longer)).json()
            assert worker(e, first)["speculative_hit_tokens"] == (n - 1) // 16 * 16, n

            r = await c.post(base + "/v1/completions", json=body("second"))
            assert r.headers["x-kvrouter-worker"] == first
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

            async def head_indexed() -> dict[str, Any] | None:
                e = (await c.post(base + "/debug/route", json=body("third"))).json()
                return e if worker(e, first)["gpu_hit_tokens"] >= 496 else None

            explained = await until(head_indexed, 20, "the head hittable on the first worker")
            hit = worker(explained, first)["gpu_hit_tokens"]
            r = await c.post(base + "/v1/completions", json=body("third"))
            assert r.headers["x-kvrouter-worker"] == first
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == hit
