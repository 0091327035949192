"""The proxied routes' handlers: parse, admit, route, forward, and account for the outcome.

``proxy_handler`` serves ``/v1/completions`` and ``/v1/chat/completions`` (routed by the prompt's
cached prefix); ``passthrough_handler`` serves the rest of vLLM's API (router/passthrough.py).
Both hand the routed request to ``router.proxy`` with the hooks that charge load, speculative
entries, verification, metrics, access lines and spans (router/app.py mounts them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from fastapi import Request
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from indexer.index import EngineId
from router import access, passthrough, proxy
from router import stored_responses as stored
from router.bodies import parse_json_object, read_body, validate_request
from router.client_auth import bearer, check_key, spend_prompt
from router.core import Router, RouteResult
from router.errors import BodyError
from router.messages import error_response, request_headers
from router.metrics import model_label
from router.quotas import Limits
from router.sessions import session_key
from router.tracing import RequestTrace, Tracer
from router.verify import with_stream_usage

__all__ = [
    "ProxyHandler",
    "check_request_key",
    "internal_error",
    "passthrough_handler",
    "proxy_handler",
    "routed",
]

log = logging.getLogger("kvrouter")

_upstream_enc = msgspec.json.Encoder()


def internal_error(exc: Exception) -> Response:
    log.exception("internal error")
    return error_response(500, f"internal error: {type(exc).__name__}", "internal_error")


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


def _arrived(request: Request, path: str, tracer: Tracer | None) -> tuple[_Request, bool]:
    """A request's record from its arrival: its id (the client's ``x-request-id`` kept, else a
    new one; True when the client sent it) and, with tracing on, its server span."""
    t0 = time.perf_counter()
    rid, from_client = access.request_id(request.scope["headers"])
    req = _Request(rid, path, None, t0)
    if tracer is not None:
        req.trace = tracer.start(request.scope["headers"], path, rid)
    return req, from_client


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
        elif o.cached_tokens is not None and tok is not None and res.verifiable:
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
        router.record_sent(engine, res, time.monotonic())
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


def proxy_handler(router: Router) -> Callable[[Request, str, bool], Awaitable[Response]]:
    """The handler of the two proxy routes: parse, route, forward."""
    cfg = router.cfg
    keys = set(cfg.server.api_keys)
    m = router.metrics
    policy_name = router.policy.name
    forward_ids = cfg.tokenizer.forward_ids
    tracer = router.tracer

    async def handle(request: Request, path: str, chat: bool) -> Response:
        req, from_client = _arrived(request, path, tracer)
        try:
            response = await route_and_forward(request, req, chat, from_client)
        except Exception as exc:
            _refused(req, 500, type(exc).__name__)
            response = internal_error(exc)
        response.raw_headers.append((access.HEADER, req.id.encode()))
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
        sent = body  # encoded again once, if the ids or the priority change it
        if forward_ids and tok is not None and not chat:
            ids = router.tokenizer.upstream_ids(body, tok)
            if ids is not None and router.ids_portable():
                body = {**body, "prompt": ids}
        if attempts:
            prioritized = router.prioritized(
                body, [a.engine for a in attempts], attempts[0].uncached
            )
            if prioritized is not None:
                body = prioritized
        if body is not sent:
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
            sequences=res.sequences,
        )

    return handle


async def _parse_and_route(
    router: Router, request: Request, req: _Request, chat: bool, keys: set[str]
) -> tuple[str | None, bytes, dict[str, Any], RouteResult]:
    """Key, body and route of a proxied request: (key, raw body, parsed body, route).
    BodyError for the answers the router gives itself (401, 400, 413, 404, 429, 503)."""
    cfg = router.cfg
    key = await check_request_key(request, keys, router.quotas)
    data = await read_body(request, cfg.server.max_body_bytes)
    body = parse_json_object(data)
    req.model = body.get("model")
    validate_request(body, chat)
    sc = cfg.session
    session = session_key(request.headers, body, sc.header, sc.user_field)
    res = await router.route_admitted(
        body, chat, request.receive, key, len(data), session=session, trace=req.trace
    )
    await _spend_prompt(router, key, res)
    return key, data, body, res


async def routed(
    router: Router, request: Request, path: str, data: bytes, trace: RequestTrace | None = None
) -> tuple[RouteResult, dict[str, Any] | None, str]:
    """Route a request of the rest of vLLM's API (router/passthrough.py): by the prompt it
    carries as chat messages, else by load. Returns the result, the JSON body (None for a
    multipart upload) and how it was routed."""
    body = passthrough.parse(data, request.headers.get("content-type", ""))
    prompt, traits = await router.read_prompt(path, body)
    routed = passthrough.routing_body(body, prompt, traits)
    sc = router.cfg.session
    session = session_key(request.headers, body or {}, sc.header, sc.user_field)
    dry = request.url.path == "/debug/route"
    now = time.monotonic()
    rid = stored.named_id(path, body)
    owner = await router.response_holder(rid, now) if rid is not None else None
    res = await router.route(
        routed,
        True,
        now,
        session=session,
        tokenize=prompt is not None,
        dry_run=dry,
        trace=trace,
        owner=owner,
    )
    how = passthrough.describe(path, prompt)
    if owner is not None:
        how += f"; to {owner[0]}, which holds the previous response"
    return res, body, how


def _noting_owner(
    router: Router, done: Callable[[proxy.Outcome], None]
) -> Callable[[proxy.Outcome], None]:
    """``done``, and the engine that answered a ``/v1/responses`` request noted as the holder
    of the response's id (router/stored_responses.py)."""

    def noted(o: proxy.Outcome) -> None:
        done(o)
        if o.status == 200 and o.response_id is not None and o.engine is not None:
            router.note_response_holder(o.response_id, o.engine, time.monotonic())

    return noted


