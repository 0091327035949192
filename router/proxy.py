"""Forwarding a routed request to a worker: headers, retry, streaming passthrough, cancellation.

* The client's body bytes are sent unchanged; response bytes come back unchanged
  (``aiter_raw``: no re-encoding, SSE chunks forwarded one by one as they arrive).
* Hop-by-hop headers are dropped both ways; ``Authorization`` is forwarded only when
  ``server.forward_authorization`` is set. Every response carries ``x-kvrouter-worker``.
* **A request runs on at most one worker at a time.** The next-best worker (the policy's
  ranking) is tried only when provably nothing reached the first: connection refused or timed
  out, no free pooled connection, a reused keep-alive connection the worker had already closed
  (see ``router.upstream``), or a 503 answer (the worker declined the request); or when the
  first's engine is found stalled before the response head (below), the request aborted there
  first. A first-byte timeout,
  a worker that closed or broke the connection after reading the request, or any other status
  is answered to the client (502 / 504 / the worker's status), never sent again: the first worker
  may still be computing it. Connect failures mark the worker unhealthy until its next good
  health probe. Every failed attempt is reported to ``on_failed(engine, reason)`` with a reason
  from :data:`FAILURE_REASONS`.
* A client disconnect cancels the upstream request (the upstream connection is closed, which
  makes vLLM abort the request), for streaming and non-streaming responses alike.
* **A request waiting on a stalled engine** (the registry found requests waiting and none
  running there for ``server.worker_stall_s``, router/workers.py) is aborted the same way,
  before its first token: nothing ran it and nothing reached the client. Still before its
  response head (a buffered answer), the next-best worker that is not stalled is tried, else
  503; a stream whose head was forwarded ends with a 503 error event. Without this it would
  wait for ``first_byte_timeout_s``.
* Bounds (:class:`ProxyLimits`): connect / first-byte (read) / pool timeouts per request, and
  an optional total ``server.request_timeout_s``. A worker at ``max_connections_per_worker``
  makes the request wait up to ``server.pool_timeout_s`` for a connection, then the next-best
  worker is tried, then 503 (a full pool is load, not failure: the worker stays healthy).
* **A stream that fails after its first byte** (the worker died, reset the connection, or the
  total timeout fired): if the response is SSE and the bytes forwarded so far end on an event
  boundary, the router appends one error event in vLLM's format and ends the stream cleanly::

      data: {"error": {"message": "...", "type": "upstream_error" | "timeout", "code": 502 | 504}}

      data: [DONE]

  (the OpenAI SDKs raise ``APIError`` on it). If the worker died mid-event, the router closes
  the connection without the terminating chunk, so the client sees a truncated body rather than
  a spliced, unparseable event. Either way the request is accounted as 502/504, its load is
  released, and ``on_failed`` is told (the router re-probes the worker at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from indexer.index import EngineId
from router.messages import (
    SseUsage,
    cached_tokens_of,
    completion_tokens_in,
    error_response,
    has_cache_usage,
    prompt_tokens_of,
    response_headers,
    sse_error_event,
)
from router.stored_responses import SCAN_BYTES, response_id_in
from router.upstream import UpstreamRequest, UpstreamResponse
from router.verify import StreamUsageFilter
from router.workers import Worker, WorkerRegistry

__all__ = [
    "FAILURE_REASONS",
    "Attempt",
    "Outcome",
    "Passthrough",
    "ProxyLimits",
    "Ticket",
    "forward",
]

log = logging.getLogger("kvrouter.proxy")
_usage_dec = msgspec.json.Decoder()


class Ticket:
    """The router's own load accounting for one request on one engine (idempotent release),
    and what aborts the request if that engine's scheduler stalls before its first token."""

    __slots__ = (
        "_buffered",
        "_done",
        "_first",
        "_on_released",
        "_prefilling",
        "_rank",
        "_released",
        "_waiting",
        "_worker",
        "ld",
        "on_stall",
        "sent_s",
        "sequences",
        "stalled",
        "uncached",
    )

    def __init__(
        self,
        w: Worker,
        rank: int,
        uncached: int,
        on_released: Callable[[], None] | None = None,
        buffered: bool = False,
        now: float | None = None,
        sequences: int = 1,
    ) -> None:
        """``buffered``: the answer comes whole, so no first token is seen here; the worker's
        first-token count releases the prefill instead (``Worker.observe_first_tokens``).
        ``now``: when it is sent (``time.monotonic()`` unless given: the routing bench's clock
        is simulated). ``sequences``: the request's ``n``; vLLM runs a child request per
        choice, and its waiting gauge and first-token count count each."""
        self._worker = w
        self._rank = rank
        self.ld = w.load(rank)
        self.uncached = uncached
        self.sequences = sequences
        self.sent_s = time.monotonic() if now is None else now
        self.ld.inflight_requests += 1
        self.ld.prefilling_requests += sequences
        self.ld.queued_prefill_tokens += uncached
        self._prefilling = w.prefilling.setdefault(rank, {})
        if not self._prefilling:  # nothing of this router's ahead: the engine starts it now
            self.ld.head_tokens = uncached
            self.ld.head_since = self.sent_s
        self._prefilling[self] = None
        w.load_changed()
        self._first = False
        """A first token seen here: a stream's first chunk, a whole answer, or a failure."""
        self._released = False
        """Its prefill left the engine's count (at ``_first``, or by the engine's count)."""
        self._done = False
        self._on_released = on_released
        """Told when the queued prefill drops (the admission queue waits for that)."""
        self._waiting = w.awaiting_first.setdefault(rank, set())
        self._waiting.add(self)
        self._buffered = w.buffered.setdefault(rank, {}) if buffered else None
        if self._buffered is not None:
            self._buffered[self] = None
        self.on_stall: Callable[[], None] | None = None
        """Aborts the request where it waits now (set by the proxy at each stage)."""
        self.stalled: str | None = None
        """Why the engine will not run it (``WorkerRegistry``), once told."""

    def stall(self, reason: str) -> None:
        if not self._first and self.stalled is None:
            self.stalled = reason
            if self.on_stall is not None:
                self.on_stall()

    def first_token(self, now: float | None = None, *, prefilled: bool = False) -> None:
        """Seen here: a stream's first chunk, or a whole answer (or a failure) back.
        ``prefilled``: the first chunk of a successful stream, so the engine prefilled the
        request just now: the time it took is a sample of the engine's prefill rate. ``now``:
        ``time.monotonic()`` unless given (the routing bench's clock is simulated)."""
        now = time.monotonic() if now is None else now
        if not self._first:
            self._first = True
            self._waiting.discard(self)
            if not self._released:
                ttft = now - self.sent_s if prefilled else None
                self._worker.saw_first_token(self._rank, ttft, self.sequences)
        self._release(now, prefilled)

    @property
    def prefill_pending(self) -> bool:
        """No first token yet, as far as the router knows (router/prefill_priority.py)."""
        return not self._released

    def engine_first_token(self, now: float | None = None) -> None:
        """Counted by the engine (a buffered answer still decoding). The request stays told
        of a stall until its answer is back: the count is an inference, and a stalled engine
        runs nothing, so it is never wrong to take such a request back. Its prefill time, up
        to ``now`` (when the poll puts the first token: ``Worker.observe_first_tokens``), is a
        sample of the engine's rate: the only samples a fleet of clients asking for whole
        answers gives."""
        self._release(now, prefilled=True)

    def _release(self, now: float | None = None, prefilled: bool = False) -> None:
        if not self._released:
            self._released = True
            if self._buffered is not None:
                self._buffered.pop(self, None)
            ld = self.ld
            ld.prefilling_requests -= self.sequences
            ld.queued_prefill_tokens -= self.uncached
            self._next_head(time.monotonic() if now is None else now, prefilled)
            self._worker.load_changed()
            if self._on_released is not None:
                self._on_released()

    def _next_head(self, now: float, prefilled: bool) -> None:
        """Out of the engine's queue: the engine's clock restarts now, on the oldest request
        still queued there.

        The clock runs from when the engine last had something of this router's to prefill
        (the first send to an idle engine, then each first token), so the time since it is
        prefill time, whichever request it went to: a successful stream's first token, seen as
        it comes, is a sample of the engine's rate (its tokens over that time; requests that
        end in the same step share it), and so is one the engine's count shows at a poll,
        timed by the poll. One timed before the clock's last restart adds its tokens and no
        time: its prefill was in the sample that restarted it (a stream that got its first
        token after it). A whole answer or a failure restarts the clock without a sample."""
        pending = self._prefilling
        pending.pop(self, None)
        ld = self.ld
        if prefilled and self.uncached > 0:
            ld.prefilled_tokens += self.uncached
            ld.prefill_seconds += max(now - ld.head_since, 0.0)
        nxt = next(iter(pending), None)
        ld.head_tokens = nxt.uncached if nxt is not None else 0
        ld.head_since = max(now, ld.head_since)

    def finish(self, now: float | None = None) -> None:
        self.first_token(now)
        if not self._done:
            self._done = True
            self.ld.inflight_requests -= 1
            self._worker.load_changed()


