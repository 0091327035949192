"""The router end to end: real HTTP on loopback, simulated vLLM workers, real ZMQ events."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from test_router_support import config_for, serve_app, serve_router, until, words

from indexer.index import PrefixIndex
from router.config import WorkerSpec
from router.tokenize import PromptTokenizer
from router.workers import WorkerRegistry
from simulator.testing import running_fleet

pytestmark = pytest.mark.timeout(120)

FAST = {"decode_ms": 1, "prefill_tps": 400000, "step_overhead_ms": 0.1}


@pytest.fixture(scope="module")
def fleet() -> Iterator[list[Any]]:
    with running_fleet(3, num_gpu_blocks=512, **FAST) as workers:
        yield workers


async def route(client: httpx.AsyncClient, base: str, body: dict[str, Any]) -> dict[str, Any]:
    r = await client.post(base + "/debug/route", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def hit_of(explained: dict[str, Any], url: str) -> int:
    return next(w["gpu_hit_tokens"] for w in explained["workers"] if w["url"] == url)


async def wait_indexed(client, base, body, url, min_tokens, timeout=20.0) -> dict[str, Any]:
    async def ok():
        e = await route(client, base, body)
        return e if hit_of(e, url) >= min_tokens else None

    return await until(ok, timeout, f"index to show {min_tokens} tokens on {url}")


async def test_repeated_prompt_lands_on_the_worker_that_cached_it(fleet):
    cfg = config_for(fleet, policy={"speculative_ttl_s": 0.0})
    body = {"model": "sim-model", "prompt": words(400, "repeat"), "max_tokens": 2}
    async with serve_router(cfg) as (base, _router), httpx.AsyncClient(timeout=30) as c:
        await until(lambda: c.get(base + "/ready"), 20)
        r = await c.post(base + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        first = r.headers["x-kvrouter-worker"]
        e = await wait_indexed(c, base, body, first, 384)
        assert e["chosen"] == first
        for _ in range(4):
            r = await c.post(base + "/v1/completions", json=body)
            assert r.headers["x-kvrouter-worker"] == first
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 384


async def test_siblings_sent_together_follow_the_first_ones_speculative_entry():
    """Two prompts sharing 1,500 tokens, sent at the same instant: whichever is routed first
    records its speculative entry before the other can be routed (the entry is recorded as the
    request goes out, on a kept-alive connection while the worker already computes). Without the
    entry (ttl 0) the second goes elsewhere: the first's prefill is queued on its worker and no
    event has arrived yet (prefill takes ~75 ms here)."""
    slow = {"decode_ms": 1, "prefill_tps": 20000, "step_overhead_ms": 0.1}
    with running_fleet(2, num_gpu_blocks=512, **slow) as workers:
        for ttl, together in ((2.0, True), (0.0, False)):
            cfg = config_for(workers, policy={"speculative_ttl_s": ttl})
            async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
                await until(lambda: all(w.subscribed for w in router.registry.workers.values()), 20)
                seen: set[str] = set()
                for i in range(40):  # a kept-alive connection to each worker first
                    body = {"model": "sim-model", "prompt": words(8, f"warm{ttl}{i}")}
                    r = await c.post(base + "/v1/completions", json={**body, "max_tokens": 1})
                    seen.add(r.headers["x-kvrouter-worker"])
                    if len(seen) == 2:
                        break
                assert len(seen) == 2
                shared = words(1500, f"herd-{ttl}")
                bodies = [
                    {"model": "sim-model", "prompt": f"{shared} tail{k}", "max_tokens": 1}
                    for k in range(2)
                ]
                rs = await asyncio.gather(
                    *(c.post(base + "/v1/completions", json=b) for b in bodies)
                )
                assert all(r.status_code == 200 for r in rs)
                chosen = {r.headers["x-kvrouter-worker"] for r in rs}
                assert (len(chosen) == 1) == together, (ttl, chosen)


async def test_a_poll_records_the_routers_own_requests_beside_the_waiting_gauge(fleet):
    """The waiting gauge is read once a poll; the router's own requests are counted at the
    same moment, so one of them that starts after the poll is never taken for a foreign one."""
    reg = WorkerRegistry([WorkerSpec(url=fleet[0].url)])
    try:
        w = next(iter(reg.workers.values()))
        ld = w.load(0)
        ld.prefilling_requests = 2  # two of this router's requests are before their first token
        await reg.check(w)
        assert w.healthy and w.metrics_ts > 0
        assert (ld.waiting, ld.prefilling_at_poll) == (0, 2)
        ld.waiting = 2  # as if both were still waiting when the gauge was read
        ld.prefilling_requests = 0  # and both started since
        assert ld.foreign_waiting() == 0
    finally:
        await reg.stop()


async def test_shared_system_prompt_goes_to_its_worker_and_debug_route_explains(fleet):
    system = {"role": "system", "content": words(300, "system-prompt")}
    chat1 = {"model": "sim-model", "messages": [system, {"role": "user", "content": "hi one"}]}
    chat2 = {"model": "sim-model", "messages": [system, {"role": "user", "content": "two?"}]}
    target = fleet[1].url
    async with httpx.AsyncClient(timeout=30) as c:
        cfg = config_for(fleet)
        async with serve_router(cfg) as (base, router):
            await until(lambda: all(w.subscribed for w in router.registry.workers.values()), 20)
            # Warm one worker directly (not through the router: no speculative entry).
            r = await c.post(target + "/v1/chat/completions", json={**chat1, "max_tokens": 2})
            assert r.status_code == 200
            steps_before = (await c.get(target + "/sim/state")).json()["engines"][0]["steps"]
            e = await wait_indexed(c, base, chat2, target, 288)
            assert e["chosen"] == target and e["kind"] == "chat"
            assert e["prompt_tokens"] > 300 and e["tokenization"] in ("remote", "cache")
            w = next(x for x in e["workers"] if x["url"] == target)
            assert w["groups"][0]["kind"] == "full_attention"
            assert w["groups"][0]["hit_tokens"] == w["gpu_hit_tokens"]
            assert set(w["load"]) >= {"inflight_requests", "queued_prefill_tokens", "kv_usage"}
            assert w["cost"]["uncached_tokens"] == e["prompt_tokens"] - w["gpu_hit_tokens"]
            assert w["cost"]["follow_on_tokens"] == 0  # no decision yet: no mean queue anywhere
            others = [x for x in e["workers"] if x["url"] != target]
            assert all(x["cost"]["tokens"] > w["cost"]["tokens"] for x in others)
            # /debug/route sent no generation request anywhere.
            steps_after = (await c.get(target + "/sim/state")).json()["engines"][0]["steps"]
            assert steps_after == steps_before
            r = await c.post(base + "/v1/chat/completions", json={**chat2, "max_tokens": 2})
            assert r.headers["x-kvrouter-worker"] == target
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= 288
            m = (await c.get(base + "/metrics")).text
            for name in (
                "kvrouter_requests_total",
                "kvrouter_ttft_seconds_bucket",
                "kvrouter_route_decision_seconds_bucket",
                "kvrouter_predicted_hit_tokens_total",
                "kvrouter_prompt_tokens_total",
                "kvrouter_worker_inflight_requests",
                "kvrouter_worker_healthy",
                "kvrouter_index_resident_blocks",
                "kvrouter_events_total",
                "kvrouter_event_gaps_total",
                "kvrouter_replays_total",
                "kvrouter_worker_degraded",
                "kvrouter_decode_errors_total",
                "kvrouter_prediction_error_tokens_bucket",
                "kvrouter_redis_up",
                "kvrouter_tokenize_failures_total",
                "kvrouter_request_duration_seconds_bucket",
            ):
                assert name in m, name
            d = (await c.get(base + "/debug/index")).json()
            tw = next(x for x in d["workers"] if x["url"] == target)
            assert tw["resident_blocks"] > 0 and tw["engines"][0]["subscriber"]["connected"]
            assert d["process_rss_bytes"] > 0 and d["totals"]["resident_blocks"] > 0


async def test_a_worker_whose_scheduler_stalls_is_skipped_until_it_runs_again():
    """vLLM's scheduler can deadlock under KV pressure with /health still answering: requests
    wait, none run. The router takes such a worker out of routing, whatever it caches, says why
    in /debug/index and /metrics, and routes to it again once it runs requests."""
    body = {"model": "sim-model", "prompt": words(400, "stalled"), "max_tokens": 2}
    with running_fleet(2, num_gpu_blocks=512, **FAST) as ws:
        a, b = ws[0].url, ws[1].url
        cfg = config_for(ws, server={"worker_stall_s": 1.0})
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            await until(lambda: all(w.subscribed for w in router.registry.workers.values()), 20)
            assert (await c.post(a + "/v1/completions", json=body)).status_code == 200
            assert (await wait_indexed(c, base, body, a, 384))["chosen"] == a
            r = await c.post(a + "/sim/faults", json={"stall_scheduler": True})
            assert r.status_code == 200
            stuck = asyncio.create_task(c.post(a + "/v1/completions", json=body))
            worker = router.registry.workers[a]
            await until(lambda: worker.stalled, 15, "the stalled worker to be skipped")
            assert "waiting and none running" in worker.stalled and not stuck.done()
            d = (await c.get(base + "/debug/index")).json()
            row = next(x for x in d["workers"] if x["url"] == a)
            assert row["healthy"] and row["stalled"] == worker.stalled
            m = (await c.get(base + "/metrics")).text
            assert re.search(rf'kvrouter_worker_stalled{{worker="{re.escape(a)}"}} 1\.0', m), m
            for _ in range(3):  # its cache is still the best, but nothing would run there
                r = await c.post(base + "/v1/completions", json=body)
                assert r.status_code == 200 and r.headers["x-kvrouter-worker"] == b
            r = await c.post(a + "/sim/faults", json={"stall_scheduler": False})
            assert r.status_code == 200
            assert (await stuck).status_code == 200
            await until(lambda: worker.stalled is None, 15, "the worker to be routable again")
            assert a in {w.url for w in router.registry.routable()}


async def test_requests_waiting_on_a_stalled_worker_are_taken_back():
    """Requests the router sent before it found the scheduler stalled do not wait for
    first_byte_timeout_s: each is aborted there before its first token (the worker's queue
    empties); the buffered one, whose response head had not come, is answered by the other
    worker; the stream, whose head was forwarded, ends with a 503 error event."""
    body = {"model": "sim-model", "prompt": words(400, "stalled"), "max_tokens": 2}
    with running_fleet(2, num_gpu_blocks=512, **FAST) as ws:
        a, b = ws[0].url, ws[1].url
        cfg = config_for(ws, server={"worker_stall_s": 1.0, "first_byte_timeout_s": 40.0})
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=60) as c:
            await until(lambda: all(w.subscribed for w in router.registry.workers.values()), 20)
            assert (await c.post(a + "/v1/completions", json=body)).status_code == 200
            assert (await wait_indexed(c, base, body, a, 384))["chosen"] == a
            assert (await c.post(a + "/sim/faults", json={"stall_scheduler": True})).is_success
            t0 = asyncio.get_running_loop().time()

            async def stream() -> tuple[int, str, bytes]:
                req = {**body, "stream": True}
                async with c.stream("POST", base + "/v1/completions", json=req) as r:
                    raw = b"".join([x async for x in r.aiter_raw()])
                    return r.status_code, r.headers["x-kvrouter-worker"], raw

            streamed = asyncio.create_task(stream())
            buffered = asyncio.create_task(c.post(base + "/v1/completions", json=body))
            r = await buffered
            assert r.status_code == 200 and r.headers["x-kvrouter-worker"] == b
            status, worker, raw = await streamed
            assert (status, worker) == (200, a)
            assert b'"code":503' in raw and b"is stalled" in raw, raw
            assert raw.endswith(b"data: [DONE]\n\n")
            assert asyncio.get_running_loop().time() - t0 < 30
            state = (await c.get(a + "/sim/state")).json()
            assert [e["waiting"] for e in state["engines"]] == [0]
            m = (await c.get(base + "/metrics")).text
            failed = re.search(r'kvrouter_upstream_failures_total{reason="stalled"} (\S+)', m)
            assert failed and float(failed.group(1)) == 2.0, m


async def test_a_stalled_dp_rank_is_skipped_and_the_other_ranks_keep_serving():
    """With data parallelism a stall is per engine: the worker's other rank takes the traffic,
    /debug/index names the stalled rank, and the rank comes back once it runs again."""
    body = {"model": "sim-model", "prompt": words(300, "dp-stall"), "max_tokens": 2}
    with running_fleet(1, dp_size=2, num_gpu_blocks=512, **FAST) as ws:
        url = ws[0].url
        cfg = config_for(ws, server={"worker_stall_s": 1.0})
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            worker = router.registry.workers[url]
            await until(lambda: worker.subscribed and worker.dp_size == 2, 20)
            assert (await c.post(url + "/sim/faults", json={"stall_scheduler": [0]})).is_success
            rank_0 = {"x-data-parallel-rank": "0"}
            stuck = asyncio.create_task(c.post(url + "/v1/completions", json=body, headers=rank_0))
            await until(lambda: worker.stalled_ranks == {0}, 15, "rank 0 to be skipped")
            assert worker in router.registry.routable() and not stuck.done()
            for i in range(4):  # rank 0 would keep them waiting
                other = {**body, "prompt": words(50, f"q{i}")}
                assert (await c.post(base + "/v1/completions", json=other)).status_code == 200
            d = (await c.get(base + "/debug/index")).json()
            assert next(x for x in d["workers"] if x["url"] == url)["stalled_ranks"] == [0]
            assert (await c.post(url + "/sim/faults", json={"stall_scheduler": False})).is_success
            assert (await stuck).status_code == 200
            await until(lambda: not worker.stalled_ranks, 15, "rank 0 to be routable again")


async def test_a_dp_worker_configured_as_one_engine_is_named_with_the_fix(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``events=`` given and no ``dp_size``: the router subscribes to rank 0 alone, while
    vLLM's own balancer spreads its requests over every rank. The worker's /metrics show the
    other rank; the router says so, with the setting that fixes it, and not once configured
    right."""
    with running_fleet(1, dp_size=2, **FAST) as (w,):
        spec = WorkerSpec(url=w.url, events=w.events_endpoint, replay=w.replay_endpoint)
        cfg = config_for([w])
        cfg.workers = [spec]
        async with serve_router(cfg) as (base, _router), httpx.AsyncClient(timeout=30) as c:

            async def unseen() -> int:
                return (await c.get(base + "/debug/index")).json()["workers"][0]["unseen_ranks"]

            assert await until(unseen, 20, "the second rank to be noticed") == 1
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert any("runs 2 DP ranks" in m and "set dp_size=2" in m for m in errors), errors
        cfg.workers = [WorkerSpec(url=w.url, events=w.events_endpoint, dp_size=2)]
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            (worker,) = router.registry.workers.values()
            await until(lambda: worker.metrics_ts, 20, "a /metrics poll")
            doc = (await c.get(base + "/debug/index")).json()["workers"][0]
            assert (doc["dp_size"], doc["unseen_ranks"]) == (2, 0)
            # The self-check's two probes go to one rank, so its hit check compares something.
            check = await until(
                lambda: (router.selfcheck.debug(w.url) or {}).get("hits_detail"),
                20,
                "the self-check",
            )
            predicted, cached = map(int, re.findall(r"\d+", check))
            assert predicted == cached > 0, check


