"""Shared state in Redis: several router replicas route as if one router decided.

:class:`RedisSharedState` is :class:`router.shared_local.SharedState` plus Redis; the keys,
bounds and failure modes are described in :mod:`router.shared_state`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import msgspec

from indexer.index import EngineId
from indexer.snapshot import ExportAborted
from router.load import EngineLoad
from router.policy import SAMPLE_STRIDE, Engine
from router.shared_local import SharedState, Snapshot, engine_key, parse_engine_key
from router.snapshot_upload import close_snapshot, commit_snapshot, upload_snapshot

__all__ = ["RedisSharedState", "cancel_tasks"]

log = logging.getLogger("kvrouter.shared")


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port:
        host += f":{parts.port}"
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit((parts.scheme, user + host, parts.path, parts.query, parts.fragment))


_RENEW_LUA = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE_LUA = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('del', KEYS[1])
end
return 0
"""


def sampled_keys(keys: Sequence[int], max_keys: int) -> list[int]:
    """What a speculative record tells the other replicas: every ``SAMPLE_STRIDE``-th key and
    the deepest (each names its whole prefix), at most ``max_keys``."""
    out = list(keys[SAMPLE_STRIDE - 1 :: SAMPLE_STRIDE][:max_keys])
    if len(keys) % SAMPLE_STRIDE and len(out) < max_keys:
        out.append(keys[-1])
    return out


