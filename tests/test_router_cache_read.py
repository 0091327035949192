"""Requests vLLM serves without reading its prefix cache (``prompt_logprobs``, ``echo`` with
logprobs): the router predicts no hit, routes them by load and never verifies them, so such
traffic cannot mark a correctly indexed engine unverified."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from test_router_support import config_for, serve_router, until, words

from router.cache_read import reads_prefix_cache
from router.proxy import Outcome
from simulator.testing import running_fleet

pytestmark = pytest.mark.timeout(120)

FAST = {"decode_ms": 1, "prefill_tps": 400000, "step_overhead_ms": 0.1}


@pytest.mark.parametrize(
    ("body", "chat", "reads"),
    [
        ({}, False, True),
        ({"prompt_logprobs": 0}, False, False),
        ({"echo": True}, False, True),
        ({"echo": True, "logprobs": 0}, False, False),
        ({"logprobs": 5}, False, True),
        ({}, True, True),
        ({"echo": True}, True, False),  # top_logprobs defaults to 0 in vLLM's chat request
        ({"echo": True, "top_logprobs": None}, True, True),
        ({"prompt_logprobs": 1}, True, False),
    ],
)
def test_which_requests_read_the_prefix_cache(body: dict[str, Any], chat: bool, reads: bool):
    assert reads_prefix_cache(body, chat) is reads


async def test_prompt_logprobs_requests_get_no_prediction_and_no_verification() -> None:
    with running_fleet(2, num_gpu_blocks=512, **FAST) as workers:
        cfg = config_for(workers, policy={"speculative_ttl_s": 0.0}, verify={"min_samples": 4})
        body = {"model": "sim-model", "prompt": words(400, "logprobs"), "max_tokens": 1}
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            await until(lambda: all(w.subscribed for w in router.registry.workers.values()), 20)
            r = await c.post(base + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            first = r.headers["x-kvrouter-worker"]

            async def indexed() -> bool:
                res = await router.route(body, False, 0.0, dry_run=True)
                return max(m.gpu_tokens for m in res.matches.values()) >= 384

            await until(indexed, 20, "the prompt to be indexed")
            scored = {**body, "prompt_logprobs": 1}
            res = await router.route(scored, False, 0.0, dry_run=True)
            assert not res.reads_cache
            assert all(c.gpu_hit_tokens == c.cpu_hit_tokens == 0 for c in res.candidates)
            # vLLM reports nothing cached for it: never a sample, never unverified.
            engine = next(e for e in res.churn if e[0] == first)
            assert router.verifier is not None
            before = router.verifier.state(engine).samples
            for _ in range(10):
                router.verify_outcome(res, Outcome(200, first, None, 0, 401, engine))
            assert router.verifier.state(engine).samples == before
            assert not router.verifier.is_unverified(engine)