def passthrough_handler(router: Router) -> Callable[[Request, str], Awaitable[Response]]:
    """The handler of every other vLLM API path: route, then forward the body untouched."""
    cfg = router.cfg
    keys = set(cfg.server.api_keys)
    m = router.metrics
    policy_name = router.policy.name
    tracer = router.tracer

    async def handle(request: Request, path: str) -> Response:
        req, from_client = _arrived(request, path, tracer)
        held = stored.stored_path(path)  # GET /v1/responses/{id}, POST .../{id}/cancel
        try:
            # A GET (a stored response polled) is checked but not charged, as the EPP does.
            charge = request.method != "GET"
            req.key = await check_request_key(request, keys, router.quotas, charge=charge)
            data = await read_body(request, cfg.server.max_body_bytes)
            res, body, _how = await routed(router, request, path, data, req.trace)
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
        decided = time.perf_counter() - req.t0
        headers = request_headers(request.scope["headers"], cfg.server.forward_authorization)
        if not from_client:
            headers.append((access.HEADER, req.id.encode()))
        done = _on_done(router, res, req)
        stream = bool(body is not None and body.get("stream") is True)
        capture = path == stored.RESPONSES
        if capture:
            done = _noting_owner(router, done)
        elif held is not None:
            stream = request.query_params.get("stream") == "true"
            path = f"{path}?{request.url.query}" if request.url.query else path
        response = await proxy.forward(
            registry=router.registry,
            path=path,
            body=data,
            headers=headers if req.trace is None else req.trace.upstream(headers),
            attempts=_attempts(res),
            stream=stream,
            receive=request.receive,
            t0=req.t0,
            done=done,
            limits=router.proxy_limits,
            on_failed=_on_failed(router, res, req.trace),
            on_sent=_on_sent(router, res, decided, req.id),
            method=request.method,
            capture_id=capture,
        )
        response.raw_headers.append((access.HEADER, req.id.encode()))
        return response

    return handle


async def check_request_key(
    request: Request, keys: set[str], quotas: Limits | None = None, *, charge: bool = True
) -> str | None:
    """The request's API key, checked (router/client_auth.py: BodyError 401 / 429)."""
    return await check_key(
        bearer(request.headers.get("authorization")), keys, quotas, charge=charge
    )


async def _spend_prompt(router: Router, key: str | None, res: RouteResult) -> None:
    await spend_prompt(router.quotas, key, res.tokens.n_tokens if res.tokens else None)
