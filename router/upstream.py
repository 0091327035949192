"""A lean HTTP/1.1 keep-alive client for the proxy hot path (router -> one worker).

Why not httpx here: profiling the router under 16 concurrent clients showed most of its CPU in
httpcore's connection pool, which re-scans every pooled connection on each request and release
(``_assign_requests_to_connections``) and probes each idle one with syscalls
(``has_expired`` -> ``getpeername`` + poll). For a gateway whose whole job is forwarding, that
cost is paid twice per request (``/tokenize`` and the completion). This client does only what
the proxy needs, with the parsing in C (``httptools``, the parser uvicorn already uses):

* one pool per worker, LIFO idle connections, at most ``max_connections`` open; a request that
  finds the pool full waits up to ``pool_timeout`` for a slot (then ``httpx.PoolTimeout``);
* ``send(request, stream=True)`` returns once the status line and headers arrived (the
  first-byte timeout covers that wait, and then each wait for more of the body); the body is
  read as it arrives through ``aiter_raw``
  (transfer-decoded, never content-decoded), with backpressure: the socket stops being read
  while more than ``_HIGH_WATER`` bytes wait for the consumer;
* closing a response before its end closes the connection: that is how an upstream request is
  cancelled (vLLM aborts a request whose client disconnected);
* errors are httpx's exception types, so callers handle one family;
* waits are bounded with ``asyncio.timeout`` rather than ``asyncio.wait_for``, which wraps a
  coroutine in a new task and costs an extra event-loop turn even when the awaited thing is
  ready (a free pool slot, a response head already parsed): four to six such waits per proxied
  request.

It mirrors the small slice of httpx's API the proxy uses (``build_request``, ``send``,
``post``, ``get``, ``Response.status_code/headers.raw/aiter_raw/aread/aclose/json``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections import deque
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

import httptools
import httpx

__all__ = ["UpstreamClient", "UpstreamRequest", "UpstreamResponse"]

_HIGH_WATER = 1 << 20  # bytes buffered per response before the socket stops being read
_LOW_WATER = 1 << 18
_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"host"})


class _Headers:
    """The part of httpx.Headers the proxy uses."""

    __slots__ = ("raw",)

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = raw

    def get(self, name: str, default: str | None = None) -> str | None:
        key = name.lower().encode("latin-1")
        for k, v in self.raw:
            if k.lower() == key:
                return v.decode("latin-1")
        return default

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None


class UpstreamRequest:
    __slots__ = ("body", "headers", "method", "path")

    def __init__(
        self, method: str, path: str, body: bytes, headers: list[tuple[bytes, bytes]]
    ) -> None:
        self.method, self.path, self.body, self.headers = method, path, body, headers


class _Conn(asyncio.Protocol):
    """One keep-alive connection; serves one response at a time."""

    def __init__(self, pool: UpstreamClient) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.closed = False
        self._header_name = b""
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self.received = 0
        """Bytes received since the current request was written."""
        self.written_at = 0.0

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # pragma: no cover - workers never upgrade
            self._fail(httpx.RemoteProtocolError("unexpected protocol upgrade"))
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"malformed response from worker: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        err = httpx.RemoteProtocolError("worker closed the connection")
        if self.response is not None and self.received == 0:
            # Only this case can be a keep-alive close that crossed our request on the wire;
            # how soon it came tells that race from a worker that read the request and died.
            age = asyncio.get_running_loop().time() - self.written_at
            err.closed_unanswered_after = age  # type: ignore[attr-defined]
        self._fail(err)

    def pause_writing(self) -> None:  # pragma: no cover - request bodies are small
        pass

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._raw_headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        r = self.response
        if r is None:
            return
        r.status_code = self.parser.get_status_code()
        r.headers = _Headers(self._raw_headers)
        r.keep_alive = self.parser.should_keep_alive()
        if not r.head.done():
            r.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        r = self.response
        if r is not None:
            r._feed(body)

    def on_message_complete(self) -> None:
        r = self.response
        if r is not None:
            r._finish()

    # pool side
    def write_request(self, req: UpstreamRequest, host: bytes) -> None:
        lines = [req.method.encode(), b" ", req.path.encode("latin-1"), b" HTTP/1.1\r\nhost: "]
        lines.append(host)
        lines.append(b"\r\ncontent-length: ")
        lines.append(str(len(req.body)).encode())
        for k, v in req.headers:
            if k.lower() not in _HOP:
                lines += (b"\r\n", k, b": ", v)
        lines.append(b"\r\n\r\n")
        lines.append(req.body)
        assert self.transport is not None
        self.received = 0
        self.written_at = asyncio.get_running_loop().time()
        self.transport.write(b"".join(lines))

    def _fail(self, exc: Exception) -> None:
        r = self.response
        if r is not None:
            r._error(exc)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class UpstreamResponse:
    """A response being read from a worker (httpx.Response-like)."""

    def __init__(self, conn: _Conn, pool: UpstreamClient) -> None:
        self._conn = conn
        self._pool = pool
        self.status_code = 0
        self.headers = _Headers([])
        self.keep_alive = False
        self.head: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._wake: asyncio.Future[None] | None = None
        self._complete = False
        self._exc: Exception | None = None
        self._released = False
        self._paused = False
        self.content = b""

    # fed by the connection
    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > _HIGH_WATER and not self._paused and self._conn.transport:
            self._paused = True
            self._conn.transport.pause_reading()
        self._signal()

    def _finish(self) -> None:
        self._complete = True
        self._signal()

    def _error(self, exc: Exception) -> None:
        if self._complete:
            return
        self._exc = exc
        if not self.head.done():
            self.head.set_exception(exc)
            self.head.exception()  # retrieved: the waiter may already be gone
        self._signal()

    def _signal(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    # consumer API
    async def aiter_raw(self) -> AsyncIterator[bytes]:
        try:
            while True:
                while self._chunks:
                    chunk = self._chunks.popleft()
                    self._buffered -= len(chunk)
                    self._resume_if_drained()
                    yield chunk
                if self._complete:
                    return
                if self._exc is not None:
                    raise self._exc
                self._wake = asyncio.get_running_loop().create_future()
                try:
                    # Like httpx's read timeout: a bound on each wait for more of the body.
                    async with asyncio.timeout(self._pool.first_byte_timeout):
                        await self._wake
                except TimeoutError:
                    self._exc = httpx.ReadTimeout(
                        f"worker sent nothing for {self._pool.first_byte_timeout}s mid-response"
                    )
                    raise self._exc from None
        finally:
            if self._complete and not self._chunks:
                self._release()

    def _resume_if_drained(self) -> None:
        if self._paused and self._buffered < _LOW_WATER and self._conn.transport:
            self._paused = False
            self._conn.transport.resume_reading()

    def take_complete(self) -> bytes | None:
        """The whole body if it has already arrived (else None, and nothing is consumed).

        A short answer usually comes in the same read as its head; taking it here saves the
        consumer a wait it would not need (for the proxy, a task and an ``asyncio.wait``)."""
        if not self._complete or self._exc is not None:
            return None
        data = b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        # The last read may have taken the buffer over _HIGH_WATER: a pooled connection must read.
        self._resume_if_drained()
        self.content = data
        self._release()
        return data

    async def aread(self) -> bytes:
        self.content = b"".join([c async for c in self.aiter_raw()])
        return self.content

    def json(self) -> Any:
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    async def aclose(self) -> None:
        self._release()

    def abort(self, exc: Exception) -> None:
        """End the read with ``exc`` (a pending head or body wait raises it); the connection
        is closed, not reused, when the response is released."""
        self._error(exc)

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        reusable = self._complete and self.keep_alive and self._exc is None
        self._pool._release(self._conn, reusable)


class _Slots:
    """The pool's connection slots: a counting semaphore that can also be taken without waiting.

    Why not ``asyncio.Semaphore``: :meth:`UpstreamClient.write_now` must take a slot in plain
    synchronous code, so that a request goes on the wire without the caller yielding to the loop.
    Waiters are served oldest first; a slot is handed straight to a waiter, never left free while
    one waits.
    """

    def __init__(self, n: int) -> None:
        self._free = n
        self._waiters: deque[asyncio.Future[None]] = deque()

    def try_take(self) -> bool:
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return True
        return False

    async def take(self) -> None:
        if self.try_take():
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.give()  # handed a slot just as we were cancelled: pass it on
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)
            raise

    def give(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self._free += 1


class UpstreamClient:
    """Keep-alive connection pool to one worker (``base_url`` is ``http://host:port``)."""

    def __init__(
        self,
        base_url: str,
        *,
        max_connections: int = 256,
        connect_timeout: float = 5.0,
        first_byte_timeout: float = 600.0,
        pool_timeout: float | None = None,
        keepalive_expiry: float = 4.0,
        authorization: str | None = None,
    ) -> None:
        """``authorization``: the ``Authorization`` value every request to this worker carries
        (``server.upstream_api_key``), replacing any the caller passed."""
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream URL must be http://host:port, got {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self._host_header = parts.netloc.encode("latin-1")
        self._authorization = (
            None if authorization is None else (b"authorization", authorization.encode("latin-1"))
        )
        self.max_connections = max_connections
        self.connect_timeout = connect_timeout
        self.first_byte_timeout = first_byte_timeout
        self.pool_timeout = connect_timeout if pool_timeout is None else pool_timeout
        # Below uvicorn's (and so vLLM's) default keep-alive timeout of 5 s: an idle connection
        # is dropped before the worker may close it under us.
        self.keepalive_expiry = keepalive_expiry
        self._idle: list[tuple[float, _Conn]] = []  # (idle since, connection), LIFO
        self._open = 0
        self._slots = _Slots(max_connections)
        self._closed = False

    @property
    def open_connections(self) -> int:
        return self._open

    def build_request(
        self,
        method: str,
        path: str,
        *,
        content: bytes = b"",
        headers: _HeaderArg = None,
    ) -> UpstreamRequest:
        hdrs = _header_list(headers)
        if self._authorization is not None:
            hdrs = [h for h in hdrs if h[0].lower() != b"authorization"]
            hdrs.append(self._authorization)
        return UpstreamRequest(method, path, content, hdrs)

    def write_now(self, request: UpstreamRequest) -> UpstreamResponse | None:
        """Write ``request`` at once, without yielding to the event loop, when a pool slot is free
        and a kept-alive connection is idle (the usual case under steady load); None otherwise.
        Pass the result to :meth:`send` as ``started`` to wait for its answer.

        Why: work the caller still has to do after choosing the worker (bookkeeping that must
        not let another request in first) can then run while the worker already computes,
        instead of before the request leaves. If the caller never passes it to :meth:`send`, it
        must ``aclose()`` it (the connection is closed and the slot freed).
        """
        if self._closed or not self._slots.try_take():
            return None
        conn = self._idle_connection()
        if conn is None:
            self._slots.give()
            return None
        try:
            return self._start(conn, request)
        except Exception:
            return None  # _start released the connection; send() will try again

    async def send(
        self,
        request: UpstreamRequest,
        *,
        stream: bool = True,
        timeout: float | None = None,
        started: UpstreamResponse | None = None,
    ) -> UpstreamResponse:
        wait = self.first_byte_timeout if timeout is None else timeout
        if started is None:
            if self._closed:
                raise httpx.ConnectError("upstream client is closed")
            try:
                async with asyncio.timeout(self.pool_timeout):
                    await self._slots.take()
            except TimeoutError:
                raise httpx.PoolTimeout(
                    f"no free connection to {self.host}:{self.port} within {self.pool_timeout}s "
                    f"({self.max_connections} in use)"
                ) from None
        try:
            if started is None:
                resp = await self._exchange(request, wait)
            else:
                resp = await self._await_head(started, True, wait)
        except httpx.RemoteProtocolError as exc:
            if not getattr(exc, "stale", False):
                raise
            # A kept-alive connection the worker closed while idle (uvicorn closes them after
            # its keep-alive timeout): nothing was processed, so retry once on a new one.
            resp = await self._exchange(request, wait, fresh=True)
        if not stream:
            await resp.aread()
        return resp

    async def _exchange(
        self, request: UpstreamRequest, wait: float, fresh: bool = False
    ) -> UpstreamResponse:
        """Write the request on a pooled connection and wait for the response head. Holds
        one pool slot from here until the response is released."""
        try:
            conn, reused = await self._connection(fresh)
        except BaseException:
            self._slots.give()
            raise
        return await self._await_head(self._start(conn, request), reused, wait)

    def _start(self, conn: _Conn, request: UpstreamRequest) -> UpstreamResponse:
        resp = UpstreamResponse(conn, self)
        conn.response = resp
        try:
            conn.write_request(request, self._host_header)
        except BaseException:
            resp._released = True
            self._release(conn, False)
            raise
        return resp

    async def _await_head(
        self, resp: UpstreamResponse, reused: bool, wait: float
    ) -> UpstreamResponse:
        conn = resp._conn
        try:
            async with asyncio.timeout(wait):
                await asyncio.shield(resp.head)
        except TimeoutError:
            resp._released = True
            self._release(conn, False)
            raise httpx.ReadTimeout(
                f"worker {self.host}:{self.port} sent no response headers within {wait}s"
            ) from None
        except httpx.RemoteProtocolError as exc:
            stale = reused and _crossed_keep_alive_close(exc)
            resp._released = True
            self._release(conn, False, keep_slot=stale)
            if stale:
                exc.stale = True  # type: ignore[attr-defined]
            raise
        except BaseException:
            resp._released = True
            self._release(conn, False)
            raise
        return resp

    async def post(
        self,
        path: str,
        *,
        content: bytes | None = None,
        json: Any = None,
        headers: _HeaderArg = None,
        timeout: float | None = None,
    ) -> UpstreamResponse:
        body = content if content is not None else _json_bytes(json)
        hdrs = _header_list(headers)
        if not any(k.lower() == b"content-type" for k, _ in hdrs):
            hdrs.append((b"content-type", b"application/json"))
        req = self.build_request("POST", path, content=body, headers=hdrs)
        return await self._complete(req, timeout)

    async def get(self, path: str, *, timeout: float | None = None) -> UpstreamResponse:
        return await self._complete(self.build_request("GET", path), timeout)

    async def _complete(self, req: UpstreamRequest, timeout: float | None) -> UpstreamResponse:
        if timeout is None:
            return await self.send(req, stream=False)
        try:
            async with asyncio.timeout(timeout):
                return await self.send(req, stream=False, timeout=timeout)
        except TimeoutError:
            raise httpx.ReadTimeout(f"worker {self.host}:{self.port} timed out") from None

    async def aclose(self) -> None:
        self._closed = True
        for _, conn in self._idle:
            conn.close()
        self._idle.clear()

    # pool internals
    def _idle_connection(self) -> _Conn | None:
        """The most recently used idle connection still alive and within keep-alive (LIFO)."""
        now = asyncio.get_running_loop().time()
        while self._idle:
            since, conn = self._idle.pop()
            alive = not conn.closed and conn.transport is not None
            if alive and now - since < self.keepalive_expiry and not conn.transport.is_closing():  # type: ignore[union-attr]
                return conn
            conn.close()
            self._open -= 1
        return None

    async def _connection(self, fresh: bool = False) -> tuple[_Conn, bool]:
        if not fresh:
            idle = self._idle_connection()
            if idle is not None:
                return idle, True
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Conn(self), self.host, self.port),
                self.connect_timeout,
            )
        except TimeoutError:
            raise httpx.ConnectTimeout(
                f"connecting to {self.host}:{self.port} took over {self.connect_timeout}s"
            ) from None
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {self.host}:{self.port}: {exc}") from None
        self._open += 1
        return conn, False

    def _release(self, conn: _Conn, reusable: bool, keep_slot: bool = False) -> None:
        conn.response = None
        if reusable and not conn.closed and not self._closed:
            self._idle.append((asyncio.get_running_loop().time(), conn))
        else:
            conn.close()
            self._open -= 1
        if not keep_slot:
            self._slots.give()


STALE_CLOSE_WINDOW_S = 0.1
"""How soon after the write a reused connection's close, with no response byte, still counts as
the worker's idle keep-alive close crossing the request (so the request was never read). The
FIN of that close is already in flight when the request is written and arrives within a round
trip; a worker that read the request and died (mid-prefill) closes later, and its request must
not run a second time elsewhere."""


def _crossed_keep_alive_close(exc: Exception) -> bool:
    age = getattr(exc, "closed_unanswered_after", None)
    return age is not None and age <= STALE_CLOSE_WINDOW_S


_HeaderArg = Mapping[str, str] | Iterable[tuple[bytes | str, bytes | str]] | None


def _header_list(headers: _HeaderArg) -> list[tuple[bytes, bytes]]:
    items = headers.items() if isinstance(headers, Mapping) else (headers or ())
    return [
        (
            k.encode("latin-1") if isinstance(k, str) else k,
            v.encode("latin-1") if isinstance(v, str) else v,
        )
        for k, v in items
    ]


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()
