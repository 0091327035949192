"""The kvrouter HTTP layer: OpenAI-compatible endpoints, health, metrics, debug.

``create_apps(config)`` builds a :class:`router.core.Router` and the FastAPI app(s) that serve
it, and runs the router in the app's lifespan. The two proxy routes are served by a pure-ASGI
front (:class:`_ProxyRoutes`); everything here parses and checks the request (body, API key),
maps errors to OpenAI-style answers, and hands the routed request to ``router.proxy``. With
``server.admin_port`` set, ``create_apps`` returns a second app for ``/metrics`` and
``/debug/*``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import HTMLResponse, JSONResponse, Response

from indexer.index import EngineId
from router import access, debug, passthrough, proxy, status_page
from router.client_auth import bearer, check_key, spend_prompt
from router.config import Config
from router.core import Router, RouteResult
from router.errors import BodyError
from router.messages import error_response, request_headers
from router.metrics import model_label
from router.quotas import Limits
from router.sessions import session_key
from router.tracing import RequestTrace
from router.verify import with_stream_usage

__all__ = ["create_apps"]

log = logging.getLogger("kvrouter")

_dec = msgspec.json.Decoder()


def _internal_error(exc: Exception) -> Response:
    log.exception("internal error")
    return error_response(500, f"internal error: {type(exc).__name__}", "internal_error")


# -------------------------------------------------------------------- request body handling


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, at most ``limit`` bytes (413 past it, by Content-Length or as counted).

    Reads the ASGI messages directly rather than through ``Request.headers``/``stream()``: that
    machinery costs a measurable share of the proxy path's budget, where the body usually
    arrives in one message (docs/benchmarks.md)."""
    cl = next((v for k, v in request.scope["headers"] if k == b"content-length"), None)
    if cl is not None:
        try:
            n = int(cl)
        except ValueError:
            raise BodyError(400, "invalid Content-Length header") from None
        if n > limit:
            raise BodyError(413, f"request body of {n} bytes exceeds the limit of {limit} bytes")
    receive = request.receive
    parts = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # http.disconnect: nothing more will come
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyError(413, f"request body exceeds the limit of {limit} bytes")
        if not message.get("more_body", False):
            if not parts:
                return chunk
            parts.append(chunk)
            return b"".join(parts)
        parts.append(chunk)


_upstream_enc = msgspec.json.Encoder()


