"""One engine's index snapshot into Redis in bounded chunks, made visible in one step.

A snapshot of a million blocks is about 30 MB. Sent as one HSET it would be joined, packed and
copied into the socket buffer within one loop turn; here it is appended to
``<snapshot key>:upload`` a chunk per call (the exporter's pieces are produced between the
loop's turns), and a script moves it into the snapshot hash with its metadata at once, so
readers never see a partial one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any

__all__ = ["SNAPSHOT_CHUNK", "close_snapshot", "commit_snapshot", "upload_snapshot"]

SNAPSHOT_CHUNK = 1 << 20
"""Bytes of a snapshot sent to Redis per call: what one loop turn copies at most."""

_COMMIT_LUA = """
local data = redis.call('get', KEYS[2]) or ''
redis.call('hset', KEYS[1], 'data', data, 'seq', ARGV[1], 'ts', ARGV[2], 'blocks', ARGV[3],
           'writer', ARGV[4], 'event_ts', ARGV[5])
redis.call('del', KEYS[2])
return #data
"""


def _pieces(snapshot: bytes | Iterable[bytes]) -> Iterator[bytes | memoryview]:
    """An exporter's own pieces (each a bounded slice of work, many of them empty), or slices
    of ready bytes."""
    if isinstance(snapshot, bytes):
        view = memoryview(snapshot)
        for i in range(0, len(view), SNAPSHOT_CHUNK):
            yield view[i : i + SNAPSHOT_CHUNK]
    else:
        yield from snapshot


async def upload_snapshot(
    call: Callable[[Awaitable[Any]], Awaitable[Any]],
    client: Any,
    key: str,
    snapshot: bytes | Iterable[bytes],
    expire_ms: int,
) -> int:
    """Append ``snapshot`` to ``<key>:upload`` (``call`` bounds each Redis call); returns its
    size. The loop turns between pieces."""
    upload = f"{key}:upload"
    await call(client.delete(upload))
    size = 0
    chunk = bytearray()
    for piece in _pieces(snapshot):
        chunk += piece
        if len(chunk) >= SNAPSHOT_CHUNK:
            size += await _append(call, client, upload, chunk, expire_ms)
            chunk = bytearray()
        await asyncio.sleep(0)
    if chunk:
        size += await _append(call, client, upload, chunk, expire_ms)
    return size


async def _append(
    call: Callable[[Awaitable[Any]], Awaitable[Any]],
    client: Any,
    upload: str,
    chunk: bytearray,
    expire_ms: int,
) -> int:
    async with client.pipeline(transaction=False) as p:
        p.append(upload, memoryview(chunk))
        p.pexpire(upload, expire_ms)  # an upload cut short goes away by itself
        await call(p.execute())
    return len(chunk)


def commit_snapshot(
    pipe: Any, key: str, seq: int, now: float, blocks: int, writer: str, event_ts: float | None
) -> None:
    """Queue on ``pipe`` the move of the uploaded snapshot into ``key`` with its metadata."""
    ts = "" if event_ts is None else repr(event_ts)
    pipe.eval(_COMMIT_LUA, 2, key, f"{key}:upload", seq, repr(now), blocks, writer, ts)


def close_snapshot(snapshot: bytes | Iterable[bytes]) -> None:
    """Stop an exporter left unread (it records the engine's changes until closed)."""
    close = getattr(snapshot, "close", None)
    if close is not None:
        close()
