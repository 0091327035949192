"""The kvrouter HTTP layer: OpenAI-compatible endpoints, health, metrics, debug.

``create_apps(config)`` builds a :class:`router.core.Router` and the FastAPI app(s) that serve
it, and runs the router in the app's lifespan. The proxied routes are served by a pure-ASGI
front (:class:`_ProxyRoutes`) with the handlers of router/handlers.py (body, API key, admission,
route, forward); errors map to OpenAI-style answers here. With
``server.admin_port`` set, ``create_apps`` returns a second app for ``/metrics``,
``/debug/*`` and ``/reset_prefix_cache``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import HTMLResponse, JSONResponse, Response

from router import debug, passthrough, status_page
from router.bodies import parse_json_object, read_body, validate_request
from router.cache_reset import reset_prefix_caches
from router.client_auth import bearer
from router.config import Config
from router.core import Router
from router.errors import BodyError
from router.handlers import (
    ProxyHandler,
    check_request_key,
    internal_error,
    passthrough_handler,
    proxy_handler,
    routed,
)
from router.messages import error_response
from router.sessions import session_key

__all__ = ["create_apps"]

log = logging.getLogger("kvrouter")


def _bearer(request: Request) -> str | None:
    return bearer(request.headers.get("authorization"))


# -------------------------------------------------------------------- the apps


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        etype = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), etype)

    @app.exception_handler(BodyError)
    async def _body_error(_: Request, exc: BodyError) -> Response:
        return exc.response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> Response:
        return internal_error(exc)


def _add_admin_routes(app: FastAPI, router: Router) -> None:
    sc = router.cfg.server
    token = sc.admin_token
    # Safe default: on the API port, without an admin token, the API keys (if any) guard the
    # admin endpoints too (/debug/route reveals which prefixes are cached).
    keys = set(sc.api_keys) if token is None and sc.admin_port is None else set()

    def check(request: Request) -> None:
        if token is not None and _bearer(request) != token:
            raise BodyError(401, "admin endpoints require 'Authorization: Bearer <admin_token>'")
        if keys and _bearer(request) not in keys:
            raise BodyError(401, "admin endpoints require an API key (no admin_token is set)")

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        check(request)
        return Response(router.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/debug/index")
    async def debug_index(request: Request) -> Response:
        check(request)
        return JSONResponse(debug.debug_index(router))

    @app.get("/debug")
    async def debug_page(request: Request) -> Response:
        check(request)
        return HTMLResponse(status_page.PAGE, headers={"cache-control": "no-store"})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        """vLLM's endpoint on every worker at once, the index forgetting each confirmed one
        (router/cache_reset.py)."""
        check(request)
        return JSONResponse(await reset_prefix_caches(router, request.query_params))

    @app.post("/debug/route")
    async def debug_route(request: Request) -> Response:
        """Explain a routing decision without sending anything: the body of a completion or
        chat request, or with ``?path=`` (e.g. ``/v1/responses``) of another vLLM API."""
        check(request)
        data = await read_body(request, router.cfg.server.max_body_bytes)
        path = request.query_params.get("path")
        t = time.perf_counter()
        if path is not None and path in passthrough.PATHS:
            res, _body, how = await routed(router, request, path, data)
            out = debug.explain(router, res, True, time.perf_counter() - t)
            return JSONResponse({**out, "path": path, "routing": how})
        body = parse_json_object(data)
        chat = "messages" in body
        validate_request(body, chat)
        sc = router.cfg.session
        session = session_key(request.headers, body, sc.header, sc.user_field)
        res = await router.route(body, chat, time.monotonic(), session=session, dry_run=True)
        elapsed = time.perf_counter() - t
        out = debug.explain(router, res, chat, elapsed, body)
        return JSONResponse({**out, "routing": "by cache: the prompt's prefix"})


def _add_api_routes(app: FastAPI, router: Router) -> dict[str, ProxyHandler]:
    cfg = router.cfg
    keys = set(cfg.server.api_keys)
    handle = proxy_handler(router)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, "/v1/completions", False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, "/v1/chat/completions", True)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        """Every model and adapter the fleet serves (each worker's /v1/models, merged)."""
        # A listing costs nothing of the key's limit.
        await check_request_key(request, keys, router.quotas, charge=False)
        return JSONResponse({"object": "list", "data": router.registry.fleet_models()})

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        ok, why = router.ready()
        return JSONResponse({"ready": ok, "reason": why}, status_code=200 if ok else 503)

    other = passthrough_handler(router)

    # A stored Responses API answer lives on the engine that produced it: these go there
    # (router/stored_responses.py). Rare enough for FastAPI's routing.
    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(request: Request, response_id: str) -> Response:
        return await other(request, f"/v1/responses/{response_id}")

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str) -> Response:
        return await other(request, f"/v1/responses/{response_id}/cancel")

    def forwarder(path: str) -> ProxyHandler:
        async def forward(request: Request) -> Response:
            return await other(request, path)

        return forward

    routes: dict[str, ProxyHandler] = {p: forwarder(p) for p in passthrough.PATHS}
    routes.update({"/v1/completions": completions, "/v1/chat/completions": chat_completions})
    return routes


class _ProxyRoutes:
    """Pure-ASGI front for the proxied POST routes (the two completion APIs and the rest of
    vLLM's API, router/passthrough.py); everything else goes through FastAPI.

    Why: each proxied request otherwise passes FastAPI's exception, exit-stack, routing,
    dependency and endpoint layers, which cost about as much as a raw ASGI answer again
    (docs/benchmarks.md) on a path whose whole budget is a few milliseconds. The handlers answer
    every error themselves (OpenAI-style JSON); this front turns anything unexpected into the
    same 500 the app's error handler gives. It sits inside FastAPI's ServerErrorMiddleware and
    inside CORS (added after it), so those still apply.
    """

    def __init__(self, app: Any, routes: dict[str, ProxyHandler]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            handler = self.routes.get(scope["path"])
            if handler is not None:
                try:
                    response = await handler(Request(scope, receive, send))
                except BodyError as exc:
                    response = exc.response()
                except Exception as exc:
                    response = internal_error(exc)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_apps(cfg: Config, *, seed: int | None = None) -> tuple[FastAPI, FastAPI | None, Router]:
    """The API app, the admin app (None unless ``server.admin_port``), and their Router."""
    router = Router(cfg, seed=seed)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.start()
        from router.epp import serve_epp  # imported here: grpcio is the optional extra "epp"

        epp = await serve_epp(router) if cfg.server.epp_port is not None else None
        try:
            yield
        finally:
            if epp is not None:
                await epp.stop()
            await router.stop()

    app = FastAPI(title="kvrouter", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.router = router
    _install_error_handlers(app)
    proxy_routes = _add_api_routes(app, router)
    app.add_middleware(_ProxyRoutes, routes=proxy_routes)
    admin: FastAPI | None = None
    if cfg.server.admin_port is not None:
        admin = FastAPI(title="kvrouter-admin", docs_url=None, redoc_url=None, openapi_url=None)
        admin.state.router = router
        _install_error_handlers(admin)
        _add_admin_routes(admin, router)
    else:
        _add_admin_routes(app, router)
    if cfg.server.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=cfg.server.cors_origins,
            allow_methods=["*"],
            allow_headers=["*"],
        )
    return app, admin, router