@dataclass
class ProxyLimits:
    """Per-request upstream bounds (``server.*`` timeouts)."""

    request_timeout_s: float | None = None
    # Connect, first-byte/read-gap and pool-wait bounds live in each worker's upstream pool
    # (router/upstream.py), set from the same ``server.*`` keys by the registry.

    @classmethod
    def from_server(cls, server: Any) -> ProxyLimits:
        return cls(request_timeout_s=server.request_timeout_s)


class UpstreamBroken(Exception):
    """Raised into the ASGI server to close a stream that broke mid-event (no last chunk)."""


FAILURE_REASONS = (
    "worker_gone",  # removed from the fleet between routing and forwarding: nothing sent
    "pool_timeout",  # no free connection within server.pool_timeout_s: nothing sent
    "connect",  # connection refused or timed out: nothing sent
    "declined",  # the worker answered 503 before doing any work
    "first_byte_timeout",  # sent, no response head within server.first_byte_timeout_s
    "request_timeout",  # server.request_timeout_s ran out
    "protocol",  # sent, then the connection closed or the answer was malformed
    "status_5xx",  # the worker answered another 5xx status
    "mid_response",  # the response broke after its head (stream or buffered body)
    "stalled",  # aborted before its first token: the engine's scheduler admits nothing
)
"""Why an attempt failed: the label values of ``kvrouter_upstream_failures_total``."""