async def test_eviction_changes_routing():
    prompt = words(480, "evict-me")
    half = " ".join(prompt.split()[:240])
    with running_fleet(2, num_gpu_blocks=64, **FAST) as ws:
        a, b = ws[0].url, ws[1].url
        body = {"model": "sim-model", "prompt": prompt, "max_tokens": 1}
        async with (
            httpx.AsyncClient(timeout=30) as c,
            serve_router(config_for(ws)) as (base, router),
        ):
            await until(lambda: all(w.subscribed for w in router.registry.workers.values()), 20)
            assert (await c.post(a + "/v1/completions", json=body)).status_code == 200
            r = await c.post(b + "/v1/completions", json={**body, "prompt": half})
            assert r.status_code == 200
            # Each worker's events come on its own socket: wait for b's too, not only a's.
            await wait_indexed(c, base, body, b, 224)
            e = await wait_indexed(c, base, body, a, 464)
            assert e["chosen"] == a and hit_of(e, b) >= 224
            # Fill a's 64-block cache with other prompts: the LRU evicts the 480-token one.
            for i in range(3):
                filler = {
                    "model": "sim-model",
                    "prompt": words(600, f"fill{i}"),
                    "max_tokens": 1,
                }
                assert (await c.post(a + "/v1/completions", json=filler)).status_code == 200

            async def moved():
                e = await route(c, base, body)
                return e if hit_of(e, a) == 0 and e["chosen"] == b else None

            e = await until(moved, 20, "BlockRemoved to reach the index")
            r = await c.post(base + "/v1/completions", json=body)
            assert r.headers["x-kvrouter-worker"] == b


