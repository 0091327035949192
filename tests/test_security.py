"""Security defaults: admin port + token, API keys, Authorization forwarding, CORS
off by default, prompts and token ids never in the logs at the default level."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from test_router_support import FAST, config_for, serve_app, serve_router, until

from router.app import create_apps
from router.config import Config
from simulator.testing import running_fleet

pytestmark = pytest.mark.timeout(120)


def test_defaults_are_safe() -> None:
    s = Config().server
    assert s.api_keys == [] and s.cors_origins == [] and s.forward_authorization is False
    assert s.admin_token is None and s.admin_port is None  # documented: set both in production
    assert s.max_body_bytes == 10_485_760 and s.max_header_bytes == 32_768


async def test_admin_port_and_token() -> None:
    with running_fleet(1, num_gpu_blocks=128, **FAST) as ws:
        cfg = config_for(ws, server={"admin_port": 1, "admin_token": "adm1n"})
        app, admin, _router = create_apps(cfg, seed=0)
        assert admin is not None
        async with (
            serve_app(app) as base,
            serve_app(admin) as adm,
            httpx.AsyncClient(timeout=30) as c,
        ):
            for path in ("/metrics", "/debug/index"):
                assert (await c.get(base + path)).status_code == 404  # not on the API port
                assert (await c.get(adm + path)).status_code == 401
                r = await c.get(adm + path, headers={"authorization": "Bearer wrong"})
                assert r.status_code == 401
                r = await c.get(adm + path, headers={"authorization": "Bearer adm1n"})
                assert r.status_code == 200
            r = await c.post(adm + "/debug/route", json={"prompt": "x"})
            assert r.status_code == 401
            assert (await c.get(adm + "/openapi.json")).status_code == 404


async def test_api_keys_guard_api_and_admin_on_the_same_port() -> None:
    with running_fleet(1, num_gpu_blocks=128, **FAST) as ws:
        cfg = config_for(ws, server={"api_keys": ["k1", "k2"]})
        async with serve_router(cfg) as (base, _r), httpx.AsyncClient(timeout=30) as c:
            body = {"model": "sim-model", "prompt": "hello", "max_tokens": 1}
            url = base + "/v1/completions"
            assert (await c.post(url, json=body)).status_code == 401
            bad = {"authorization": "Bearer nope"}
            assert (await c.post(url, json=body, headers=bad)).status_code == 401
            ok = {"authorization": "Bearer k2"}
            assert (await c.post(url, json=body, headers=ok)).status_code == 200
            assert (await c.get(base + "/v1/models")).status_code == 401
            # no admin_token: the API keys guard /debug/* and /metrics too
            assert (await c.get(base + "/debug/index")).status_code == 401
            assert (await c.get(base + "/metrics")).status_code == 401
            assert (await c.get(base + "/metrics", headers=ok)).status_code == 200
            assert (await c.get(base + "/health")).status_code == 200  # probes stay open


def _recording_worker(seen: list[dict[str, str]]) -> FastAPI:
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
        seen.append({"path": "/tokenize", **dict(request.headers)})
        return JSONResponse({"tokens": list(range(20)), "count": 20})

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        seen.append({"path": "/v1/completions", **dict(request.headers)})
        return JSONResponse({"choices": [], "usage": {}})

    return app


@pytest.mark.parametrize("forward", [False, True])
async def test_authorization_forwarded_only_when_configured(forward: bool) -> None:
    seen: list[dict[str, str]] = []
    async with serve_app(_recording_worker(seen)) as stub:
        cfg = config_for([stub], server={"forward_authorization": forward})
        async with serve_router(cfg) as (base, _r), httpx.AsyncClient(timeout=30) as c:
            r = await c.post(
                base + "/v1/completions",
                json={"prompt": "x"},
                headers={"authorization": "Bearer client-secret", "proxy-authorization": "p"},
            )
            assert r.status_code == 200
    fwd = [h for h in seen if h["path"] == "/v1/completions"]
    assert fwd and all("proxy-authorization" not in h for h in seen)
    assert all(("authorization" in h) == forward for h in fwd)
    assert all("authorization" not in h for h in seen if h["path"] == "/tokenize")


async def test_cors_off_by_default_and_on_when_configured() -> None:
    with running_fleet(1, num_gpu_blocks=128, **FAST) as ws:
        pre = {"origin": "https://evil.example", "access-control-request-method": "POST"}
        async with serve_router(config_for(ws)) as (base, _r), httpx.AsyncClient() as c:
            r = await c.options(base + "/v1/completions", headers=pre)
            assert "access-control-allow-origin" not in r.headers
            r = await c.get(base + "/health", headers={"origin": "https://evil.example"})
            assert "access-control-allow-origin" not in r.headers
        cfg = config_for(ws, server={"cors_origins": ["https://app.example"]})
        async with serve_router(cfg) as (base, _r), httpx.AsyncClient() as c:
            r = await c.options(
                base + "/v1/completions", headers={**pre, "origin": "https://app.example"}
            )
            assert r.headers.get("access-control-allow-origin") == "https://app.example"
            r = await c.options(base + "/v1/completions", headers=pre)
            assert "access-control-allow-origin" not in r.headers
            # The proxy routes' own ASGI front sits inside CORS: real answers carry it too.
            body = {"model": "sim-model", "prompt": "hello", "max_tokens": 1}
            r = await c.post(
                base + "/v1/completions", json=body, headers={"origin": "https://app.example"}
            )
            assert r.status_code == 200
            assert r.headers.get("access-control-allow-origin") == "https://app.example"
            assert r.headers["x-kvrouter-worker"] == ws[0].url
            assert (await c.get(base + "/v1/completions")).status_code == 405


SECRET = "zq-SECRET-PROMPT-7f3a9"
SECRET_IDS = [31337, 27182, 16180, 14142, 17320]


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)  # the default log level (server.log_level: info)
        self.text: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.text.append(self.format(record))
        if record.exc_info:
            self.text.append(logging.Formatter().formatException(record.exc_info))


async def test_prompts_and_token_ids_never_logged() -> None:
    cap = _Capture()
    root = logging.getLogger()
    old = root.level
    root.setLevel(logging.INFO)
    root.addHandler(cap)
    try:
        with running_fleet(2, num_gpu_blocks=128, **FAST) as ws:
            cfg = config_for(ws, server={"max_body_bytes": 4096, "first_byte_timeout_s": 1.0})
            async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
                await until(lambda: all(w.subscribed for w in router.registry.workers.values()), 20)
                url = base + "/v1/completions"
                bodies: list[Any] = [
                    {"model": "sim-model", "prompt": f"{SECRET} tell me", "max_tokens": 2},
                    {"model": "sim-model", "prompt": SECRET_IDS * 4, "max_tokens": 2},
                    {"model": "sim-model", "prompt": SECRET, "max_tokens": 2, "stream": True},
                    {"model": "nope", "prompt": SECRET},  # the worker's 404
                    {"model": "sim-model", "prompt": SECRET, "max_tokens": -1},  # worker 400
                    {"model": "sim-model", "prompt": SECRET * 400},  # 413
                ]
                for b in bodies:
                    await c.post(url, json=b)
                chat = {"model": "sim-model", "messages": [{"role": "user", "content": SECRET}]}
                await c.post(base + "/v1/chat/completions", json=chat)
                bad_chat = {"messages": [{"role": "user", "content": {"x": SECRET}}]}
                await c.post(base + "/v1/chat/completions", json=bad_chat)  # tokenize 400
                await c.post(url, content=f'{{"prompt": "{SECRET}'.encode())  # bad JSON
                await c.post(base + "/debug/route", json={"prompt": SECRET})
                # a worker that dies mid-request logs too: its error must not carry the prompt
                await c.post(ws[1].url + "/sim/faults", json={"stall_http": True})
                for _ in range(4):
                    await c.post(url, json={"model": "sim-model", "prompt": SECRET})
                await c.post(ws[1].url + "/sim/faults", json={"stall_http": False})
    finally:
        root.removeHandler(cap)
        root.setLevel(old)
    logs = "\n".join(cap.text)
    assert cap.text  # something was logged (so the check means something)
    assert SECRET not in logs
    assert "31337" not in logs and "27182, 16180" not in logs