def parse_json_object(data: bytes) -> dict[str, Any]:
    if not data:
        raise BodyError(400, "request body is empty; expected a JSON object")
    try:
        body = _dec.decode(data)
    except msgspec.DecodeError as exc:
        raise BodyError(400, f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise BodyError(400, "request body must be a JSON object")
    return body


def validate_request(body: dict[str, Any], chat: bool) -> None:
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BodyError(400, "'messages' must be a non-empty list")
    elif "prompt" not in body:
        raise BodyError(400, "'prompt' is required")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BodyError(400, "'stream' must be a boolean")
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise BodyError(400, "'cache_salt' must be a string")


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
        return _internal_error(exc)


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

    @app.post("/debug/route")
    async def debug_route(request: Request) -> Response:
        """Explain a routing decision without sending anything: the body of a completion or
        chat request, or with ``?path=`` (e.g. ``/v1/responses``) of another vLLM API."""
        check(request)
        data = await read_body(request, router.cfg.server.max_body_bytes)
        path = request.query_params.get("path")
        t = time.perf_counter()
        if path is not None and path in passthrough.PATHS:
            res, _body, how = await _routed(router, request, path, data)
            out = debug.explain(router, res, True, time.perf_counter() - t)
            return JSONResponse({**out, "path": path, "routing": how})
        body = parse_json_object(data)
        chat = "messages" in body
        validate_request(body, chat)
        res = await router.route(body, chat, time.monotonic(), dry_run=True)
        elapsed = time.perf_counter() - t
        out = debug.explain(router, res, chat, elapsed)
        return JSONResponse({**out, "routing": "by cache: the prompt's prefix"})


ProxyHandler = Callable[[Request], Awaitable[Response]]


def _attempts(res: RouteResult) -> list[proxy.Attempt]:
    """The best two engines and the uncached prompt tokens each is charged while prefilling."""
    d = res.decision
    n = res.tokens.n_tokens if res.tokens else 0
    costs = {c.engine: c for c in d.costs}
    by_engine = {c.engine: c for c in res.candidates}
    attempts = []
    for e in d.ranked[:2]:
        wc = costs.get(e)
        if wc is not None:
            unc = wc.uncached_tokens
        else:
            c = by_engine[e]
            unc = max(n - c.gpu_hit_tokens, 0)
        attempts.append(proxy.Attempt(e, unc))
    return attempts


class _Request(msgspec.Struct):
    """What the access line of a proxied request names besides its outcome."""

    id: str
    path: str
    model: Any
    t0: float
    key: str | None = None
    """The request's API key (its per-key token limit is charged the completion)."""
    trace: RequestTrace | None = None
    """Its spans (router/tracing.py); None: tracing off."""


def _on_done(router: Router, res: RouteResult, req: _Request) -> Callable[[proxy.Outcome], None]:
    """Accounts a finished request: metrics, the access line, the API key's completion tokens
    and, with verification, the prediction's check."""
    m = router.metrics
    policy_name = router.policy.name
    tok = res.tokens
    predicted = res.decision.predicted_hit_tokens
    models = router.registry.models

    def done(o: proxy.Outcome) -> None:
        duration = time.perf_counter() - req.t0
        m.requests.labels(policy_name, str(o.status)).inc()
        m.request_duration.observe(duration)
        if o.ttft_s is not None:
            m.ttft.observe(o.ttft_s)
        if router.verifier is not None:
            router.verify_outcome(res, o)
        elif o.cached_tokens is not None and tok is not None:
            m.prediction_error.observe(abs(predicted - o.cached_tokens))
        if o.status == 200:
            label = model_label(models, req.model)
            prompt = o.prompt_tokens if o.prompt_tokens is not None else tok and tok.n_tokens
            if prompt:
                m.model_prompt_tokens.labels(label).inc(prompt)
            if o.completion_tokens:
                m.model_completion_tokens.labels(label).inc(o.completion_tokens)
        if access.enabled():
            access.log_request(
                {
                    "request_id": req.id,
                    "path": req.path,
                    "model": req.model if isinstance(req.model, str) else None,
                    "status": o.status,
                    "duration_s": round(duration, 6),
                    "ttft_s": None if o.ttft_s is None else round(o.ttft_s, 6),
                    "worker": o.worker,
                    "dp_rank": o.engine[1] if o.engine is not None else None,
                    "predicted_hit_tokens": predicted,
                    "prompt_tokens": tok.n_tokens if tok is not None else None,
                    "cached_tokens": o.cached_tokens,
                    "completion_tokens": o.completion_tokens,
                }
            )
        if o.completion_tokens:
            router.quotas.charge_completion(req.key, o.completion_tokens)
        if req.trace is not None:
            req.trace.finish(o)

    return done


def _refused(req: _Request, status: int, error: str) -> None:
    """The access line of a request answered before it was routed."""
    if req.trace is not None:
        req.trace.refused(status, error)
    if access.enabled():
        access.log_request(
            {
                "request_id": req.id,
                "path": req.path,
                "status": status,
                "duration_s": round(time.perf_counter() - req.t0, 6),
                "error": error,
            }
        )


def _on_sent(
    router: Router, res: RouteResult, decided: float, rid: str
) -> Callable[[EngineId], None]:
    """Runs as the request goes out: the speculative entry, and the decision's metrics once."""
    m = router.metrics
    tok = res.tokens
    d = res.decision
    record = router.recorder.record
    recorded = False

    def sent(engine: EngineId) -> None:
        """Runs as the request goes out (see proxy.forward), before any other request can be
        routed, so that a sibling prompt arriving next finds the speculative entry; while
        the worker already computes, when a kept-alive connection was idle."""
        nonlocal recorded
        if tok is not None:
            router.speculative.record(engine, tok.keys, time.monotonic())
        if recorded:
            return  # a retry: the entry above is for the engine that now has the request
        recorded = True
        m.route_decision.observe(decided)
        if tok is None:
            m.tokenize_failures.inc()
        else:
            m.prompt_tokens.inc(tok.n_tokens)
            m.predicted_hit_tokens.inc(d.predicted_hit_tokens)
        record(rid, engine, d.predicted_hit_tokens, tok.n_tokens if tok else 0, d.reason)

    return sent


_PROBE_AFTER = frozenset({"first_byte_timeout", "protocol", "status_5xx", "mid_response"})
"""Failures that may mean the worker is dead: its health is re-checked at once."""


def _on_failed(
    router: Router, res: RouteResult, trace: RequestTrace | None = None
) -> Callable[[EngineId, str], None]:
    """Runs for every failed attempt (see proxy.forward): counted by reason, its speculative
    entry withdrawn so siblings do not follow it, and the worker re-probed when it may be dead."""
    tok = res.tokens
    failures = router.metrics.upstream_failures

    def failed(engine: EngineId, reason: str) -> None:
        failures.labels(reason).inc()
        if trace is not None:
            trace.attempt_failed(engine, reason)
        if tok is not None:
            router.speculative.withdraw(engine, tok.keys)
        w = router.registry.workers.get(engine[0])
        if w is not None and reason in _PROBE_AFTER:
            router.watch.probe_soon(w)

    return failed


def _proxy_handler(router: Router) -> Callable[[Request, str, bool], Awaitable[Response]]:
    """The handler of the two proxy routes: parse, route, forward."""
    cfg = router.cfg
    keys = set(cfg.server.api_keys)
    m = router.metrics
    policy_name = router.policy.name
    forward_ids = cfg.tokenizer.forward_ids
    tracer = router.tracer

    async def handle(request: Request, path: str, chat: bool) -> Response:
        t0 = time.perf_counter()
        rid, from_client = access.request_id(request.scope["headers"])
        req = _Request(rid, path, None, t0)
        if tracer is not None:
            req.trace = tracer.start(request.scope["headers"], path, rid)
        try:
            response = await route_and_forward(request, req, chat, from_client)
        except Exception as exc:
            _refused(req, 500, type(exc).__name__)
            response = _internal_error(exc)
        response.raw_headers.append((access.HEADER, rid.encode()))
        return response

    async def route_and_forward(
        request: Request, req: _Request, chat: bool, from_client: bool
    ) -> Response:
        try:
            key, data, body, res = await _parse_and_route(router, request, req, chat, keys)
        except BodyError as exc:
            m.requests.labels(policy_name, str(exc.status)).inc()
            _refused(req, exc.status, exc.message)
            return exc.response()
        except ClientDisconnect:  # gone while sending its body or queued: nothing to answer
            m.requests.labels(policy_name, "499").inc()
            log.info("client disconnected before its request was routed (499)")
            _refused(req, 499, "client disconnected")
            return Response(status_code=499)
        decided = time.perf_counter() - req.t0
        tok = res.tokens
        attempts = _attempts(res)
        req.key = key
        done = _on_done(router, res, req)
        if forward_ids and tok is not None and not chat:
            ids = router.tokenizer.upstream_ids(body, tok)
            if ids is not None and router.ids_portable():
                body = {**body, "prompt": ids}
                data = _upstream_enc.encode(body)
        headers = request_headers(request.scope["headers"], cfg.server.forward_authorization)
        if not from_client:  # the client's own id is among the headers already
            headers.append((access.HEADER, req.id.encode()))
        stream = bool(body.get("stream"))
        strip = False
        if stream and router.verifier is not None and cfg.verify.stream_usage:
            data, strip = with_stream_usage(body, data)  # usage for verification, stripped
        return await proxy.forward(
            registry=router.registry,
            path=req.path,
            body=data,
            headers=headers if req.trace is None else req.trace.upstream(headers),
            attempts=attempts,
            stream=stream,
            strip_usage=strip,
            receive=request.receive,
            t0=req.t0,
            done=done,
            limits=router.proxy_limits,
            on_failed=_on_failed(router, res, req.trace),
            on_sent=_on_sent(router, res, decided, req.id),
            on_released=router.admission.wake if router.admission is not None else None,
        )

    return handle


async def _parse_and_route(
    router: Router, request: Request, req: _Request, chat: bool, keys: set[str]
) -> tuple[str | None, bytes, dict[str, Any], RouteResult]:
    """Key, body and route of a proxied request: (key, raw body, parsed body, route).
    BodyError for the answers the router gives itself (401, 400, 413, 404, 429, 503)."""
    cfg = router.cfg
    key = await _check_key(request, keys, router.quotas)
    data = await read_body(request, cfg.server.max_body_bytes)
    body = parse_json_object(data)
    req.model = body.get("model")
    validate_request(body, chat)
    sc = cfg.session
    session = session_key(request.headers, body, sc.header, sc.user_field)
    if router.admission is None:
        res = await router.route(body, chat, time.monotonic(), session=session, trace=req.trace)
    else:
        res = await _route_admitted(router, request, body, chat, session, key, req.trace)
    await _spend_prompt(router, key, res)
    return key, data, body, res


async def _route_admitted(
    router: Router,
    request: Request,
    body: dict[str, Any],
    chat: bool,
    session: str | None,
    key: str | None,
    trace: RequestTrace | None = None,
) -> RouteResult:
    """Route once the admission queue lets the request through (router/admission.py). Its
    pass is given back as the route is chosen: the proxy puts the prompt on the chosen
    engine's load before the queue can look again."""
    assert router.admission is not None
    admitted = await router.admission.admit(
        body.get("model"), body.get("priority"), key, request.receive
    )
    tokens = None
    try:
        res = await router.route(body, chat, time.monotonic(), session=session, trace=trace)
        tokens = res.tokens.n_tokens if res.tokens is not None else None
        return res
    finally:
        admitted.release(tokens)


async def _routed(
    router: Router, request: Request, path: str, data: bytes, trace: RequestTrace | None = None
) -> tuple[RouteResult, dict[str, Any] | None, str]:
    """Route a request of the rest of vLLM's API (router/passthrough.py): by the prompt it
    carries as chat messages, else by load. Returns the result, the JSON body (None for a
    multipart upload) and how it was routed."""
    body = passthrough.parse(data, request.headers.get("content-type", ""))
    msgs = passthrough.chat_messages(path, body) if body is not None else None
    model = body.get("model") if body is not None else None
    routed: dict[str, Any] = {"model": model} if model is not None else {}
    if msgs is not None:
        routed["messages"] = msgs
        for k in ("cache_salt", "chat_template_kwargs"):
            if body is not None and k in body:
                routed[k] = body[k]
    sc = router.cfg.session
    session = session_key(request.headers, body or {}, sc.header, sc.user_field)
    dry = request.url.path == "/debug/route"
    res = await router.route(
        routed,
        True,
        time.monotonic(),
        session=session,
        tokenize=msgs is not None,
        dry_run=dry,
        trace=trace,
    )
    return res, body, passthrough.describe(path, msgs)


def _passthrough_handler(router: Router) -> Callable[[Request, str], Awaitable[Response]]:
    """The handler of every other vLLM API path: route, then forward the body untouched."""
    cfg = router.cfg
    keys = set(cfg.server.api_keys)
    m = router.metrics
    policy_name = router.policy.name
    tracer = router.tracer

    async def handle(request: Request, path: str) -> Response:
        t0 = time.perf_counter()
        rid, from_client = access.request_id(request.scope["headers"])
        req = _Request(rid, path, None, t0)
        if tracer is not None:
            req.trace = tracer.start(request.scope["headers"], path, rid)
        try:
            req.key = await _check_key(request, keys, router.quotas)
            data = await read_body(request, cfg.server.max_body_bytes)
            res, body, _how = await _routed(router, request, path, data, req.trace)
            req.model = body.get("model") if body is not None else None
            await _spend_prompt(router, req.key, res)
        except BodyError as exc:
            m.requests.labels(policy_name, str(exc.status)).inc()
            _refused(req, exc.status, exc.message)
            return exc.response()
        except ClientDisconnect:
            m.requests.labels(policy_name, "499").inc()
            _refused(req, 499, "client disconnected")
            return Response(status_code=499)
        decided = time.perf_counter() - t0
        headers = request_headers(request.scope["headers"], cfg.server.forward_authorization)
        if not from_client:
            headers.append((access.HEADER, rid.encode()))
        response = await proxy.forward(
            registry=router.registry,
            path=path,
            body=data,
            headers=headers if req.trace is None else req.trace.upstream(headers),
            attempts=_attempts(res),
            stream=bool(body is not None and body.get("stream") is True),
            receive=request.receive,
            t0=t0,
            done=_on_done(router, res, req),
            limits=router.proxy_limits,
            on_failed=_on_failed(router, res, req.trace),
            on_sent=_on_sent(router, res, decided, rid),
        )
        response.raw_headers.append((access.HEADER, rid.encode()))
        return response

    return handle


async def _check_key(
    request: Request, keys: set[str], quotas: Limits | None = None, *, charge: bool = True
) -> str | None:
    """The request's API key, checked (router/client_auth.py: BodyError 401 / 429)."""
    return await check_key(_bearer(request), keys, quotas, charge=charge)


async def _spend_prompt(router: Router, key: str | None, res: RouteResult) -> None:
    await spend_prompt(router.quotas, key, res.tokens.n_tokens if res.tokens else None)


def _add_api_routes(app: FastAPI, router: Router) -> dict[str, ProxyHandler]:
    cfg = router.cfg
    keys = set(cfg.server.api_keys)
    handle = _proxy_handler(router)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, "/v1/completions", False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, "/v1/chat/completions", True)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        """Every model and adapter the fleet serves (each worker's /v1/models, merged)."""
        await _check_key(request, keys, router.quotas, charge=False)  # a listing costs nothing
        return JSONResponse({"object": "list", "data": router.registry.fleet_models()})

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        ok, why = router.ready()
        return JSONResponse({"ready": ok, "reason": why}, status_code=200 if ok else 503)

    other = _passthrough_handler(router)

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
                    response = _internal_error(exc)
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
