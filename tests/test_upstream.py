"""The proxy's upstream HTTP/1.1 client, against a raw server whose every byte the test controls."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from router.upstream import UpstreamClient

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A TCP server on a free port; yields its URL and a list counting accepted connections."""
    accepted: list[int] = []

    async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            await handler(r, w)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            w.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", accepted
    finally:
        server.close()
        await server.wait_closed()


async def read_request(r: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await r.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head, await r.readexactly(length)


def response(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def echo_keepalive(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    while True:
        head, body = await read_request(r)
        w.write(response(b"echo:" + body, b"x-path: " + head.split(b" ")[1] + b"\r\n"))
        await w.drain()


async def test_keep_alive_reuses_one_connection_and_sends_exact_body() -> None:
    async with raw_server(echo_keepalive) as (url, accepted):
        client = UpstreamClient(url)
        for i in range(20):
            r = await client.post("/v1/x", content=b"body-%d" % i)
            assert (r.status_code, r.content) == (200, b"echo:body-%d" % i)
            assert r.headers.get("x-path") == "/v1/x"
        assert len(accepted) == 1
        await client.aclose()


async def test_header_forms_and_json_body() -> None:
    seen: list[bytes] = []

    async def record(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            head, body = await read_request(r)
            seen.append(head.lower() + body)
            w.write(response(b'{"ok": true}'))
            await w.drain()

    async with raw_server(record) as (url, _):
        client = UpstreamClient(url)
        r = await client.post("/a", json={"x": 1}, headers={"X-Trace": "t1"})
        assert r.json() == {"ok": True} and r.text == '{"ok": true}'
        await client.post("/b", content=b"raw", headers=[(b"content-type", b"text/plain")])
        assert b"x-trace: t1" in seen[0] and b"content-type: application/json" in seen[0]
        assert seen[0].endswith(b'{"x":1}')
        assert seen[1].count(b"content-type") == 1 and b"text/plain" in seen[1]


async def test_chunked_stream_arrives_chunk_by_chunk() -> None:
    gate = asyncio.Event()

    async def chunked(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await w.drain()
        await gate.wait()
        w.write(b"6\r\n world\r\n0\r\n\r\n")
        await w.drain()
        await asyncio.sleep(1)

    async with raw_server(chunked) as (url, _):
        client = UpstreamClient(url)
        resp = await client.send(client.build_request("POST", "/s", content=b"{}"))
        chunks = resp.aiter_raw()
        assert await asyncio.wait_for(chunks.__anext__(), 5) == b"hello"  # before the rest exists
        gate.set()
        rest = [c async for c in chunks]
        assert b"".join(rest) == b" world"
        await resp.aclose()


async def test_first_byte_timeout_and_other_requests_unaffected() -> None:
    async def stall(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        head, _ = await read_request(r)
        if b"/slow" in head:
            await asyncio.sleep(30)
        w.write(response(b"ok"))
        await w.drain()
        await asyncio.sleep(1)

    async with raw_server(stall) as (url, _):
        client = UpstreamClient(url, first_byte_timeout=0.3)
        slow = asyncio.create_task(client.post("/slow", content=b""))
        fast = await client.post("/fast", content=b"")
        assert fast.content == b"ok"
        with pytest.raises(httpx.ReadTimeout):
            await slow
        # The fast request's connection stays pooled; the timed-out one was closed.
        assert client.open_connections == 1


async def test_worker_dying_mid_body_is_an_error_not_a_short_body() -> None:
    async def die(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await w.drain()
        w.transport.abort()

    async with raw_server(die) as (url, _):
        client = UpstreamClient(url)
        resp = await client.send(client.build_request("POST", "/", content=b""))
        with pytest.raises(httpx.RemoteProtocolError):
            async for _ in resp.aiter_raw():
                pass
        await resp.aclose()
        assert client.open_connections == 0


async def test_connect_errors_are_httpx_errors() -> None:
    async with raw_server(echo_keepalive) as (url, _):
        pass  # closed again: nothing listens on that port now
    client = UpstreamClient(url, connect_timeout=1)
    with pytest.raises(httpx.ConnectError):
        await client.post("/", content=b"")


async def test_stale_keep_alive_connection_is_retried_on_a_fresh_one() -> None:
    served = 0

    async def one_per_connection(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal served
        await read_request(r)
        served += 1
        w.write(response(b"ok"))  # keep-alive promised, then the server closes while idle
        await w.drain()

    async with raw_server(one_per_connection) as (url, accepted):
        client = UpstreamClient(url)
        assert (await client.post("/", content=b"")).content == b"ok"
        await asyncio.sleep(0.2)  # let the close arrive (or not: both paths must work)
        assert (await client.post("/", content=b"")).content == b"ok"
        assert served == 2 and len(accepted) == 2


async def test_worker_dying_after_reading_a_request_is_not_retried() -> None:
    """A reused connection that closes with no answer long after the write is a worker that
    read the request and died (mid-prefill): sending it again would run it twice."""
    requests = 0

    async def answer_once_then_die(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal requests
        await read_request(r)
        requests += 1
        w.write(response(b"ok"))
        await w.drain()
        await read_request(r)
        requests += 1
        await asyncio.sleep(0.3)  # "prefill", then the process dies: close, no byte sent

    async with raw_server(answer_once_then_die) as (url, accepted):
        client = UpstreamClient(url)
        assert (await client.post("/", content=b"")).content == b"ok"
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post("/", content=b"")
        assert requests == 2 and len(accepted) == 1, "the request was sent a second time"
        assert client.open_connections == 0


async def test_malformed_answer_on_a_reused_connection_is_not_retried() -> None:
    requests = 0

    async def answer_once_then_garbage(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal requests
        await read_request(r)
        requests += 1
        w.write(response(b"ok"))
        await w.drain()
        await read_request(r)
        requests += 1
        w.write(b"NOT HTTP AT ALL\r\n\r\n")
        await w.drain()

    async with raw_server(answer_once_then_garbage) as (url, accepted):
        client = UpstreamClient(url)
        assert (await client.post("/", content=b"")).content == b"ok"
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post("/", content=b"")
        assert requests == 2 and len(accepted) == 1, "a malformed answer is not a stale socket"


async def test_pool_bound_waits_then_times_out() -> None:
    release = asyncio.Event()

    async def hold(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        await release.wait()
        w.write(response(b"done"))
        await w.drain()
        await asyncio.sleep(1)

    async with raw_server(hold) as (url, accepted):
        client = UpstreamClient(url, max_connections=2, pool_timeout=0.3)
        held = [asyncio.create_task(client.post("/", content=b"")) for _ in range(2)]
        while len(accepted) < 2:
            await asyncio.sleep(0.01)
        with pytest.raises(httpx.PoolTimeout):
            await client.post("/", content=b"")
        release.set()
        assert [(await t).content for t in held] == [b"done", b"done"]
        assert len(accepted) == 2, "the bound held: no third connection was opened"


async def test_closing_a_response_early_closes_its_connection() -> None:
    closed = asyncio.Event()

    async def endless(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        try:
            while True:
                w.write(b"4\r\ndata\r\n")
                await w.drain()
                await asyncio.sleep(0.01)
        except ConnectionError:
            closed.set()
            raise

    async with raw_server(endless) as (url, _):
        client = UpstreamClient(url)
        resp = await client.send(client.build_request("POST", "/", content=b""))
        async for chunk in resp.aiter_raw():
            assert chunk.startswith(b"data")
            break
        await resp.aclose()  # the client went away: the upstream request must be cancelled
        await asyncio.wait_for(closed.wait(), 5)
        assert client.open_connections == 0


async def test_a_stream_that_stalls_mid_body_times_out() -> None:
    async def stall_mid_body(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await w.drain()
        await asyncio.sleep(30)

    async with raw_server(stall_mid_body) as (url, _):
        client = UpstreamClient(url, first_byte_timeout=0.3)
        resp = await client.send(client.build_request("POST", "/", content=b""))
        got = []
        with pytest.raises(httpx.ReadTimeout):
            async for chunk in resp.aiter_raw():
                got.append(chunk)
        assert got == [b"first"]
        await resp.aclose()
        assert client.open_connections == 0


async def test_take_complete_returns_an_arrived_body_and_frees_the_connection() -> None:
    """A body that came with its head is taken at once and the connection goes back to the
    pool; a body still arriving is left alone (None) and read normally."""
    gate = asyncio.Event()

    async def server(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            head, body = await read_request(r)
            if head.startswith(b"POST /slow"):
                w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nfirst")
                await w.drain()
                await gate.wait()
                w.write(b"-half")
            else:
                w.write(response(b"whole:" + body))
            await w.drain()

    async with raw_server(server) as (url, accepted):
        client = UpstreamClient(url)
        resp = await client.send(client.build_request("POST", "/fast", content=b"x"))
        await until_complete(resp)
        assert resp.take_complete() == b"whole:x" and resp.content == b"whole:x"
        slow = await client.send(client.build_request("POST", "/slow", content=b"y"))
        assert slow.take_complete() is None  # half a body: nothing consumed
        gate.set()
        assert await slow.aread() == b"first-half"
        assert len(accepted) == 1  # the first answer's connection was reused
        await client.aclose()


async def until_complete(resp: object, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not resp._complete:  # type: ignore[attr-defined]
        assert loop.time() < deadline, "the body never arrived"
        await asyncio.sleep(0.005)


async def test_taking_a_body_that_paused_reading_leaves_the_connection_readable() -> None:
    """A body whose last read took the buffer over the high-water mark arrives complete with
    reading paused; taken whole, its pooled connection must read again for the next request.
    (That happens in most runs; when reading pauses before the end, the body is read normally.)"""
    big = b"z" * ((1 << 20) + 50_000)

    async def server(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            head, body = await read_request(r)
            w.write(response(big if head.startswith(b"POST /big") else b"small:" + body))
            await w.drain()

    async with raw_server(server) as (url, accepted):
        client = UpstreamClient(url)
        resp = await client.send(client.build_request("POST", "/big", content=b"x"))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while not (resp._complete or resp._paused):  # type: ignore[attr-defined]
            assert loop.time() < deadline
            await asyncio.sleep(0.005)
        got = resp.take_complete() if resp._complete else None  # type: ignore[attr-defined]
        if got is None:
            got = await resp.aread()
        assert got == big
        r = await asyncio.wait_for(client.post("/next", content=b"y"), 5)
        assert r.content == b"small:y" and len(accepted) == 1
        await client.aclose()


async def test_write_now_sends_on_an_idle_connection_before_the_caller_yields() -> None:
    async with raw_server(echo_keepalive) as (url, accepted):
        client = UpstreamClient(url)
        req = client.build_request("POST", "/a", content=b"first")
        assert client.write_now(req) is None, "no idle connection yet: the caller must send()"
        assert (await client.send(req, stream=False)).content == b"echo:first"
        started = client.write_now(client.build_request("POST", "/b", content=b"second"))
        assert started is not None
        conn = started._conn
        assert conn.transport is not None
        # Written in full to the socket already, with no loop turn in between.
        assert conn.transport.get_write_buffer_size() == 0
        resp = await client.send(
            client.build_request("POST", "/b", content=b"second"), stream=False, started=started
        )
        assert resp is started and resp.content == b"echo:second"
        assert len(accepted) == 1


async def test_an_abandoned_write_now_frees_its_slot_and_closes_its_connection() -> None:
    cut = asyncio.Event()

    async def slow(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(response(b"one"))
        await w.drain()
        await read_request(r)  # the second request is written, then abandoned
        if not await r.read(1):
            cut.set()

    async with raw_server(slow) as (url, accepted):
        client = UpstreamClient(url, max_connections=1, pool_timeout=0.5)
        assert (await client.post("/", content=b"")).content == b"one"
        started = client.write_now(client.build_request("POST", "/", content=b"two"))
        assert started is not None
        assert client.write_now(client.build_request("POST", "/", content=b"x")) is None
        await started.aclose()  # what the proxy does when the send never ran
        await asyncio.wait_for(cut.wait(), 5)
        assert client.open_connections == 0
        # The only slot is free again: a new request gets a new connection, no PoolTimeout.
        assert (await client.post("/", content=b"")).content == b"one"
        assert len(accepted) == 2


async def test_pool_slots_go_to_waiters_in_order_and_survive_cancelled_waiters() -> None:
    from router.upstream import _Slots

    slots = _Slots(1)
    assert slots.try_take() and not slots.try_take()
    order: list[str] = []

    async def waiter(name: str) -> None:
        await slots.take()
        order.append(name)

    a = asyncio.create_task(waiter("a"))
    b = asyncio.create_task(waiter("b"))
    c = asyncio.create_task(waiter("c"))
    await asyncio.sleep(0)
    b.cancel()  # a waiter that gives up must not take a slot with it
    await asyncio.sleep(0)
    assert not slots.try_take(), "queued waiters come before a newcomer"
    slots.give()
    await a
    slots.give()
    await c
    assert order == ["a", "c"] and b.cancelled()
    # A waiter handed a slot in the same turn it is cancelled passes the slot on.
    d = asyncio.create_task(waiter("d"))
    await asyncio.sleep(0)
    slots.give()  # c is done: its slot is handed to d...
    d.cancel()  # ...but d is cancelled before it runs
    with contextlib.suppress(asyncio.CancelledError):
        await d
    assert slots.try_take() and not slots.try_take(), "the one slot is free again, once"