def _normalize(sse: bytes) -> bytes:
    sse = re.sub(rb'"id":"[^"]*"', b'"id":"X"', sse)
    sse = re.sub(rb'"created":\d+', b'"created":0', sse)
    return re.sub(rb'"content":"[^"]*"', b'"content":"C"', sse)


async def test_streaming_passthrough_matches_the_direct_worker_stream(fleet):
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": words(50, "stream")}],
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with (
        serve_router(config_for(fleet[:1])) as (base, _r),
        httpx.AsyncClient(timeout=30) as c,
    ):
        async with c.stream("POST", fleet[0].url + "/v1/chat/completions", json=body) as r:
            direct = b"".join([x async for x in r.aiter_raw()])
        async with c.stream("POST", base + "/v1/chat/completions", json=body) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["x-kvrouter-worker"] == fleet[0].url
            routed = b"".join([x async for x in r.aiter_raw()])
    assert routed.endswith(b"data: [DONE]\n\n") and routed.count(b"data: ") == 8 + 3
    # ids, timestamps and sampled words differ per request; everything else is byte-identical
    # (the cached_tokens of the second request differ: compare without usage)
    strip = lambda s: re.sub(rb'"usage":\{.*?\}\}', b"", _normalize(s))  # noqa: E731
    assert strip(routed) == strip(direct)


