"""LoRA placement end to end: simulated vLLM workers serving adapters (statically, loaded at run
time through /v1/load_lora_adapter, or found by a resolver plugin), a router in front of them.

An adapter goes where it is loaded; one no worker has is loaded once on the best worker of its
base model (concurrent requests wait for that one load), a failed load falls back to the next
worker or answers with the workers' reasons, and ``vllm:lora_requests_info`` steers a new adapter
away from a worker whose batch slots are all taken by other adapters."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from test_router_support import config_for, serve_router, until, words

from router.core import Router
from router.lora import LoraSlots, parse_lora_info
from simulator.engine import EngineConfig, SimEngine
from simulator.testing import running_fleet

SIM = {"prefill_tps": 400000, "allow_runtime_lora_updating": True}
"""Workers that let a router load adapters (decode at the default 20 ms per step, so background
requests stay running for the whole test)."""


@asynccontextmanager
async def busy(url: str, n: int, model: str = "sim-model") -> AsyncIterator[None]:
    """``n`` long requests sent straight to a worker (not through the router): its /metrics
    shows them running, and a router sees only that."""
    async with httpx.AsyncClient(timeout=300) as c:
        body = {"model": model, "max_tokens": 5000}
        tasks = [
            asyncio.create_task(c.post(url + "/v1/completions", json={**body, "prompt": f"b{i}"}))
            for i in range(n)
        ]
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def lora_state(c: httpx.AsyncClient, url: str) -> dict[str, Any]:
    return (await c.get(url + "/sim/state")).json()["lora"]


async def ready(router: Router, running: dict[str, int]) -> None:
    """Every worker's models known, and the router's last /metrics poll showing at least
    ``running[url]`` running requests there."""

    def seen() -> bool:
        ws = router.registry.workers
        known = all(w.models for w in ws.values())
        return known and all(ws[u].load(0).running >= n for u, n in running.items())

    await until(seen, 30, f"workers' models and load {running}")


def complete(model: str, seed: str) -> dict[str, Any]:
    return {"model": model, "prompt": words(40, seed), "max_tokens": 1}


async def test_a_loaded_adapter_is_served_where_it_is_and_never_loaded_elsewhere() -> None:
    with (
        running_fleet(1, lora=["sql"], **SIM) as (has,),
        running_fleet(1, **SIM) as (other,),
    ):
        lora = {"dynamic_loading": True, "adapters": {"sql": "/adapters/sql"}}
        cfg = config_for([has, other], lora=lora)
        async with (
            serve_router(cfg) as (base, router),
            httpx.AsyncClient(timeout=30) as c,
            busy(has.url, 30),
        ):
            # The adapter's worker is the busier one: loading it on the idle one would still
            # be wrong, since it is loaded and serving already.
            await ready(router, {has.url: 30})
            for i in range(6):
                r = await c.post(base + "/v1/completions", json=complete("sql", f"s{i}"))
                assert r.status_code == 200, r.text
                assert r.headers["x-kvrouter-worker"] == has.url
            assert (await lora_state(c, other.url))["load_calls"] == {}
            assert (await lora_state(c, has.url))["load_calls"] == {}


async def test_a_missing_adapter_is_loaded_once_on_the_best_worker_then_routed_there() -> None:
    with running_fleet(3, lora_load_ms=400, **SIM) as ws:
        lora = {"dynamic_loading": True, "adapters": {"sql": "/adapters/sql"}}
        cfg = config_for(ws, lora=lora)
        best = ws[2]
        async with (
            serve_router(cfg) as (base, router),
            httpx.AsyncClient(timeout=30) as c,
            busy(ws[0].url, 30),
            busy(ws[1].url, 30),
        ):
            await ready(router, {ws[0].url: 30, ws[1].url: 30})
            # Eight requests at once while the load (400 ms) is in flight: one load call.
            answers = await asyncio.gather(
                *(c.post(base + "/v1/completions", json=complete("sql", f"c{i}")) for i in range(8))
            )
            assert [r.status_code for r in answers] == [200] * 8, [r.text for r in answers]
            assert {r.headers["x-kvrouter-worker"] for r in answers} == {best.url}
            calls = [(await lora_state(c, w.url))["load_calls"] for w in ws]
            assert calls == [{}, {}, {"sql": 1}]

            cards = (await c.get(best.url + "/v1/models")).json()["data"]
            card = next(m for m in cards if m["id"] == "sql")
            assert card["parent"] == "sim-model" and card["root"] == "/adapters/sql"
            for i in range(5):
                r = await c.post(base + "/v1/completions", json=complete("sql", f"n{i}"))
                assert r.status_code == 200 and r.headers["x-kvrouter-worker"] == best.url
            assert (await lora_state(c, best.url))["load_calls"] == {"sql": 1}
            listed = (await c.get(base + "/v1/models")).json()["data"]
            assert "sql" in {m["id"] for m in listed}


async def test_a_failed_load_falls_back_and_when_all_fail_the_error_names_them() -> None:
    with running_fleet(2, **SIM) as (w0, w1), running_fleet(1, prefill_tps=400000) as (fixed,):
        adapters = {"sql": "/adapters/sql", "bad": "/adapters/bad", "old": "/adapters/old"}
        cfg = config_for([w0, w1], lora={"dynamic_loading": True, "adapters": adapters})
        async with (
            serve_router(cfg) as (base, router),
            httpx.AsyncClient(timeout=30) as c,
            busy(w1.url, 30),
        ):
            await ready(router, {w1.url: 30})
            # w0 is the best worker but fails every load: the request is served from w1.
            await c.post(w0.url + "/sim/faults", json={"fail_lora_load": True})
            r = await c.post(base + "/v1/completions", json=complete("sql", "f"))
            assert r.status_code == 200, r.text
            assert r.headers["x-kvrouter-worker"] == w1.url
            assert (await lora_state(c, w0.url))["load_calls"] == {"sql": 1}
            assert (await lora_state(c, w1.url))["load_calls"] == {"sql": 1}

            # Both fail: the client hears why, from which worker, in OpenAI's error shape.
            await c.post(w1.url + "/sim/faults", json={"fail_lora_load": True})
            r = await c.post(base + "/v1/completions", json=complete("bad", "g"))
            assert r.status_code == 400
            err = r.json()["error"]
            assert err["type"] == "BadRequestError" and "`bad`" in err["message"]
            assert w0.url in err["message"] and w1.url in err["message"]
            assert "simulated engine failure" in err["message"]
            # Asked again at once: the same answer, without asking the workers again.
            again = await c.post(base + "/v1/completions", json=complete("bad", "h"))
            assert again.status_code == 400 and again.json() == r.json()
            for w in (w0, w1):
                assert (await lora_state(c, w.url))["load_calls"]["bad"] == 1

            # An adapter the configuration does not name stays a 404, as an unknown model.
            r = await c.post(base + "/v1/completions", json=complete("nope", "i"))
            assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"

        # A worker without runtime loading: the error says how to enable it.
        cfg = config_for([fixed], lora={"dynamic_loading": True, "adapters": adapters})
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            await ready(router, {})
            r = await c.post(base + "/v1/completions", json=complete("old", "j"))
            assert r.status_code == 502
            err = r.json()["error"]
            assert (
                fixed.url in err["message"]
                and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in (err["message"])
            )


async def test_lora_requests_info_steers_a_new_adapter_away_from_full_slots() -> None:
    with running_fleet(2, lora=["busy"], max_loras=1, **SIM) as (w0, w1):
        cfg = config_for(
            [w0, w1], lora={"dynamic_loading": True, "adapters": {"new": "/adapters/new"}}
        )
        body = complete("new", "k")
        async with (
            serve_router(cfg) as (base, router),
            httpx.AsyncClient(timeout=30) as c,
            busy(w1.url, 30),
        ):
            await ready(router, {w1.url: 30})

            async def chosen() -> str:
                return (await c.post(base + "/debug/route", json=body)).json()["chosen"]

            assert await chosen() == w0.url  # the less loaded worker, slots aside
            async with busy(w0.url, 1, model="busy"):
                # w0's only adapter slot (max_lora 1) is taken by "busy": "new" would wait.
                full = LoraSlots(1, frozenset({"busy"}), frozenset())
                await until(lambda: router.registry.workers[w0.url].lora_slots == full, 30)
                await until(lambda: router.registry.workers[w0.url].load(0).running == 1, 30)
                e = (await c.post(base + "/debug/route", json=body)).json()
                assert e["chosen"] == w1.url
                charged = {w["url"]: w["adapter_tokens"] for w in e["workers"]}
                assert charged == {w0.url: 2048 + 4096, w1.url: 2048}  # load; load + slot wait
                r = await c.post(base + "/v1/completions", json=body)
                assert r.status_code == 200 and r.headers["x-kvrouter-worker"] == w1.url
            assert (await lora_state(c, w1.url))["load_calls"] == {"new": 1}
            assert (await lora_state(c, w0.url))["load_calls"] == {}


async def test_with_a_worker_resolver_the_request_goes_to_the_best_worker_as_is() -> None:
    with running_fleet(2, lora_resolvable=["auto"], **SIM) as (w0, w1):
        cfg = config_for([w0, w1], lora={"worker_resolver": True})
        async with (
            serve_router(cfg) as (base, router),
            httpx.AsyncClient(timeout=30) as c,
            busy(w0.url, 30),
        ):
            await ready(router, {w0.url: 30})
            for i in range(3):
                r = await c.post(base + "/v1/completions", json=complete("auto", f"a{i}"))
                assert r.status_code == 200 and r.headers["x-kvrouter-worker"] == w1.url
            # The worker resolved it itself (once); the router loaded nothing, and tokenizing
            # the prompt (as the base model) made no other worker resolve it.
            assert (await lora_state(c, w1.url))["resolved"] == {"auto": 1}
            assert (await lora_state(c, w0.url))["resolved"] == {}
            assert (await lora_state(c, w1.url))["load_calls"] == {}
            # A name no resolver finds: the worker's own 404.
            r = await c.post(base + "/v1/completions", json=complete("typo", "t"))
            assert r.status_code == 404 and "typo" in r.json()["error"]["message"]
            listed = {m["id"] for m in (await c.get(base + "/v1/models")).json()["data"]}
            assert "typo" not in listed


def test_the_current_lora_requests_info_series_is_the_latest_one() -> None:
    text = (
        "# TYPE vllm:lora_requests_info gauge\n"
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",'
        'waiting_lora_adapters="c"} 1.7000000005e+09\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",'
        'waiting_lora_adapters=""} 1.7e+09\n'
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
    )
    assert parse_lora_info(text) == LoraSlots(2, frozenset({"a", "b"}), frozenset({"c"}))
    assert parse_lora_info("vllm:num_requests_running 1.0\n") is None


def test_the_simulated_scheduler_runs_at_most_max_loras_adapters_at_once() -> None:
    eng = SimEngine(EngineConfig(loras=("a", "b"), max_loras=1, decode_s_per_token=0.001))
    eng.add_request("ra", list(range(1, 33)), 2, 0.0, lora_name="a")
    eng.add_request("rb", list(range(1, 33)), 2, 0.0, lora_name="b")
    eng.add_request("rbase", list(range(40, 72)), 2, 0.0)
    now = eng.schedule(0.0)
    assert {r.request_id for r in eng.running} == {"ra", "rbase"}  # "b" waits for a slot
    for _ in range(10):
        eng.finish_step()
        now = eng.schedule(now)
        if "rb" in {r.request_id for r in eng.running}:
            break
    assert "rb" in {r.request_id for r in eng.running}
    assert "ra" not in eng.requests  # "b" ran only once "a" had finished
