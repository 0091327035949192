"""``server.upstream_api_key``: every call to a worker carries the router's own key (vLLM's
``--api-key``), and no client's key ever reaches a worker."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from test_router_support import config_for, serve_app, serve_router, until

from router.config import ConfigError, parse_config


def _locked_worker(key: str, seen: list[tuple[str, str | None]]) -> FastAPI:
    """Answers only requests that carry ``Bearer key``, as vLLM with --api-key does."""
    app = FastAPI()

    @app.middleware("http")
    async def check(request: Request, call_next):  # type: ignore[no-untyped-def]
        auth = request.headers.get("authorization")
        seen.append((request.url.path, auth))
        if auth != f"Bearer {key}":
            return JSONResponse({"error": "unauthorized"}, status_code=401)
        return await call_next(request)

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
    async def tokenize() -> JSONResponse:
        return JSONResponse({"tokens": list(range(40)), "count": 40})

    @app.post("/v1/completions")
    async def completions() -> JSONResponse:
        return JSONResponse({"choices": [{"text": "ok"}], "usage": {"prompt_tokens": 40}})

    return app


async def test_workers_get_the_routers_key_never_the_clients(tmp_path: Path) -> None:
    seen: list[tuple[str, str | None]] = []
    key_file = tmp_path / "upstream-key"
    key_file.write_text("worker-secret\n")
    async with serve_app(_locked_worker("worker-secret", seen)) as worker:
        cfg = config_for(
            [worker],
            server={
                "api_keys": ["client-key"],
                "upstream_api_key_file": str(key_file),
                "forward_authorization": True,
            },
        )
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            await until(lambda: router.registry.workers[worker].models, 10, "models read")
            r = await c.post(
                base + "/v1/completions",
                json={"model": "sim-model", "prompt": "hello", "max_tokens": 1},
                headers={"authorization": "Bearer client-key"},
            )
            assert r.status_code == 200, r.text
    paths = {p for p, _ in seen}
    assert {"/health", "/v1/models", "/tokenize", "/v1/completions"} <= paths
    assert all(auth == "Bearer worker-secret" for _, auth in seen), seen


def test_one_key_source_only(tmp_path: Path) -> None:
    f = tmp_path / "k"
    f.write_text("x")
    with pytest.raises(ConfigError, match="upstream_api_key"):
        parse_config({"server": {"upstream_api_key": "a", "upstream_api_key_file": str(f)}}, env={})
    with pytest.raises(ConfigError, match="cannot read"):
        parse_config({"server": {"upstream_api_key_file": str(tmp_path / "missing")}}, env={})
    cfg = parse_config({}, env={"KVROUTER_SERVER_UPSTREAM_API_KEY": "from-env"})
    assert cfg.server.upstream_api_key == "from-env"