def _stub_worker(events: dict[str, asyncio.Event], fail_status: int | None = None) -> FastAPI:
    """A worker that streams fixed bytes (split mid-line and mid-UTF-8) or fails with 5xx."""
    app = FastAPI()
    parts = [b'data: {"a":', b'1}\n\ndata: {"t":"\xc3', b'\xa9"}\n\n', b"data: [DONE]\n\n"]

    @app.get("/health")
    async def health():
        return JSONResponse({})

    @app.get("/v1/models")
    async def models():
        return JSONResponse({"data": [{"id": "sim-model", "parent": None}]})

    @app.get("/kv_event_sources")
    async def sources():
        return JSONResponse({})

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return JSONResponse({"tokens": list(range(40)), "count": 40})

    @app.post("/v1/completions")
    async def completions(request: Request):
        if fail_status is not None:
            return JSONResponse({"error": {"message": "boom"}}, status_code=fail_status)

        async def gen() -> AsyncIterator[bytes]:
            for i, p in enumerate(parts):
                if i == 1:
                    await events["first_seen"].wait()  # client saw chunk 0 before chunk 1 exists
                yield p
            events["done"].set()

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


async def test_streaming_is_byte_exact_and_chunk_by_chunk():
    ev = {"first_seen": asyncio.Event(), "done": asyncio.Event()}
    async with serve_app(_stub_worker(ev)) as stub:
        cfg = config_for([stub])
        async with serve_router(cfg) as (base, _r), httpx.AsyncClient(timeout=30) as c:
            body = {"model": "sim-model", "prompt": "x", "stream": True}
            async with c.stream("POST", base + "/v1/completions", json=body) as r:
                got = b""
                async for chunk in r.aiter_raw():
                    if not ev["first_seen"].is_set():
                        assert chunk == b'data: {"a":'
                        ev["first_seen"].set()
                    got += chunk
            assert got == b'data: {"a":1}\n\ndata: {"t":"\xc3\xa9"}\n\ndata: [DONE]\n\n'