async def cancel_tasks(tasks: Sequence[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait until they are done. Python 3.11's ``wait_for`` loses a
    cancellation that arrives as the awaited operation completes, and a loop that lost one runs
    on: each is cancelled again until it ends."""
    pending = set(tasks)
    while pending:
        for t in pending:
            t.cancel()
        done, pending = await asyncio.wait(pending, timeout=0.5)
        for t in done:
            if not t.cancelled():
                t.exception()  # retrieved: a loop that died of an error is not logged twice


class _SpecMsg(msgspec.Struct, array_like=True):
    replica: str
    url: str
    rank: int
    ttl_ms: int
    keys: list[int]


class _LoadMsg(msgspec.Struct, array_like=True):
    """One push of a replica's load, as published: its number and each engine whose record
    changed since the push before (``IDLE`` where it has nothing any more)."""

    replica: str
    n: int
    fields: dict[str, str]


PUSH_FIELD = "_n"
"""The field of a replica's load hash holding the number of the push that wrote it (not an
engine key: a replica that predates it skips the field as unparsable)."""
IDLE = "0,0,0"


def _parse_load(value: str | bytes) -> EngineLoad:
    req, pre, tok = (int(x) for x in value.split(b"," if isinstance(value, bytes) else ","))
    return EngineLoad(req, pre, tok)


@dataclass
class _Origin:
    """Another replica's load as this one knows it: the number of the latest push it reflects
    (-1: unknown) and its record per engine."""

    n: int = -1
    loads: dict[EngineId, EngineLoad] = field(default_factory=dict)


class RedisSharedState(SharedState):
    """Shared state in Redis (see the module docstring for keys, bounds and failure modes)."""

    backend = "redis"

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "{kvrouter}",
        heartbeat_ttl_s: float = 10.0,
        snapshot_interval_s: float = 30.0,
        op_timeout_s: float = 0.1,
        push_interval_s: float = 0.05,
        push_min_interval_s: float = 0.005,
        refresh_interval_s: float = 0.1,
        snapshot_timeout_s: float = 10.0,
        startup_timeout_s: float = 3.0,
        max_spec_keys: int = 2048,
        max_spec_queue: int = 10_000,
        backoff_s: tuple[float, float] = (0.1, 2.0),
        down_after_failures: int = 3,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        self.url = url
        self.prefix = key_prefix
        self.ttl_s = heartbeat_ttl_s
        self.snapshot_interval_s = snapshot_interval_s
        self.op_timeout_s = op_timeout_s
        self.push_interval_s = push_interval_s
        self.push_min_interval_s = push_min_interval_s
        self.refresh_interval_s = refresh_interval_s
        self.snapshot_timeout_s = snapshot_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.max_spec_keys = max_spec_keys
        self.backoff_s = backoff_s
        self.down_after_failures = down_after_failures
        """Consecutive failed calls before Redis counts as down: one slow call under load must
        not drop every other replica's load to zero and back (a herding signal)."""
        self._failures = 0
        self.k_load = f"{key_prefix}:load:{self.replica_id}"
        self.k_replicas = f"{key_prefix}:replicas"
        self.k_spec = f"{key_prefix}:spec"
        self.k_loads = f"{key_prefix}:loads"
        self.k_leader = f"{key_prefix}:snapshot:leader"
        self.k_snaps = f"{key_prefix}:snaps"
        self._up = False
        self._down_logged = False
        self._up_event = asyncio.Event()
        self._down_event = asyncio.Event()
        self._remote: dict[EngineId, EngineLoad] = {}
        self._origins: dict[str, _Origin] = {}
        """Per other live replica, its load: from its hash at each refresh, and from each push
        it publishes in between."""
        self._remote_dirty = False
        self._push_wake = asyncio.Event()
        self._push_n = time.time_ns() // 1000
        """The number of the last push. It starts at the wall clock's microseconds, so a
        replica restarted under the same id (a pod's name) numbers its pushes after the ones
        the others heard before the restart."""
        self._remote_at: float | None = None
        self._live_replicas: list[str] = []
        self._pushed: dict[str, str] | None = None
        self._last_heartbeat = 0.0
        self._spec_q: deque[bytes] = deque(maxlen=max_spec_queue)
        self._spec_wake = asyncio.Event()
        self._snapshots: dict[EngineId, Snapshot] = {}
        self._written: dict[EngineId, tuple[int, float | None]] = {}
        """(seq, batch timestamp) of each engine's snapshot as last written by this replica."""
        self._tasks: list[asyncio.Task[None]] = []
        self._channels: dict[bytes, Callable[[bytes], None]] = {
            self.k_spec.encode(): self._on_spec,
            self.k_loads.encode(): self._on_load,
        }
        self._client: Any = None
        self._bulk: Any = None
        self._pubsub_client: Any = None
        self.leader = False
        self.counters: dict[str, int] = {
            "redis_errors": 0,
            "transitions_down": 0,
            "load_pushes": 0,
            "load_refreshes": 0,
            "load_received": 0,
            "spec_published": 0,
            "spec_published_bytes": 0,
            "spec_received": 0,
            "spec_dropped": 0,
            "snapshots_written": 0,
            "snapshot_bytes_written": 0,
        }
        self.last_error: str | None = None
        self.last_snapshot_at: float | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def up(self) -> bool:
        return self._up

    def _make_client(self, timeout: float | None, **extra: Any) -> Any:
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        return aioredis.Redis.from_url(
            self.url,
            socket_timeout=timeout,
            socket_connect_timeout=self.op_timeout_s if timeout is None else min(timeout, 1.0),
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            **extra,
        )

    async def start(self) -> None:
        self._client = self._make_client(self.op_timeout_s, max_connections=32)
        self._bulk = self._make_client(self.snapshot_timeout_s, max_connections=4)
        self._pubsub_client = self._make_client(None, health_check_interval=5)
        if self.on_redis_up is not None:
            self.on_redis_up(False)
        deadline = time.monotonic() + self.startup_timeout_s
        await self._first_ping(deadline)
        if self._up:
            try:
                left = max(deadline - time.monotonic(), 0.1)
                await asyncio.wait_for(self._load_snapshots(), left)
            except Exception as exc:
                self.warm.load_error = f"{type(exc).__name__}: {exc}"
                log.warning("could not load index snapshots from Redis: %s", self.warm.load_error)
        loop = asyncio.get_running_loop()
        for name, coro in (
            ("push", self._push_loop()),
            ("refresh", self._refresh_loop()),
            ("probe", self._probe_loop()),
            ("spec-publish", self._spec_publish_loop()),
            ("listen", self._listen_loop()),
            ("snapshot", self._snapshot_loop()),
        ):
            self._tasks.append(loop.create_task(coro, name=f"kvrouter-shared-{name}"))

    async def _first_ping(self, deadline: float) -> None:
        """Ping until Redis answers or ``startup_timeout_s`` passes: one slow first answer (a
        cold connection on a busy node) is not an outage, so start reports down only when Redis
        stays silent for the whole startup window."""
        while True:
            try:
                await asyncio.wait_for(self._client.ping(), self.op_timeout_s * 5)
            except Exception as exc:
                if time.monotonic() + self.op_timeout_s >= deadline:
                    self._mark_down(exc)
                    return
                await asyncio.sleep(min(self.op_timeout_s, 0.1))
            else:
                self._mark_up()
                return

    async def stop(self) -> None:
        await cancel_tasks(self._tasks)
        self._tasks.clear()
        if self._up and self._client is not None:
            # Leave cleanly: our load disappears now instead of after the TTL.
            with contextlib.suppress(Exception):
                async with self._client.pipeline(transaction=True) as p:
                    p.delete(self.k_load)
                    p.zrem(self.k_replicas, self.replica_id)
                    await asyncio.wait_for(p.execute(), self.op_timeout_s * 3)
            if self.leader:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(
                        self._client.eval(_RELEASE_LUA, 1, self.k_leader, self.replica_id),
                        self.op_timeout_s * 3,
                    )
        for c in (self._client, self._bulk, self._pubsub_client):
            if c is not None:
                with contextlib.suppress(Exception):
                    await c.aclose()
        self._client = self._bulk = self._pubsub_client = None
        self._snapshots.clear()

    # ------------------------------------------------------------------ up / down

    def _mark_up(self) -> None:
        self._failures = 0
        if self._up:
            return
        self._up = True
        self._down_logged = False
        self._down_event.clear()
        self._up_event.set()
        self._last_heartbeat = 0.0  # push our contribution at once
        self._pushed = None
        log.info(
            "Redis shared state reachable at %s (replica %s)", _redact(self.url), self.replica_id
        )
        if self.on_redis_up is not None:
            self.on_redis_up(True)

    def _failed(self, exc: BaseException) -> None:
        """A call failed: Redis is down after ``down_after_failures`` in a row (at once while
        it is not up yet)."""
        self.counters["redis_errors"] += 1
        self.last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        self._failures += 1
        if not self._up or self._failures >= self.down_after_failures:
            self._mark_down(exc)

    def _mark_down(self, exc: BaseException) -> None:
        self.last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        was_up = self._up
        self._up = False
        self._up_event.clear()
        self._down_event.set()
        self._remote = {}  # degrade to this replica's own view
        self._origins.clear()
        self._remote_dirty = False
        self._remote_at = None
        self._live_replicas = []
        self.leader = False
        if self._down_logged:
            return  # one log line per transition
        self._down_logged = True
        self.counters["transitions_down"] += 1
        log.warning(
            "Redis shared state %s at %s (%s): routing on this replica's own state",
            "lost" if was_up else "unreachable",
            _redact(self.url),
            self.last_error,
        )
        if was_up and self.on_redis_up is not None:
            self.on_redis_up(False)  # (start() already reported the initial False)

    @property
    def client(self) -> Any:
        """The client other modules use through :meth:`call` (None before :meth:`start`)."""
        return self._client

    async def _call(self, aw: Any, timeout: float | None = None) -> Any:
        """Await one Redis operation with a hard bound; failures mark Redis down and raise."""
        try:
            out = await asyncio.wait_for(aw, timeout or self.op_timeout_s * 2)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._failed(exc)
            raise
        self._failures = 0
        return out

    call = _call  # other modules' operations: the same bounds and up/down accounting

    async def _probe_loop(self) -> None:
        lo, hi = self.backoff_s
        while True:
            await self._down_event.wait()
            delay = lo
            while not self._up:
                await asyncio.sleep(delay)
                try:
                    # Pooled connections from before the outage are dead: drop them all so the
                    # first calls after recovery do not fail (and flap the state) on them.
                    for c in (self._client, self._bulk):
                        with contextlib.suppress(Exception):
                            await asyncio.wait_for(c.connection_pool.disconnect(), 1.0)
                    await asyncio.wait_for(self._client.ping(), self.op_timeout_s * 2)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    delay = min(delay * 2, hi)
                    continue
                self._mark_up()

    # ------------------------------------------------------------------ load

    def remote_loads(self) -> Mapping[EngineId, EngineLoad]:
        if self._remote_dirty:  # a push heard since the last read: sum again, once
            self._remote_dirty = False
            self._remote = self._sum_origins()
        return self._remote

    def _sum_origins(self) -> dict[EngineId, EngineLoad]:
        remote: dict[EngineId, EngineLoad] = {}
        for origin in self._origins.values():
            for e, theirs in origin.loads.items():
                r = remote.get(e)
                remote[e] = theirs if r is None else r.plus(theirs)
        return remote

    def loads_changed(self) -> None:
        self._push_wake.set()

    def _local_fields(self) -> dict[str, str]:
        out = {}
        for e, ld in self.local_loads().items():
            if not ld.is_idle():
                out[engine_key(e)] = (
                    f"{ld.inflight_requests},{ld.prefilling_requests},{ld.queued_prefill_tokens}"
                )
        return out

    async def push_now(self, fields: dict[str, str] | None = None) -> None:
        """Write this replica's load hash (``fields``: its engines' records, read now unless
        given) and publish what changed since the last push, both under the push's number."""
        if fields is None:
            fields = self._local_fields()
        ttl_ms = max(int(self.ttl_s * 1000), 1)
        before = self._pushed or {}
        changed = {k: v for k, v in fields.items() if before.get(k) != v}
        changed.update((k, IDLE) for k in before if k not in fields)
        self._push_n += 1
        async with self._client.pipeline(transaction=True) as p:
            p.delete(self.k_load)
            # The push number keeps the hash present while the replica lives, idle or not.
            p.hset(self.k_load, mapping={**fields, PUSH_FIELD: str(self._push_n)})
            p.pexpire(self.k_load, ttl_ms)
            p.zadd(self.k_replicas, {self.replica_id: time.time()})
            if changed:
                msg = _LoadMsg(self.replica_id, self._push_n, changed)
                p.publish(self.k_loads, msgspec.msgpack.encode(msg))
            await self._call(p.execute())
        self._pushed = fields
        self._last_heartbeat = time.monotonic()
        self.counters["load_pushes"] += 1

    async def _push_loop(self) -> None:
        # Woken by every change of this replica's load, pushing at most once per
        # push_min_interval_s (what a burst of sends costs Redis) and looking at least once per
        # push_interval_s (a change nobody announced), with a heartbeat every third of the TTL.
        beat = self.ttl_s / 3
        while True:
            await self._up_event.wait()
            self._push_wake.clear()
            try:
                fields = self._local_fields()
                if time.monotonic() - self._last_heartbeat >= beat or fields != self._pushed:
                    await self.push_now(fields)
            except asyncio.CancelledError:
                raise
            except Exception:
                pass  # marked down by _call; the probe brings it back
            await asyncio.sleep(self.push_min_interval_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._push_wake.wait(),
                    max(self.push_interval_s - self.push_min_interval_s, 0.0),
                )

    def _on_load(self, data: bytes) -> None:
        try:
            msg = msgspec.msgpack.decode(data, type=_LoadMsg)
            if msg.replica == self.replica_id:
                return  # every replica hears its own pushes back: nothing to parse
            loads = {parse_engine_key(k): _parse_load(v) for k, v in msg.fields.items()}
        except (msgspec.MsgspecError, ValueError):
            return
        origin = self._origins.get(msg.replica)
        if origin is None:
            origin = self._origins[msg.replica] = _Origin()
        if msg.n <= origin.n:
            return  # a refresh already read a later push of it
        origin.n = msg.n
        for e, ld in loads.items():
            if ld.is_idle():
                origin.loads.pop(e, None)
            else:
                origin.loads[e] = ld
        self._remote_dirty = True
        self.counters["load_received"] += 1

    async def refresh_now(self) -> None:
        members = await self._call(self._client.zrange(self.k_replicas, 0, -1, withscores=True))
        others = [(m.decode() if isinstance(m, bytes) else str(m), float(s)) for m, s in members]
        others = [(m, s) for m, s in others if m != self.replica_id]
        live: list[str] = []
        stale: list[str] = []
        rows: list[Any] = []
        if others:
            async with self._client.pipeline(transaction=False) as p:
                for m, _ in others:
                    p.hgetall(f"{self.prefix}:load:{m}")
                rows = await self._call(p.execute())
        now = time.time()
        for (m, score), row in zip(others, rows, strict=True):
            if not row:
                # No hash: gone. Forget the member once it is well past its TTL.
                if now - score > 3 * self.ttl_s:
                    stale.append(m)
                continue
            live.append(m)
            n, loads = -1, {}
            for k, v in row.items():
                key = k.decode() if isinstance(k, bytes) else k
                try:
                    if key == PUSH_FIELD:
                        n = int(v)
                    else:
                        loads[parse_engine_key(key)] = _parse_load(v)
                except ValueError:
                    continue
            known = self._origins.get(m)
            if known is None or n < 0 or n >= known.n:
                self._origins[m] = _Origin(n, loads)
            # else: a push published while this read was under way is newer than the hash
        for m in set(self._origins) - set(live):
            del self._origins[m]
        if stale:
            with contextlib.suppress(Exception):
                await self._call(self._client.zrem(self.k_replicas, *stale))
        self._remote = self._sum_origins()
        self._remote_dirty = False
        self._remote_at = time.monotonic()
        self._live_replicas = live
        self.counters["load_refreshes"] += 1

    async def _refresh_loop(self) -> None:
        while True:
            await self._up_event.wait()
            try:
                await self.refresh_now()
            except asyncio.CancelledError:
                raise
            except Exception:
                pass
            await asyncio.sleep(self.refresh_interval_s)

    # ------------------------------------------------------------------ speculative

    def _publish_speculative(self, engine: Engine, keys: Sequence[int]) -> None:
        if not self._up:
            return  # nobody to tell; a replica that reconnects later does not need stale entries
        try:
            url, rank = engine  # type: ignore[misc]
            msg = _SpecMsg(
                self.replica_id,
                url,
                int(rank),
                int(self.speculative.ttl_s * 1000),
                sampled_keys(keys, self.max_spec_keys),
            )
        except (TypeError, ValueError):
            return
        if len(self._spec_q) == self._spec_q.maxlen:
            self.counters["spec_dropped"] += 1
        data = msgspec.msgpack.encode(msg)
        self.counters["spec_published_bytes"] += len(data)
        self._spec_q.append(data)
        self._spec_wake.set()

    async def _spec_publish_loop(self) -> None:
        while True:
            await self._spec_wake.wait()
            self._spec_wake.clear()
            if not self._up:
                self.counters["spec_dropped"] += len(self._spec_q)
                self._spec_q.clear()
                continue
            batch = []
            while self._spec_q and len(batch) < 256:
                batch.append(self._spec_q.popleft())
            if self._spec_q:
                self._spec_wake.set()
            try:
                async with self._client.pipeline(transaction=False) as p:
                    for m in batch:
                        p.publish(self.k_spec, m)
                    await self._call(p.execute())
                self.counters["spec_published"] += len(batch)
            except asyncio.CancelledError:
                raise
            except Exception:
                self.counters["spec_dropped"] += len(batch)

    def _on_spec(self, data: bytes) -> None:
        try:
            msg = msgspec.msgpack.decode(data, type=_SpecMsg)
        except msgspec.MsgspecError:
            return
        if msg.replica == self.replica_id or not msg.keys:
            return
        self.counters["spec_received"] += 1
        # The sender's TTL, on this replica's clock: its record lasts as long as it meant,
        # and retires nothing of this replica's own before their time.
        ttl = msg.ttl_ms / 1000.0
        self.speculative.record_remote((msg.url, msg.rank), msg.keys, time.monotonic(), ttl)

    def listen(self, channel: str, handler: Callable[[bytes], None]) -> None:
        """Hand every message on ``<prefix>:<channel>`` to ``handler`` (register before
        :meth:`start`). Pub/sub is fire-and-forget: messages sent while disconnected are lost."""
        self._channels[f"{self.prefix}:{channel}".encode()] = handler

    async def _listen_loop(self) -> None:
        lo, hi = self.backoff_s
        delay = lo
        while True:
            pubsub = self._pubsub_client.pubsub(ignore_subscribe_messages=True)
            try:
                await asyncio.wait_for(pubsub.subscribe(*self._channels), self.op_timeout_s * 5)
                delay = lo
                while True:
                    m = await pubsub.get_message(timeout=1.0)
                    if m is not None and m.get("type") == "message":
                        self._channels[m["channel"]](m["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("pub/sub channels: %s", exc)
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(pubsub.aclose(), 1.0)
            await asyncio.sleep(delay)
            delay = min(delay * 2, hi)

    # ------------------------------------------------------------------ snapshots

    def _snap_key(self, engine: EngineId) -> str:
        return f"{self.prefix}:snap:{engine_key(engine)}"

    async def _load_snapshots(self) -> None:
        names = await self._call(self._bulk.zrange(self.k_snaps, 0, -1), self.snapshot_timeout_s)
        keys = [n.decode() if isinstance(n, bytes) else str(n) for n in names]
        if not keys:
            return
        async with self._bulk.pipeline(transaction=False) as p:
            for k in keys:
                p.hgetall(f"{self.prefix}:snap:{k}")
            rows = await self._call(p.execute(), self.snapshot_timeout_s)
        for k, row in zip(keys, rows, strict=True):
            if not row:
                continue
            try:
                engine = parse_engine_key(k)
                snap = Snapshot(
                    engine=engine,
                    data=bytes(row[b"data"]),
                    seq=int(row[b"seq"]),
                    written_at=float(row[b"ts"]),
                    blocks=int(row.get(b"blocks", b"0")),
                    writer=row.get(b"writer", b"?").decode(errors="replace"),
                    event_ts=float(row[b"event_ts"]) if row.get(b"event_ts") else None,
                )
            except (KeyError, ValueError):
                continue
            self._snapshots[engine] = snap
        self.warm.snapshots_found = len(self._snapshots)
        log.info("loaded %d index snapshots from Redis", len(self._snapshots))

    def take_snapshot(self, engine: EngineId) -> Snapshot | None:
        return self._snapshots.pop(engine, None)

    async def _hold_lease(self) -> bool:
        lease_ms = int((2 * self.snapshot_interval_s + self.ttl_s) * 1000)
        if self.leader:
            ok = await self._call(
                self._client.eval(_RENEW_LUA, 1, self.k_leader, self.replica_id, lease_ms)
            )
            self.leader = bool(ok)
        if not self.leader:
            ok = await self._call(
                self._client.set(self.k_leader, self.replica_id, nx=True, px=lease_ms)
            )
            self.leader = bool(ok)
        return self.leader

    async def write_snapshots(self) -> int:
        """Write every exact engine's snapshot (leader only; returns how many were written)."""
        expire_ms = int(max(10 * self.snapshot_interval_s, 600.0) * 1000)
        n = 0
        for engine in list(self.snapshot_engines()):
            got = self.export_engine(engine)  # sync: the state and its seq of one instant
            if got is None:
                continue
            snapshot, seq, blocks, event_ts = got
            # A restarted engine counts its seqs from 0 again: the same seq with another
            # batch timestamp is another state.
            mark = (seq, event_ts)
            key = self._snap_key(engine)
            try:
                if self._written.get(engine) != mark:
                    size = await upload_snapshot(
                        self._call_bulk, self._bulk, key, snapshot, expire_ms
                    )
                    self.counters["snapshot_bytes_written"] += size
            except ExportAborted as exc:  # the engine was reset meanwhile: next round
                log.debug("snapshot of %s abandoned: %s", engine, exc)
                continue
            finally:
                close_snapshot(snapshot)
            now = time.time()
            async with self._bulk.pipeline(transaction=True) as p:
                if self._written.get(engine) == mark:
                    p.hset(key, "ts", repr(now))  # unchanged since the last write: re-confirm
                else:
                    commit_snapshot(p, key, seq, now, blocks, self.replica_id, event_ts)
                p.pexpire(key, expire_ms)
                p.zadd(self.k_snaps, {engine_key(engine): now})
                await self._call(p.execute(), self.snapshot_timeout_s)
            self._written[engine] = mark
            n += 1
            self.counters["snapshots_written"] += 1
            await asyncio.sleep(0)  # one engine at a time: keep the loop responsive
        # Forget index entries whose snapshot expired.
        cutoff = time.time() - expire_ms / 1000.0
        await self._call(self._client.zremrangebyscore(self.k_snaps, "-inf", cutoff))
        self.last_snapshot_at = time.time()
        return n

    def _call_bulk(self, aw: Any) -> Any:
        return self._call(aw, self.snapshot_timeout_s)

    async def _snapshot_loop(self) -> None:
        while True:
            await asyncio.sleep(self.snapshot_interval_s)
            if not self._up:
                continue
            try:
                if await self._hold_lease():
                    await self.write_snapshots()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("snapshot round failed: %s", exc)

    # ------------------------------------------------------------------ debug

    def status(self) -> dict[str, Any]:
        out = super().status()
        age = None if self._remote_at is None else time.monotonic() - self._remote_at
        out.update(
            {
                "url": _redact(self.url),
                "key_prefix": self.prefix,
                "heartbeat_ttl_s": self.ttl_s,
                "snapshot_interval_s": self.snapshot_interval_s,
                "other_replicas": list(self._live_replicas),
                "remote_load_age_s": None if age is None else round(age, 3),
                "staleness_bound_s": round(
                    self.push_interval_s + self.refresh_interval_s + 4 * self.op_timeout_s, 3
                ),
                "push": self._push_n,
                "heard": {m: o.n for m, o in sorted(self._origins.items())},
                "remote_inflight": {
                    engine_key(e): r.inflight_requests
                    for e, r in sorted(self.remote_loads().items())
                },
                "snapshot_leader": self.leader,
                "last_snapshot_at": self.last_snapshot_at,
                "last_error": self.last_error,
                "counters": dict(self.counters),
            }
        )
        return out
