"""What the Endpoint Picker needs from the routing core, in one place.

The EPP (router/epp.py) speaks Envoy's ext_proc protocol; everything it asks of kvrouter goes
through :class:`Picker`: choose engines for a request body (the same ``Router.route`` the HTTP
proxy calls), name them as ``ip:port`` endpoints, and account for the request on the engine
that served it (load tickets, speculative entries, prediction verification, metrics), as the
proxy does for the requests it forwards itself.

Endpoints: a worker ``http://IP:PORT`` is the endpoint ``IP:PORT``; every DP rank of a worker
with ``dp_size > 1`` shares its endpoint, and the rank travels in ``x-data-parallel-rank``.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import msgspec

from indexer.index import EngineId
from router.bodies import parse_json_object, validate_request
from router.client_auth import bearer, check_key, spend_prompt
from router.core import Router, RouteResult
from router.errors import BodyError
from router.proxy import Outcome, Ticket
from router.sessions import session_key
from router.verify import with_stream_usage
from router.workers import serving_engines

__all__ = ["Pick", "Picker", "RequestState", "endpoint_of"]

Engine = EngineId
_enc = msgspec.json.Encoder()


@functools.lru_cache(maxsize=4096)
def endpoint_of(url: str) -> str:
    """``http://10.0.0.7:8000`` -> ``10.0.0.7:8000`` (IPv6 hosts keep their brackets). Cached:
    each request asks it of every ranked engine, and ``urlsplit`` is not free."""
    parts = urlsplit(url)
    return parts.netloc.rsplit("@", 1)[-1]


@dataclass
class Pick:
    """The engines chosen for one request, best first, restricted to the eligible ones."""

    engines: list[Engine]
    endpoints: list[str]
    """Distinct endpoints of ``engines``, in order (what the gateway is told)."""
    result: RouteResult | None
    uncached: dict[Engine, int]
    buffered: bool = False
    """The answer comes whole (``stream`` not true): its first byte is its last, so the
    worker's first-token count releases its prefill (``Worker.observe_first_tokens``)."""


@dataclass
class RequestState:
    """One request's accounting from the pick to the end of its response."""

    pick: Pick
    t0: float
    decided_s: float
    engine: Engine | None = None
    ticket: Ticket | None = None
    ttft_s: float | None = None
    status: int | None = None
    cached: int | None = None
    prompt: int | None = None
    completion: int | None = None
    """``usage.completion_tokens`` from a response body that came through the EPP."""
    key: str | None = None
    """The client's API key: its per-key token limit is charged the completion."""
    finished: bool = False
    charged: list[Engine] = field(default_factory=list)


