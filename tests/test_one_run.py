"""A request runs on at most one worker: only failures that prove nothing reached the worker try
the next one; everything else answers the client, is counted by reason, and withdraws the
failed attempt's speculative entry."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from test_router_support import config_for, serve_app, serve_router, until

from router import proxy

_TOKENS = list(range(40))


def _worker(name: str, seen: list[str], hang: asyncio.Event | None = None) -> FastAPI:
    """A worker that answers completions at once, or reads them and answers nothing until
    ``hang`` is set (so that the test's server can shut down)."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"data": [{"id": "sim-model", "parent": None}]})

    @app.get("/kv_event_sources")
    async def sources() -> JSONResponse:
        return JSONResponse({})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        return JSONResponse({"tokens": _TOKENS, "count": len(_TOKENS)})

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        await request.body()
        seen.append(name)
        if hang is not None:
            await hang.wait()
        return JSONResponse({"choices": [{"text": "ok"}], "usage": {"prompt_tokens": 40}})

    return app


async def _dying_worker(seen: list[str]) -> tuple[asyncio.Server, str]:
    """Raw HTTP: answers the router's probes, but reads a completion, "prefills" 0.3 s and dies
    (closes the connection without a byte), as a worker process killed mid-prefill does."""

    async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await r.readexactly(length)
                path = head.split(b" ")[1]
                if path == b"/v1/completions":
                    seen.append("dying")
                    await asyncio.sleep(0.3)
                    return
                body = {
                    b"/v1/models": b'{"data":[{"id":"sim-model","parent":null}]}',
                    b"/tokenize": b'{"tokens":%s,"count":40}' % str(_TOKENS).encode(),
                }.get(path, b"{}")
                w.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(body), body)
                )
                await w.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def _failures(router: Any, reason: str) -> float:
    value = router.metrics.registry.get_sample_value(
        "kvrouter_upstream_failures_total", {"reason": reason}
    )
    return value or 0.0


async def _send_until_failed(base: str, seen: list[str], bad: str) -> httpx.Response:
    """Round robin: the first or the second request lands on the bad worker."""
    async with httpx.AsyncClient(timeout=30) as c:
        body = {"model": "sim-model", "prompt": "x", "max_tokens": 1}
        for _ in range(2):
            before = seen.count(bad)
            r = await c.post(base + "/v1/completions", json=body)
            if seen.count(bad) > before:
                return r
    raise AssertionError(f"no request reached {bad}: {seen}")


async def test_first_byte_timeout_is_answered_not_run_again() -> None:
    seen: list[str] = []
    release = asyncio.Event()
    async with (
        serve_app(_worker("hang", seen, hang=release)) as hang,
        serve_app(_worker("ok", seen)) as ok,
    ):
        cfg = config_for(
            [hang, ok],
            policy={"name": "round_robin", "speculative_ttl_s": 60.0},
            server={"first_byte_timeout_s": 1.0},
        )
        async with serve_router(cfg) as (base, router):
            t = time.monotonic()
            r = await _send_until_failed(base, seen, "hang")
            assert r.status_code == 504, r.text
            assert r.json()["error"]["type"] == "timeout"
            assert time.monotonic() - t < 1.0 + 1.5
            # The hung worker may still be computing it: the request went nowhere else.
            assert seen.count("hang") == 1
            assert seen.count("ok") == len(seen) - 1
            assert _failures(router, "first_byte_timeout") == 1
            # The failed attempt's speculative entry is withdrawn; the served one stays.
            assert router.speculative.hit_tokens((hang, 0), _keys(router), 16, 0.0) == 0
            if seen.count("ok"):
                assert router.speculative.hit_tokens((ok, 0), _keys(router), 16, 0.0) == 32
        release.set()


def _keys(router: Any) -> list[int]:
    return router.index.prompt_keys(_TOKENS, router.namespace_root({"model": "sim-model"})[1])


async def test_worker_dying_mid_prefill_is_answered_not_run_again() -> None:
    seen: list[str] = []
    server, dying = await _dying_worker(seen)
    try:
        async with serve_app(_worker("ok", seen)) as ok:
            cfg = config_for([dying, ok], policy={"name": "round_robin"})
            async with serve_router(cfg) as (base, router):
                r = await _send_until_failed(base, seen, "dying")
                assert r.status_code == 502, r.text
                assert seen.count("dying") == 1
                assert seen.count("ok") == len(seen) - 1
                assert _failures(router, "protocol") == 1
    finally:
        server.close()
        await server.wait_closed()


async def test_connection_refused_tries_the_next_worker() -> None:
    seen: list[str] = []
    async with serve_app(_worker("gone", seen)) as gone:
        pass  # nothing listens there any more
    async with serve_app(_worker("ok", seen)) as ok:
        cfg = config_for([gone, ok], policy={"name": "round_robin"})
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            router.registry.workers[gone].healthy = True  # it died after a good probe
            body = {"model": "sim-model", "prompt": "x", "max_tokens": 1}
            for _ in range(2):
                r = await c.post(base + "/v1/completions", json=body)
                assert r.status_code == 200 and r.headers["x-kvrouter-worker"] == ok
            assert _failures(router, "connect") >= 1


async def test_worker_removed_before_forwarding_is_skipped() -> None:
    """Discovery may drop a worker between the routing decision and an attempt on it."""
    seen: list[str] = []
    async with serve_app(_worker("ok", seen)) as ok:
        cfg = config_for([ok])
        async with serve_router(cfg) as (_base, router):
            gone = "http://127.0.0.1:9"
            failed: list[tuple[tuple[str, int], str]] = []
            outcomes: list[proxy.Outcome] = []

            async def receive() -> dict[str, Any]:
                await asyncio.Event().wait()  # the client stays connected
                return {}

            resp = await proxy.forward(
                registry=router.registry,
                path="/v1/completions",
                body=b'{"model":"sim-model","prompt":"x"}',
                headers=[(b"content-type", b"application/json")],
                attempts=[proxy.Attempt((gone, 0), 1), proxy.Attempt((ok, 0), 1)],
                stream=False,
                receive=receive,
                t0=time.perf_counter(),
                done=outcomes.append,
                on_failed=lambda e, why: failed.append((e, why)),
            )
            assert resp.status_code == 200
            assert failed == [((gone, 0), "worker_gone")]
            assert seen == ["ok"]
            await until(lambda: outcomes, 5, "the outcome (recorded after the answer)")
            assert [o.status for o in outcomes] == [200]


async def test_client_gone_mid_upload_is_a_499_not_an_internal_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[str] = []
    async with (
        serve_app(_worker("ok", seen)) as ok,
        serve_router(config_for([ok])) as (
            base,
            router,
        ),
    ):
        host, port = base.rsplit("/", 1)[1].split(":")
        _r, w = await asyncio.open_connection(host, int(port))
        w.write(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 100000\r\n\r\n" + b'{"prompt": "' + b"x" * 1000
        )
        await w.drain()
        w.close()
        await w.wait_closed()

        def counted(status: str) -> float:
            v = router.metrics.registry.get_sample_value(
                "kvrouter_requests_total", {"policy": "kvrouter", "status": status}
            )
            return v or 0.0

        await until(lambda: counted("499") == 1, 10, "the 499 counted")
        assert counted("500") == 0 and seen == []
        assert not any(x.exc_info for x in caplog.records), caplog.text
        assert "internal error" not in caplog.text
