"""Session bindings shared between router replicas through Redis.

:class:`RedisSessions` is a :class:`router.sessions.SessionTable` (this replica's cache, which
routing reads) kept coherent with Redis, so a conversation whose turns a load balancer spreads
over several replicas stays on its engine:

* **Write-through, off the request path.** ``bind`` updates the local table and queues the
  binding; a writer task sends queued bindings in one pipeline: ``SET <prefix>:session:<key>
  PX ttl`` (every turn rewrites it, so a binding expires ``session.ttl_s`` after its last turn
  on any replica) and ``PUBLISH <prefix>:sessions`` of the same record.
* **Invalidation by pub/sub.** A replica that holds a session another replica rebinds replaces
  its entry when the record arrives; one that does not hold it ignores the record, so each
  local table stays its replica's own working set.
* **Read on a local miss.** A session this replica has not seen (a new replica, a turn that a
  balancer sent here first, a record missed while disconnected) is read from Redis (``GET`` +
  ``PTTL``, one round trip bounded like every ordinary Redis call) and cached for what is left
  of its TTL. A session's first turn pays that round trip once; later turns find it locally.

A record (msgpack ``[replica, key, url, rank, tokens, last_key, ttl_ms]``) names the engine the
way every replica does (same worker URLs and DP ranks). Redis down (``RedisSharedState.up``
false, or a call that fails): lookups answer from the local table alone and bindings stay
local, each counted by ``on_fallback``; nothing fails a request. Bindings made during an outage
are not written afterwards: the next turn of such a session rebinds it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

import msgspec

from indexer.index import EngineId
from router.sessions import Binding, Sessions, SessionTable
from router.shared_redis import cancel_tasks
from router.shared_state import RedisSharedState, SharedState

__all__ = ["RedisSessions", "shared_sessions"]

CHANNEL = "sessions"
MAX_BATCH = 256
"""Bindings per pipeline of the writer."""


class _Record(msgspec.Struct, array_like=True):
    replica: str
    key: str
    url: str
    rank: int
    tokens: int
    last_key: int
    ttl_ms: int


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(_Record)


class RedisSessions:
    """Session bindings in a local table, written through to Redis (module docstring)."""

    def __init__(
        self,
        table: SessionTable,
        shared: RedisSharedState,
        on_fallback: Callable[[], None] | None = None,
        max_queue: int = 10_000,
    ) -> None:
        self.table = table
        self.shared = shared
        self.on_fallback = on_fallback
        self.prefix = f"{shared.prefix}:session:"
        self.channel = f"{shared.prefix}:{CHANNEL}"
        self._queue: deque[_Record] = deque(maxlen=max_queue)
        self._wake = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self.counters = {"written": 0, "received": 0, "read": 0, "fallbacks": 0}
        shared.listen(CHANNEL, self._on_record)

    def __len__(self) -> int:
        return len(self.table)

    async def lookup(self, key: str, now: float) -> Binding | None:
        got = self.table.get(key, now)
        if got is not None:
            return got
        if not self.shared.up:
            self._fell_back()
            return None
        try:
            async with self.shared.client.pipeline(transaction=False) as p:
                p.get(self.prefix + key)
                p.pttl(self.prefix + key)
                raw, ttl_ms = await self.shared.call(p.execute())
        except asyncio.CancelledError:
            raise
        except Exception:
            self._fell_back()
            return None
        if raw is None or ttl_ms is None or ttl_ms <= 0:
            return None
        try:
            rec = _dec.decode(raw)
        except msgspec.MsgspecError:
            return None
        self.counters["read"] += 1
        engine: EngineId = (rec.url, rec.rank)
        self.table.bind(key, engine, rec.tokens, rec.last_key, now, ttl_ms / 1000.0)
        return self.table.get(key, now)

    def bind(self, key: str, engine: EngineId, tokens: int, last_key: int, now: float) -> None:
        self.table.bind(key, engine, tokens, last_key, now)
        if not self.shared.up:
            self._fell_back()
            return
        ttl_ms = max(int(self.table.ttl_s * 1000), 1)
        url, rank = engine
        self._queue.append(
            _Record(self.shared.replica_id, key, url, rank, tokens, last_key, ttl_ms)
        )
        self._wake.set()
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(
                self._write_loop(), name="kvrouter-sessions-writer"
            )

    async def close(self) -> None:
        if self._writer is not None:
            await cancel_tasks([self._writer])
            self._writer = None

    # ---------------------------------------------------------------- internals

    def _fell_back(self) -> None:
        self.counters["fallbacks"] += 1
        if self.on_fallback is not None:
            self.on_fallback()

    async def _write_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch: dict[str, _Record] = {}
            while self._queue and len(batch) < MAX_BATCH:
                rec = self._queue.popleft()
                batch[rec.key] = rec  # a session bound twice since the last write: the last wins
            if self._queue:
                self._wake.set()
            if not batch:
                continue
            try:
                async with self.shared.client.pipeline(transaction=False) as p:
                    for rec in batch.values():
                        data = _enc.encode(rec)
                        p.set(self.prefix + rec.key, data, px=rec.ttl_ms)
                        p.publish(self.channel, data)
                    await self.shared.call(p.execute())
                self.counters["written"] += len(batch)
            except asyncio.CancelledError:
                raise
            except Exception:
                for _ in batch:
                    self._fell_back()

    def _on_record(self, data: bytes) -> None:
        try:
            rec = _dec.decode(data)
        except msgspec.MsgspecError:
            return
        if rec.replica == self.shared.replica_id or rec.key not in self.table:
            return
        self.counters["received"] += 1
        engine: EngineId = (rec.url, rec.rank)
        now = time.monotonic()
        self.table.bind(rec.key, engine, rec.tokens, rec.last_key, now, rec.ttl_ms / 1000.0)


def shared_sessions(
    table: SessionTable, shared: SharedState, on_fallback: Callable[[], None] | None = None
) -> Sessions:
    """The bindings routing uses: shared through Redis with ``redis.url``, else ``table``."""
    if isinstance(shared, RedisSharedState):
        return RedisSessions(table, shared, on_fallback)
    return table