class Picker:
    """The routing core seen from the EPP (see the module docstring)."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.cfg = router.cfg
        self.metrics = router.metrics
        self.policy_name = router.policy.name
        self.keys = set(router.cfg.server.api_keys)

    # ---------------------------------------------------------------- endpoints

    def endpoint_workers(self) -> dict[str, Any]:
        return {endpoint_of(url): w for url, w in self.router.registry.workers.items()}

    def engine_of(self, endpoint: str, pick: Pick) -> Engine | None:
        """The engine behind ``endpoint``: the picked rank of that worker, else its rank 0."""
        for e in pick.engines:
            if endpoint_of(e[0]) == endpoint:
                return e
        w = self.endpoint_workers().get(endpoint)
        return (w.url, 0) if w is not None else None

    def parse(self, data: bytes, chat: bool) -> dict[str, Any]:
        """The request body as the proxy accepts it (BodyError 400 otherwise)."""
        body = parse_json_object(data)
        validate_request(body, chat)
        return body

    def upstream_body(
        self, body: dict[str, Any], data: bytes, pick: Pick, *, usage: bool = True
    ) -> tuple[bytes, bool]:
        """The body to send on, as the proxy sends it: with the prefill's ``priority`` for the
        picked engines (``Router.prioritized``) and, with ``usage`` (the response passes through
        the EPP), a streaming request asking for the final usage event (stripped again from the
        response, True) when verification wants it. ``data`` itself when nothing changes."""
        if pick.engines:
            first = pick.engines[0]
            prioritized = self.router.prioritized(body, pick.engines, pick.uncached[first])
            if prioritized is not None:
                body, data = prioritized, _enc.encode(prioritized)
        if not usage or body.get("stream") is not True or self.router.verifier is None:
            return data, False
        if not self.cfg.verify.stream_usage:
            return data, False
        return with_stream_usage(body, data)

    async def admit(self, authorization: str | None, charge: bool) -> str | None:
        """The client's API key from its ``authorization`` header, checked and (with
        ``charge``) one request spent of its limit, as the proxy does (BodyError 401 / 429)."""
        return await check_key(bearer(authorization), self.keys, self.router.quotas, charge=charge)

    async def spend_prompt(self, key: str | None, pick: Pick) -> None:
        """The picked request's prompt tokens spent of ``key``'s token limit (BodyError 429)."""
        res = pick.result
        if res is not None and res.tokens is not None:
            await spend_prompt(self.router.quotas, key, res.tokens.n_tokens)

    def ready(self) -> tuple[bool, str]:
        return self.router.ready()

    # ---------------------------------------------------------------- choosing

    def _eligible(self, subset: list[str] | None) -> dict[str, Any]:
        """Routable workers by URL (every worker while none is, as the proxy routes:
        one missed probe under load marks a worker unhealthy, and refusing everything then
        would turn a slow health check into an outage), within the gateway's subset hint when
        it sent one. An entry ``ip:port`` names that endpoint; a bare ``ip`` names every port
        of that host."""
        reg = self.router.registry
        healthy = {w.url: w for w in reg.routable() or reg.workers.values()}
        if subset is None:
            return healthy
        allowed = set(subset)
        out = {}
        for url, w in healthy.items():
            ep = endpoint_of(url)
            host = ep.rsplit(":", 1)[0].strip("[]")
            if ep in allowed or host in allowed:
                out[url] = w
        return out

    def _shedding(self, eligible: dict[str, Any]) -> bool:
        """Every eligible worker already has ``server.max_connections_per_worker`` requests
        of this router in flight: the request would only queue (the gateway answers 429)."""
        cap = self.cfg.server.max_connections_per_worker
        return all(w.inflight >= cap for w in eligible.values())

    async def pick(
        self,
        body: dict[str, Any],
        chat: bool,
        subset: list[str] | None,
        headers: Mapping[str, str] | None = None,
        key: str | None = None,
        *,
        tokenize: bool = True,
        owner: Engine | None = None,
        session_body: dict[str, Any] | None = None,
        size: int = 0,
    ) -> Pick:
        """Rank engines for a parsed, validated body. BodyError 503 when none is eligible,
        429 when all eligible ones are saturated or the admission queue refuses it (full, or
        the wait ran out); with ``admission`` on, it waits in that queue as a request to the
        proxy does. ``headers`` (lower-case names, as the gateway sends them) carry the
        session (``session``), else ``session_body``'s (default: ``body``'s) ``user`` field;
        ``key``: the request's API key (the queue's fairness). ``tokenize=False``: no prompt to
        match, by load; ``owner``: the engine holding the stored response the request names
        (router/stored_responses.py)."""
        eligible = self._eligible(subset)
        if not eligible:
            raise BodyError(503, "no eligible endpoint for this request")
        if self._shedding(eligible):
            raise BodyError(429, "every eligible endpoint is at its request limit")
        sc = self.cfg.session
        asked = body if session_body is None else session_body
        session = session_key(headers or {}, asked, sc.header.lower(), sc.user_field)
        how = {"session": session, "tokenize": tokenize, "owner": owner}
        res = await self.router.route_admitted(body, chat, _no_disconnect, key, size, **how)
        d = res.decision
        engines = [e for e in d.ranked if e[0] in eligible]
        if not engines:
            raise BodyError(503, "no eligible endpoint for this request")
        n = res.tokens.n_tokens if res.tokens is not None else 0
        costs = {c.engine: c.uncached_tokens for c in d.costs}
        hits = {c.engine: c.gpu_hit_tokens for c in res.candidates}
        uncached = {e: costs.get(e, max(n - hits.get(e, 0), 0)) for e in engines}
        buffered = body.get("stream") is not True
        return Pick(engines, self._endpoints(engines), res, uncached, buffered)

    async def owner(self, response_id: str) -> Engine | None:
        """The engine holding a stored response (router/stored_responses.py), if noted."""
        return await self.router.response_holder(response_id, time.monotonic())

    def note_owner(self, st: RequestState, response_id: str) -> None:
        """The engine that served ``st`` holds the stored response ``response_id``."""
        if st.engine is not None:
            self.router.note_response_holder(response_id, st.engine, time.monotonic())

    def pick_by_load(self, subset: list[str] | None) -> Pick:
        """A request without a routable body (``GET /v1/models``, other paths): the eligible
        engine with the fewest requests in flight."""
        eligible = self._eligible(subset)
        engines = sorted(
            (e for _, e in serving_engines(eligible.values())),
            key=lambda e: eligible[e[0]].load(e[1]).inflight_requests,
        )
        if not engines:
            raise BodyError(503, "no eligible endpoint for this request")
        if self._shedding(eligible):
            raise BodyError(429, "every eligible endpoint is at its request limit")
        return Pick(engines, self._endpoints(engines), None, {})

    def _endpoints(self, engines: list[Engine]) -> list[str]:
        out: list[str] = []
        limit = max(self.cfg.server.epp_endpoints, 1)
        for e in engines:
            ep = endpoint_of(e[0])
            if ep not in out:
                out.append(ep)
                if len(out) == limit:
                    break
        return out

    def dp_rank(self, engine: Engine) -> int | None:
        """The rank to ask the worker for (None for single-rank workers)."""
        w = self.router.registry.workers.get(engine[0])
        return engine[1] if w is not None and w.dp_size > 1 else None

    # ---------------------------------------------------------------- accounting

    def start(self, pick: Pick, t0: float, key: str | None) -> RequestState:
        """The gateway was told the pick: charge its primary engine now, so the next request
        sees this one's load and speculative entry before any response comes back."""
        st = RequestState(pick, t0, time.perf_counter() - t0, key=key)
        self._charge(st, pick.engines[0])
        res = pick.result
        m = self.metrics
        m.route_decision.observe(st.decided_s)
        if res is not None:
            if res.tokens is None:
                m.tokenize_failures.inc()
            else:
                m.prompt_tokens.inc(res.tokens.n_tokens)
                m.predicted_hit_tokens.inc(res.decision.predicted_hit_tokens)
        return st

    def _charge(self, st: RequestState, engine: Engine) -> None:
        w = self.router.registry.workers.get(engine[0])
        st.engine = engine
        if w is None:
            return
        adm = self.router.admission
        wake = adm.wake if adm is not None else None  # queued prefill fell: the queue looks
        res = st.pick.result
        st.ticket = Ticket(
            w,
            engine[1],
            st.pick.uncached.get(engine, 0),
            wake,
            buffered=st.pick.buffered,
            sequences=res.sequences if res is not None else 1,
        )
        st.charged.append(engine)
        if res is not None:
            self.router.record_sent(engine, res, time.monotonic())

    def served(self, st: RequestState, endpoint: str | None, status: int) -> None:
        """Response headers arrived from ``endpoint`` (None: the gateway did not say, so the
        primary pick). A fallback endpoint moves the charge and the speculative entry there."""
        st.status = status
        engine = self.engine_of(endpoint, st.pick) if endpoint else None
        if engine is not None and engine != st.engine:
            self._release(st)
            res = st.pick.result
            if res is not None and res.tokens is not None and st.engine is not None:
                self.router.speculative.withdraw(st.engine, res.tokens.keys)
            self._charge(st, engine)

    def first_chunk(self, st: RequestState) -> None:
        """The first response byte: the prompt is prefilled, its queued tokens are released."""
        if st.ttft_s is None:
            st.ttft_s = time.perf_counter() - st.t0
            if st.ticket is not None:
                st.ticket.first_token(prefilled=st.status == 200 and not st.pick.buffered)

    def _release(self, st: RequestState) -> None:
        if st.ticket is not None:
            st.ticket.finish()
            st.ticket = None

    def finish(self, st: RequestState, *, aborted: bool = False) -> None:
        """The response ended (or the stream went away: ``aborted``, status 499 unless the
        response had already ended). Idempotent."""
        if st.finished:
            return
        st.finished = True
        self._release(st)
        status = 499 if aborted or st.status is None else st.status
        m = self.metrics
        m.requests.labels(self.policy_name, str(status)).inc()
        m.request_duration.observe(time.perf_counter() - st.t0)
        if st.ttft_s is not None:
            m.ttft.observe(st.ttft_s)
        if st.completion:
            self.router.quotas.charge_completion(st.key, st.completion)
        res = st.pick.result
        if res is None or st.engine is None:
            return
        o = Outcome(status, st.engine[0], st.ttft_s, st.cached, st.prompt, st.engine, st.completion)
        if self.router.verifier is not None:
            self.router.verify_outcome(res, o)
        elif o.cached_tokens is not None and res.tokens is not None and res.verifiable:
            m.prediction_error.observe(abs(res.decision.predicted_hit_tokens - o.cached_tokens))

    def count_rejected(self, status: int) -> None:
        self.metrics.requests.labels(self.policy_name, str(status)).inc()


async def _no_disconnect() -> dict[str, Any]:
    """The admission queue's ``receive`` for a request that arrives over ext_proc: no message
    ever comes (the stream's end cancels the wait instead)."""
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}
