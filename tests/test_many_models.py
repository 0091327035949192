"""Workers serving different models behind one router: each request goes only to workers that
serve its model (or adapter), unknown models get OpenAI's 404, and /v1/models is the fleet's."""

from __future__ import annotations

import math

import httpx
import pytest
from test_router_support import config_for, serve_router, until, words

from simulator.testing import running_fleet

FAST = {"decode_ms": 1, "prefill_tps": 400000}


async def test_requests_go_to_workers_of_their_model_and_cache_per_model() -> None:
    with (
        running_fleet(2, model="model-a", lora=["a-lora"], **FAST) as a,
        running_fleet(1, model="model-b", **FAST) as b,
    ):
        urls_a = {w.url for w in a}
        cfg = config_for([*a, *b])
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            await until(
                lambda: all(w.subscribed for w in router.registry.workers.values()), 30, "subs"
            )
            listed = (await c.get(base + "/v1/models")).json()["data"]
            assert sorted(m["id"] for m in listed) == ["a-lora", "model-a", "model-b"]

            for i in range(6):
                body = {"model": "model-b", "prompt": words(50, f"b{i}"), "max_tokens": 1}
                r = await c.post(base + "/v1/completions", json=body)
                assert r.status_code == 200 and r.headers["x-kvrouter-worker"] == b[0].url
            for model in ("model-a", "a-lora"):
                for i in range(4):
                    body = {"model": model, "prompt": words(50, f"{model}{i}"), "max_tokens": 1}
                    r = await c.post(base + "/v1/completions", json=body)
                    assert r.status_code == 200 and r.headers["x-kvrouter-worker"] in urls_a

            # The prefix cache is per model: a long prompt cached on model-a's worker is a hit
            # for model-a, and the same text for model-b predicts nothing there.
            long = {"model": "model-a", "prompt": words(400, "shared"), "max_tokens": 1}
            first = await c.post(base + "/v1/completions", json=long)
            holder = first.headers["x-kvrouter-worker"]

            async def predicted() -> int:
                e = (await c.post(base + "/debug/route", json=long)).json()
                w = next(x for x in e["workers"] if x["url"] == holder)
                return w["gpu_hit_tokens"]

            await until(predicted, 15, "model-a's prefix indexed")
            e = (await c.post(base + "/debug/route", json={**long, "model": "model-b"})).json()
            assert [w["url"] for w in e["workers"]] == [b[0].url]
            assert e["workers"][0]["gpu_hit_tokens"] == 0

            r = await c.post(base + "/v1/completions", json={**long, "model": "nope"})
            assert r.status_code == 404
            err = r.json()["error"]
            assert err["type"] == "NotFoundError" and "model-a" in err["message"]
            assert "model-b" in err["message"] and "a-lora" in err["message"]


async def test_prompts_are_tokenized_by_a_worker_of_their_model() -> None:
    """/tokenize goes to workers serving the request's model: another model's worker answers
    404 (or tokenizes differently), which would leave the request routed by load alone."""
    with (
        running_fleet(1, model="model-a", **FAST) as a,
        running_fleet(2, model="model-b", **FAST) as b,
    ):
        cfg = config_for([*a, *b])
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            await until(lambda: len(router.registry.healthy()) == 3, 30, "workers healthy")
            for i in range(6):  # more than one turn of the tokenizer rotation over 3 workers
                body = {"model": "model-a", "prompt": words(60, f"t{i}"), "max_tokens": 1}
                e = (await c.post(base + "/debug/route", json=body)).json()
                assert e["tokenize_error"] is None, e["tokenize_error"]
                assert e["tokenization"] != "failed" and e["prompt_tokens"] > 0


async def test_a_system_prompt_shared_by_one_models_requests_is_popular_within_that_model():
    """Prefix popularity is counted per model: model-a's eight requests all open with one
    system prompt while model-b brings twelve others. Against model-a's own requests the prompt
    is all of its traffic (a share just under 2/3 once taken one standard error low), so a copy
    on model-a's other worker is credited; against all twenty it would be under a third, no
    credit on two workers."""
    with (
        running_fleet(2, model="model-a", **FAST) as a,
        running_fleet(1, model="model-b", **FAST) as b,
    ):
        cfg = config_for([*a, *b])
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            await until(
                lambda: all(w.subscribed for w in router.registry.workers.values()), 30, "subs"
            )
            for i in range(12):
                body = {"model": "model-b", "prompt": words(300, f"other{i}"), "max_tokens": 1}
                assert (await c.post(base + "/v1/completions", json=body)).status_code == 200
            system = words(300, "model-a-system-prompt")
            holders = set()
            for i in range(8):
                body = {"model": "model-a", "prompt": f"{system} turn{i}", "max_tokens": 1}
                r = await c.post(base + "/v1/completions", json=body)
                assert r.status_code == 200, r.text
                holders.add(r.headers["x-kvrouter-worker"])
            assert len(holders) == 1  # the credit stays below recomputing the prompt
            (holder,) = holders
            probe = {"model": "model-a", "prompt": f"{system} probe"}
            e = (await c.post(base + "/debug/route", json=probe)).json()
            credit = {w["url"]: w["cost"]["new_holder_tokens"] for w in e["workers"]}
            k = sum(math.exp(-j / 256) for j in range(8))
            share = (k - math.sqrt(k)) / k
            (other,) = {w.url for w in a} - {holder}
            want = {holder: 0.0, other: (1 - 1 / (2 * share)) * 256}
            assert credit == pytest.approx(want, abs=1e-3)  # /debug/route rounds to 3 places