async def test_retry_on_failing_and_dead_worker(fleet):
    live = fleet[2].url
    ev = {"first_seen": asyncio.Event(), "done": asyncio.Event()}
    async with serve_app(_stub_worker(ev, fail_status=503)) as stub:
        cfg = config_for([stub, live], policy={"name": "round_robin"})
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            router.registry.poll_interval_s = 3600  # keep the failing stub "healthy"
            body = {"model": "sim-model", "prompt": words(20, "retry"), "max_tokens": 1}
            for _ in range(4):  # round robin puts the stub first every other request
                r = await c.post(base + "/v1/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.headers["x-kvrouter-worker"] == live
            stub_worker = router.registry.workers[stub]
    # The stub is gone now (connection refused): still served, and the worker is skipped.
    async with (
        serve_router(config_for([stub, live], policy={"name": "round_robin"})) as (
            base,
            router,
        ),
        httpx.AsyncClient(timeout=30) as c,
    ):
        router.registry.workers[stub].healthy = True  # pretend it just died after a good probe
        for _ in range(3):
            r = await c.post(base + "/v1/completions", json=body)
            assert r.status_code == 200 and r.headers["x-kvrouter-worker"] == live
        assert router.registry.workers[stub].healthy is False
    assert stub_worker is not None


async def test_body_limits_and_bad_input(fleet):
    cfg = config_for(fleet[:1], server={"max_body_bytes": 2000})
    async with serve_router(cfg) as (base, _r), httpx.AsyncClient(timeout=30) as c:
        url = base + "/v1/completions"
        r = await c.post(url, json={"prompt": "x" * 5000})
        assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"

        async def chunked():  # no Content-Length: counted while streaming
            for _ in range(10):
                yield b" " * 500

        r = await c.post(url, content=chunked(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        for bad in (b"{not json", b"[1,2]", b"", b'{"prompt": "x", "stream": "yes"}'):
            r = await c.post(url, content=bad, headers={"content-type": "application/json"})
            assert r.status_code == 400, bad
            err = r.json()["error"]
            assert set(err) >= {"message", "type", "code"}
        r = await c.post(base + "/v1/chat/completions", json={"messages": []})
        assert r.status_code == 400
        r = await c.post(base + "/debug/route", content=b"{")
        assert r.status_code == 400
        r = await c.get(base + "/nope")
        assert r.status_code == 404 and "error" in r.json()
        r = await c.post(url, json={"prompt": "hello there", "max_tokens": 1, "model": "nope"})
        assert r.status_code == 404  # the worker's own error, passed through unchanged
        r = await c.get(base + "/v1/models")
        assert r.json()["data"][0]["id"] == "sim-model"


async def test_tokenization_failure_routes_by_load(fleet):
    cfg = config_for(fleet[:2])
    async with serve_router(cfg) as (base, _router), httpx.AsyncClient(timeout=30) as c:
        # Bad chat content: the worker's /tokenize rejects it (400); routing falls back to load,
        # the worker answers the request with its own 400.
        body = {"model": "sim-model", "messages": [{"role": "user", "content": {"bad": 1}}]}
        r = await c.post(base + "/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.headers["x-kvrouter-worker"]
        m = (await c.get(base + "/metrics")).text
        assert re.search(r"kvrouter_tokenize_failures_total 1\.0", m)


def _hanging_worker(closed: asyncio.Event, started: asyncio.Event) -> FastAPI:
    """A worker whose generation never ends; it records when its client (the router) leaves.

    (The simulator does not abort a request when its client disconnects, so it cannot show
    the cancellation; vLLM does abort.)"""
    app = _stub_worker({"first_seen": asyncio.Event(), "done": asyncio.Event()})
    app.router.routes = [
        r for r in app.router.routes if getattr(r, "path", "") != "/v1/completions"
    ]

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        started.set()

        async def wait_gone() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(0.02)
            closed.set()

        if not body.get("stream"):
            await asyncio.wait_for(wait_gone(), 30)
            return JSONResponse({})

        async def gen() -> AsyncIterator[bytes]:
            try:
                while True:
                    yield b"data: {}\n\n"
                    await asyncio.sleep(0.02)
            finally:
                closed.set()

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_cancels_upstream(stream):
    closed, started = asyncio.Event(), asyncio.Event()
    async with (
        serve_app(_hanging_worker(closed, started)) as stub,
        serve_router(config_for([stub])) as (base, router),
        httpx.AsyncClient(timeout=30) as c,
    ):
        body = {"model": "sim-model", "prompt": "x", "stream": stream}
        task = asyncio.create_task(
            c.send(c.build_request("POST", base + "/v1/completions", json=body), stream=True)
        )
        await asyncio.wait_for(started.wait(), 10)
        if stream:
            resp = await task
            await resp.aiter_raw().__anext__()
            await resp.aclose()
        else:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await asyncio.wait_for(closed.wait(), 10)
        w = router.registry.workers[stub]
        await until(lambda: w.inflight == 0, 10, "in-flight accounting to be released")


async def test_multi_turn_chat_reuses_keys_exactly(fleet):
    cfg = config_for(fleet[:1])
    async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
        msgs = [{"role": "system", "content": words(100, "mt-sys")}]
        for turn in range(3):
            msgs.append({"role": "user", "content": words(30, f"mt-user-{turn}")})
            r = await c.post(
                base + "/v1/chat/completions",
                json={"model": "sim-model", "messages": msgs, "max_tokens": 3},
            )
            assert r.status_code == 200
            msgs.append(r.json()["choices"][0]["message"] | {"tool_calls": None})
            msgs[-1] = {"role": "assistant", "content": msgs[-1]["content"]}
        assert router.tokenizer.stats["prefix_reuse"] >= 2
        # Exactness: reused keys equal keys computed from scratch.
        tk = router.tokenizer
        _, root = router.namespace_root({"model": "sim-model"})
        body = {"model": "sim-model", "messages": msgs}
        res = await PromptTokenizer(tk.unit).tokenize(body, True, root, router._remote_tokenize)
        fresh = PrefixIndex(unit=tk.unit).prompt_keys(list(memoryview(res.data).cast("I")), root)
        cached = await tk.tokenize(
            {**body, "messages": [*msgs, {"role": "user", "content": "more"}]},
            True,
            root,
            router._remote_tokenize,
        )
        assert cached.source.endswith("+prefix")
        assert list(cached.keys[: len(fresh) - 2]) == fresh[: len(fresh) - 2]
        assert list(res.keys) == fresh


async def test_completion_goes_to_the_worker_as_the_ids_its_tokenize_returned(fleet):
    """The router tokenized the prompt through /tokenize; the worker gets those ids, not the text
    to tokenize a second time, and answers exactly as it does for the text. ``echo`` keeps the
    text (the echoed prompt must be the client's), chat and ``forward_ids: false`` too."""
    w = fleet[:1]
    prompt = words(300, "fwd")

    async def forms(c: httpx.AsyncClient) -> dict[str, int]:
        return (await c.get(w[0].url + "/sim/state")).json()["prompt_forms"]

    async def delta(c, base, body) -> tuple[dict[str, int], dict[str, Any]]:
        before = await forms(c)
        r = await c.post(base + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        after = await forms(c)
        return {k: after[k] - before[k] for k in after}, r.json()

    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 2}
    async with httpx.AsyncClient(timeout=30) as c:
        direct = (await c.post(w[0].url + "/v1/completions", json=body)).json()
        async with serve_router(config_for(w)) as (base, _r):
            await until(lambda: c.get(base + "/ready"), 20)
            d, routed = await delta(c, base, body)
            assert d == {"text": 0, "ids": 1, "chat": 0}
            assert routed["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
            assert routed["usage"]["prompt_tokens_details"]["cached_tokens"] >= 288  # same ids
            d, _ = await delta(c, base, {**body, "echo": True})  # (the simulator does not echo)
            assert d["text"] == 1
            d, _ = await delta(c, base, {**body, "prompt": [prompt]})
            assert d["ids"] == 1
            chat = {"model": "sim-model", "messages": [{"role": "user", "content": prompt}]}
            r = await c.post(base + "/v1/chat/completions", json={**chat, "max_tokens": 2})
            assert r.status_code == 200
        async with serve_router(config_for(w, tokenizer={"forward_ids": False})) as (base, _r):
            await until(lambda: c.get(base + "/ready"), 20)
            d, _ = await delta(c, base, body)
            assert d == {"text": 1, "ids": 0, "chat": 0}


async def test_tokenize_answers_are_spliced_as_sent_and_bad_ids_fall_back_to_text():
    """The ids of a /tokenize answer go into the upstream body exactly as the worker wrote them
    (whitespace included: parsed once for the keys, never re-encoded). An answer whose ids are
    not integers in [0, 2**32) is a tokenization failure: counted, routed by load, and the
    worker gets the client's text."""
    answers = [
        b'{"count": 3, "max_model_len": 4096, "tokens": [ 5,\n 6 ,7 ], "token_strs": null}',
        b'{"count": 2, "tokens": [5, -6]}',
        b'{"count": 2, "tokens": [5, 6.5]}',
        b'{"count": 1, "tokens": [4294967296]}',
    ]
    seen: list[bytes] = []
    app = FastAPI()

    @app.get("/health")
    async def health():
        return JSONResponse({})

    @app.get("/v1/models")
    async def models():
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

    @app.post("/tokenize")
    async def tokenize(request: Request):
        from starlette.responses import Response

        return Response(answers[0], media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request):
        seen.append(await request.body())
        return JSONResponse({"id": "c", "object": "text_completion", "choices": []})

    async with serve_app(app) as stub:
        cfg = config_for([stub])
        cfg.workers[0].events = "tcp://127.0.0.1:9"  # no events: routed by load either way
        cfg.verify.selfcheck = cfg.verify.enabled = False  # no probe requests of its own
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            await until(lambda: router.registry.tokenizer_workers(), 20, "a probed worker")
            for i, answer in enumerate(answers):
                answers[0] = answer
                body = {"model": "m", "prompt": f"hello {i}", "max_tokens": 1}
                r = await c.post(base + "/v1/completions", json=body)
                assert r.status_code == 200, r.text
            m = (await c.get(base + "/metrics")).text
    assert b'"prompt":[ 5,\n 6 ,7 ]' in seen[0]
    assert [b'"prompt":"hello %d"' % i in seen[i] for i in (1, 2, 3)] == [True] * 3
    assert re.search(r"kvrouter_tokenize_failures_total 3\.0", m)


async def test_a_failing_record_after_the_write_loses_no_request_and_no_connection(fleet):
    """The speculative record runs after the request is written. Fault injection: make it raise.
    Every request is still answered, and the kept-alive connections are reused, not leaked."""
    cfg = config_for(fleet[:1])
    async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
        await until(lambda: c.get(base + "/ready"), 20)

        def broken(*_args: Any) -> None:
            raise RuntimeError("injected")

        router.speculative.record = broken  # type: ignore[method-assign]
        w = next(iter(router.registry.workers.values()))
        for i in range(12):
            body = {"model": "sim-model", "prompt": words(40, f"fail{i}"), "max_tokens": 1}
            r = await c.post(base + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
        assert w.client.open_connections <= 2, "one for /tokenize's turn, one for the proxy"
        assert w.inflight == 0