RETRYABLE = frozenset({"worker_gone", "pool_timeout", "connect", "declined", "stalled"})
"""Failures after which the request did not run: only these try the next worker. A stalled
engine ran nothing for ``server.worker_stall_s``, and the request is aborted there first."""


class WorkerStalled(Exception):
    """The engine a request waits on will not run it (``Ticket.stall``)."""


@dataclass
class Attempt:
    engine: EngineId
    uncached: int


@dataclass
class Outcome:
    status: int
    worker: str | None
    ttft_s: float | None
    """Arrival to the first chunk of a streamed answer (None for a buffered one)."""
    cached_tokens: int | None
    prompt_tokens: int | None = None
    """``usage.prompt_tokens`` the worker reported (verification: tokens as the worker saw them)."""
    engine: EngineId | None = None
    """The engine that served the request (set for every attempt that got a response)."""
    completion_tokens: int | None = None
    """``usage.completion_tokens`` the worker reported (streams: only with usage requested)."""
    response_id: str | None = None
    """The id of a stored Responses API answer (``forward(capture_id=True)``, status 200)."""


def _tag_engine(done: Callable[[Outcome], None], engine: EngineId) -> Callable[[Outcome], None]:
    def tagged(o: Outcome) -> None:
        if o.engine is None:
            o.engine = engine
        done(o)

    return tagged


class Passthrough(Response):
    """Streams an upstream response, cancelling it when the client goes away."""

    def __init__(
        self,
        status: int,
        headers: list[tuple[bytes, bytes]],
        body: AsyncIterator[bytes],
        on_close: Callable[[bool], Awaitable[None]],
    ) -> None:
        self.status_code = status
        self.raw_headers_list = headers
        self.raw_headers = headers
        self.body_iter = body
        self.on_close = on_close
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        completed = False

        async def pump() -> None:
            nonlocal completed
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers_list,
                }
            )
            async for chunk in self.body_iter:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            completed = True

        async def watch() -> None:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return

        pump_t = asyncio.ensure_future(pump())
        watch_t = asyncio.ensure_future(watch())
        try:
            await asyncio.wait({pump_t, watch_t}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (pump_t, watch_t):
                if not t.done():
                    t.cancel()
            for t in (pump_t, watch_t):
                with contextlib.suppress(BaseException):
                    await t
            with anyio.CancelScope(shield=True):
                await self.on_close(completed)


async def _until_disconnect(receive: Receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


class _ClientGone(Exception):
    pass


async def _race(
    coro: Awaitable[Any], watcher: asyncio.Future[None], ticket: Ticket | None = None
) -> Any:
    """Await ``coro`` unless the client disconnects first (then cancel it: _ClientGone) or,
    with ``ticket``, its engine is found stalled first (then cancel it: WorkerStalled)."""
    task = asyncio.ensure_future(coro)
    if ticket is not None:
        ticket.on_stall = task.cancel
        if ticket.stalled is not None:
            task.cancel()
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if ticket is not None:
            ticket.on_stall = None
    if task.done():
        if ticket is not None and ticket.stalled is not None and task.cancelled():
            raise WorkerStalled(ticket.stalled)
        return task.result()
    task.cancel()
    with anyio.CancelScope(shield=True), contextlib.suppress(BaseException):
        await task
    raise _ClientGone


async def _send(
    w: Worker,
    req: UpstreamRequest,
    started: UpstreamResponse | None,
    deadline: float | None,
    watcher: asyncio.Future[None],
    ticket: Ticket,
) -> UpstreamResponse:
    try:
        return await _race(
            _within(w.client.send(req, stream=True, started=started), deadline), watcher, ticket
        )
    except BaseException:
        if started is not None:
            # The send may never have run (cancelled before its first step): close the written
            # request's connection and free its pool slot. A no-op if the send released it.
            await started.aclose()
        raise


async def forward(
    *,
    registry: WorkerRegistry,
    path: str,
    body: bytes,
    headers: list[tuple[bytes, bytes]],
    attempts: list[Attempt],
    stream: bool,
    receive: Receive,
    t0: float,
    done: Callable[[Outcome], None],
    limits: ProxyLimits | None = None,
    on_failed: Callable[[tuple[str, int], str], None] | None = None,
    strip_usage: bool = False,
    on_sent: Callable[[EngineId], None] | None = None,
    on_released: Callable[[], None] | None = None,
    method: str = "POST",
    capture_id: bool = False,
    sequences: int = 1,
) -> Response:
    """Send ``body`` to the first attempt that answers; stream or buffer the answer back.
    ``capture_id``: read the answer's id into ``Outcome.response_id``
    (router/stored_responses.py). ``sequences``: the request's ``n`` (``Ticket``).

    ``on_sent(engine)`` runs once per attempt, before this coroutine first yields to the event
    loop for that attempt: right after the request was written when a kept-alive connection was
    idle (so it runs while the worker already works), else before waiting for a connection.
    Whatever it records is therefore in place before any other request is routed.
    """
    watcher = asyncio.ensure_future(_until_disconnect(receive))
    lim = limits or ProxyLimits()
    deadline = None
    if lim.request_timeout_s is not None:
        deadline = asyncio.get_running_loop().time() + lim.request_timeout_s
        deadline -= time.perf_counter() - t0
    ctx = _Ctx(
        lim, deadline, on_failed, strip_usage, on_sent, on_released, method, capture_id, sequences
    )
    try:
        return await _forward(
            registry, path, body, headers, attempts, stream, watcher, t0, done, ctx
        )
    finally:
        # Not awaited: that took one more loop turn before the answer could be sent. A
        # disconnect it may still read is not lost (uvicorn repeats http.disconnect).
        if watcher.done():
            if not watcher.cancelled():
                watcher.exception()  # retrieved, so asyncio does not log it as lost
        else:
            watcher.cancel()


@dataclass
class _Ctx:
    limits: ProxyLimits
    deadline: float | None
    on_failed: Callable[[tuple[str, int], str], None] | None
    strip_usage: bool = False
    """The router added ``stream_options.include_usage``: drop the usage-only final event."""
    on_sent: Callable[[EngineId], None] | None = None
    on_released: Callable[[], None] | None = None
    """Runs as a request's queued prefill leaves an engine's load (its first token or end)."""
    method: str = "POST"
    capture_id: bool = False
    sequences: int = 1
    """The request's ``n`` (``Ticket``)."""

    def failed(self, engine: tuple[str, int], reason: str) -> None:
        if self.on_failed is not None:
            try:
                self.on_failed(engine, reason)
            except Exception:  # bookkeeping: never the reason an answer is lost
                log.exception("recording a failed attempt on %s", engine)


class _Deadline(Exception):
    pass


async def _within(coro: Awaitable[Any], deadline: float | None) -> Any:
    if deadline is None:
        return await coro
    try:
        async with asyncio.timeout_at(deadline):
            return await coro
    except TimeoutError:
        raise _Deadline from None


async def _forward(
    registry: WorkerRegistry,
    path: str,
    body: bytes,
    headers: list[tuple[bytes, bytes]],
    attempts: list[Attempt],
    stream: bool,
    watcher: asyncio.Future[None],
    t0: float,
    done: Callable[[Outcome], None],
    ctx: _Ctx,
) -> Response:
    last_error = "no worker available"
    last_status = 503
    for i, att in enumerate(attempts):
        w = registry.workers.get(att.engine[0])
        if w is None:
            ctx.failed(att.engine, "worker_gone")
            last_error = f"worker {att.engine[0]} left the fleet"
            continue
        if att.engine[1] in w.stalled_ranks:  # found stalled since the route was chosen
            ctx.failed(att.engine, "stalled")
            last_error, last_status = f"worker {w.url} is stalled: {w.stalled}", 503
            continue
        retry_left = i + 1 < len(attempts)
        hdrs = list(headers)
        if w.dp_size > 1:
            hdrs.append((b"x-data-parallel-rank", str(att.engine[1]).encode()))
        ticket = Ticket(
            w,
            att.engine[1],
            att.uncached,
            ctx.on_released,
            buffered=not stream,
            sequences=ctx.sequences,
        )
        req = w.client.build_request(ctx.method, path, content=body, headers=hdrs)
        started = w.client.write_now(req)
        if ctx.on_sent is not None:
            try:
                ctx.on_sent(att.engine)
            except Exception:  # bookkeeping: never the reason a sent request is lost
                log.exception("recording the request sent to %s", w.url)
        try:
            resp = await _send(w, req, started, ctx.deadline, watcher, ticket)
        except _ClientGone:
            ticket.finish()
            done(Outcome(499, w.url, None, None))
            return Response(status_code=499)
        except WorkerStalled as exc:
            ticket.finish()
            ctx.failed(att.engine, "stalled")
            log.warning("request aborted on %s before its first token: stalled", w.url)
            last_error, last_status = f"worker {w.url} is stalled: {exc}", 503
            continue
        except Exception as exc:
            ticket.finish()
            reason, status, message = _send_failure(w, exc)
            ctx.failed(att.engine, reason)
            if reason == "connect":
                registry.mark_failed(w, f"{type(exc).__name__}: {exc}")
            if reason in RETRYABLE:
                last_error, last_status = message, status
                continue
            done(Outcome(status, w.url, None, None))
            etype = "timeout" if status == 504 else "bad_gateway"
            return error_response(status, message, etype)
        if resp.status_code >= 500:
            reason = "declined" if resp.status_code == 503 else "status_5xx"
            ctx.failed(att.engine, reason)
            if reason in RETRYABLE and retry_left:
                await resp.aclose()
                ticket.finish()
                last_error, last_status = f"worker {w.url} returned {resp.status_code}", 502
                continue
        done_e = _tag_engine(done, att.engine)
        if stream:
            return _stream(resp, w, ticket, t0, done_e, ctx, att.engine)
        return await _buffered(resp, w, ticket, watcher, done_e, ctx, att.engine)
    done(Outcome(last_status, None, None, None))
    etype = {504: "timeout", 503: "service_unavailable"}.get(last_status, "bad_gateway")
    return error_response(last_status, last_error, etype)


def _send_failure(w: Worker, exc: Exception) -> tuple[str, int, str]:
    """(reason, status for the client, message) of an attempt that got no response head."""
    if isinstance(exc, _Deadline):
        return "request_timeout", 504, "request_timeout_s exceeded before the first byte"
    if isinstance(exc, httpx.PoolTimeout):  # the worker is busy, not broken
        return (
            "pool_timeout",
            503,
            f"worker {w.url} has no free connection (max_connections_per_worker)",
        )
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return "connect", 502, f"worker {w.url} unreachable: {type(exc).__name__}"
    if isinstance(exc, httpx.TimeoutException):
        return "first_byte_timeout", 504, f"worker {w.url} timed out before the first byte"
    if isinstance(exc, httpx.HTTPError):
        return "protocol", 502, f"worker {w.url} failed: {type(exc).__name__}: {exc}"
    raise exc


def _abort_on_stall(ticket: Ticket, resp: UpstreamResponse) -> None:
    """From now until its first token, a stall of the request's engine ends the read of
    ``resp`` with WorkerStalled (and closing ``resp`` then aborts the request in vLLM)."""

    def abort() -> None:
        resp.abort(WorkerStalled(ticket.stalled or "stalled"))

    ticket.on_stall = abort
    if ticket.stalled is not None:
        abort()


def _stream(
    resp: UpstreamResponse,
    w: Worker,
    ticket: Ticket,
    t0: float,
    done: Callable[[Outcome], None],
    ctx: _Ctx,
    engine: tuple[str, int],
) -> Response:
    state: dict[str, Any] = {
        "ttft": None,
        "cached": None,
        "failed": None,
        "prompt": None,
        "completion": None,
        "id": None,
        "scan": SCAN_BYTES if ctx.capture_id and resp.status_code == 200 else 0,
    }
    sse = resp.headers.get("content-type", "").startswith("text/event-stream")
    strip = StreamUsageFilter() if ctx.strip_usage and sse else None
    scan = SseUsage() if sse and strip is None else None
    _abort_on_stall(ticket, resp)

    async def body() -> AsyncIterator[bytes]:
        it = resp.aiter_raw().__aiter__()
        boundary = True  # the bytes forwarded so far end between two SSE events
        while True:
            try:
                chunk = await _within(it.__anext__(), ctx.deadline)
            except StopAsyncIteration:
                if strip is not None and (tail := strip.flush()):
                    yield tail
                return
            except (_Deadline, httpx.HTTPError) as exc:
                timeout = isinstance(exc, _Deadline | httpx.TimeoutException)
                code = 504 if timeout else 502
                state["failed"] = code
                ctx.failed(
                    engine, "request_timeout" if isinstance(exc, _Deadline) else "mid_response"
                )
                what = "timed out" if timeout else f"failed mid-stream ({type(exc).__name__})"
                log.warning("stream from %s %s", w.url, what)
                if sse and boundary:
                    etype = "timeout" if timeout else "upstream_error"
                    yield sse_error_event(f"worker {w.url} {what}", etype, code)
                    return
                raise UpstreamBroken(what) from None
            except WorkerStalled as exc:
                state["failed"] = 503
                ctx.failed(engine, "stalled")
                log.warning("stream aborted on %s before its first token: stalled", w.url)
                message = f"worker {w.url} is stalled: {exc}; send the request again"
                if sse and boundary:
                    yield sse_error_event(message, "service_unavailable", 503)
                    return
                raise UpstreamBroken(message) from None
            if state["ttft"] is None:
                state["ttft"] = time.perf_counter() - t0
                ticket.first_token(prefilled=resp.status_code == 200)
            if b'"completion_tokens"' in chunk:
                state["completion"] = completion_tokens_in(chunk)
            if state["scan"] > 0:  # the answer's id, in its first bytes
                state["id"] = response_id_in(chunk)
                state["scan"] = 0 if state["id"] is not None else state["scan"] - len(chunk)
            if strip is not None:
                chunk = strip.feed(chunk)
                if strip.usage is not None:
                    state["cached"], state["prompt"] = strip.usage
                if not chunk:
                    continue
            elif scan is not None:
                scan.feed(chunk)
                if scan.usage is not None:
                    state["cached"], state["prompt"] = scan.usage
            if chunk:
                boundary = chunk.endswith(b"\n\n")
            yield chunk

    async def on_close(completed: bool) -> None:
        ticket.finish()
        with anyio.CancelScope(shield=True):
            await resp.aclose()
        status = resp.status_code if completed else 499
        if state["failed"] is not None:
            status = state["failed"]
        prompt, completion = state["prompt"], state["completion"]
        ttft, cached, rid = state["ttft"], state["cached"], state["id"]
        done(Outcome(status, w.url, ttft, cached, prompt, None, completion, response_id=rid))

    return Passthrough(resp.status_code, response_headers(resp, w.url), body(), on_close)


def _buffered_failure(w: Worker, exc: Exception) -> tuple[int, str, str, str]:
    """(status, failure reason, message, error type) of a buffered answer whose body broke."""
    if isinstance(exc, WorkerStalled):
        message = f"worker {w.url} is stalled: {exc}; send the request again"
        return 503, "stalled", message, "service_unavailable"
    if isinstance(exc, _Deadline | httpx.TimeoutException):
        reason = "request_timeout" if isinstance(exc, _Deadline) else "mid_response"
        return 504, reason, f"worker {w.url} timed out mid-response", "timeout"
    message = f"worker {w.url} failed mid-response: {type(exc).__name__}"
    return 502, "mid_response", message, "bad_gateway"


async def _buffered(
    resp: UpstreamResponse,
    w: Worker,
    ticket: Ticket,
    watcher: asyncio.Future[None],
    done: Callable[[Outcome], None],
    ctx: _Ctx,
    engine: tuple[str, int],
) -> Response:
    async def read() -> bytes:
        parts = [chunk async for chunk in resp.aiter_raw()]
        return b"".join(parts)

    data = resp.take_complete()
    try:
        if data is None:
            _abort_on_stall(ticket, resp)
            data = await _race(_within(read(), ctx.deadline), watcher)
    except _ClientGone:
        ticket.finish()
        with anyio.CancelScope(shield=True):
            await resp.aclose()
        done(Outcome(499, w.url, None, None))
        return Response(status_code=499)
    except (_Deadline, WorkerStalled, httpx.HTTPError) as exc:
        status, reason, message, etype = _buffered_failure(w, exc)
        ticket.finish()
        ctx.failed(engine, reason)
        with anyio.CancelScope(shield=True):
            await resp.aclose()
        done(Outcome(status, w.url, None, None))
        return error_response(status, message, etype)
    ticket.finish()
    await resp.aclose()
    body = data

    def outcome() -> None:
        cached = prompt = completion = rid = None
        if resp.status_code == 200:
            completion = completion_tokens_in(body)
            if has_cache_usage(body):
                with contextlib.suppress(msgspec.DecodeError):
                    doc = _usage_dec.decode(body)
                    cached, prompt = cached_tokens_of(doc), prompt_tokens_of(doc)
            if ctx.capture_id:
                rid = response_id_in(body)
        try:
            # No time to first token: the client gets every token at once, at the end
            # (kvrouter_request_duration_seconds measures that).
            status = resp.status_code
            done(Outcome(status, w.url, None, cached, prompt, None, completion, response_id=rid))
        except Exception:
            log.exception("recording the outcome of a request to %s", w.url)

    # Next loop turn: the caller sends the answer before it yields, so reading the usage and
    # the verifier's bookkeeping (~0.04 ms) no longer delay it.
    asyncio.get_running_loop().call_soon(outcome)
    headers = response_headers(resp, w.url)
    r = Response(content=data, status_code=resp.status_code)
    r.raw_headers = [*headers, (b"content-length", str(len(data)).encode())]
    return r
