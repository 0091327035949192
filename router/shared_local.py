"""The embedded shared state (one replica's own view) and the types every implementation shares.

:class:`SharedState` is what the router uses without ``redis.url``: nothing leaves the process,
other replicas contribute no load, no speculative entry is published, and no index snapshot is
loaded. :class:`router.shared_redis.RedisSharedState` extends it with Redis.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from indexer.index import EngineId
from indexer.subscriber import Subscriber
from router.load import EngineLoad
from router.policy import Engine, SpeculativeCache

__all__ = [
    "ExportedEngine",
    "SharedSpeculativeCache",
    "SharedState",
    "Snapshot",
    "WarmStart",
    "engine_key",
    "parse_engine_key",
    "seed_subscriber",
]

ExportedEngine = tuple[bytes | Iterable[bytes], int, int, float | None]
"""(snapshot, last applied seq, resident blocks, that batch's ts), all of one instant. The
snapshot is ``PrefixIndex.export_engine`` bytes or an ``export_engine_chunks`` exporter, whose
pieces the writer joins a slice at a time (the exporter describes the engine as of that seq)."""

_NO_LOAD = EngineLoad()
_NO_LOADS: Mapping[EngineId, EngineLoad] = {}


def engine_key(engine: EngineId) -> str:
    return f"{engine[0]}#{engine[1]}"


def parse_engine_key(key: str) -> EngineId:
    url, sep, rank = key.rpartition("#")
    if not sep:
        raise ValueError(f"not an engine key: {key!r}")
    return url, int(rank)


def new_replica_id() -> str:
    """Pod name (hostname) + pid + random: a restarted replica never reuses an old id."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass(slots=True)
class Snapshot:
    engine: EngineId
    data: bytes
    seq: int
    written_at: float
    """Writer's wall clock (``time.time()``) when the snapshot was written or re-confirmed."""
    blocks: int
    writer: str
    event_ts: float | None = None
    """Publisher ``ts`` of batch ``seq`` (lets the subscriber tell a restarted engine apart)."""


@dataclass
class WarmStart:
    """How warm this replica started (``/debug/index``)."""

    snapshots_found: int = 0
    engines_loaded: int = 0
    blocks: int = 0
    min_age_s: float | None = None
    max_age_s: float | None = None
    engines: list[dict[str, Any]] = field(default_factory=list)
    load_error: str | None = None

    def add(self, snap: Snapshot, blocks: int) -> None:
        age = max(time.time() - snap.written_at, 0.0)
        self.engines_loaded += 1
        self.blocks += blocks
        self.min_age_s = age if self.min_age_s is None else min(self.min_age_s, age)
        self.max_age_s = age if self.max_age_s is None else max(self.max_age_s, age)
        if len(self.engines) < 256:
            self.engines.append(
                {
                    "engine": engine_key(snap.engine),
                    "seq": snap.seq,
                    "blocks": blocks,
                    "age_s": round(age, 3),
                    "writer": snap.writer,
                }
            )


class SharedSpeculativeCache(SpeculativeCache):
    """A :class:`SpeculativeCache` whose local records are also handed to ``publish``."""

    def __init__(
        self,
        ttl_s: float = 2.0,
        max_keys: int = 1_000_000,
        publish: Callable[[Engine, Sequence[int]], None] | None = None,
    ) -> None:
        super().__init__(ttl_s, max_keys)
        self.publish = publish

    def record_remote(
        self, engine: Engine, keys: Sequence[int], now: float, ttl_s: float | None = None
    ) -> None:
        """An entry another replica published (not re-published), lasting its ``ttl_s``."""
        self.record(engine, keys, now, ttl_s, share=False)


def seed_subscriber(
    subscriber: Subscriber, engine: EngineId, seq: int, event_ts: float | None = None
) -> bool:
    """Make ``subscriber`` treat ``engine`` as already applied up to ``seq`` (a snapshot);
    see :meth:`indexer.subscriber.Subscriber.seed_seq`. False: too late, drop the snapshot."""
    return bool(subscriber.seed_seq(engine, seq, event_ts))


class SharedState:
    """Embedded, in-memory shared state: a single replica's own view (no Redis)."""

    backend = "memory"

    def __init__(
        self,
        *,
        speculative_ttl_s: float = 2.0,
        speculative_max_keys: int = 1_000_000,
        replica_id: str | None = None,
        local_loads: Callable[[], Mapping[EngineId, EngineLoad]] | None = None,
        snapshot_engines: Callable[[], Sequence[EngineId]] | None = None,
        export_engine: Callable[[EngineId], ExportedEngine | None] | None = None,
        on_redis_up: Callable[[bool], None] | None = None,
    ) -> None:
        self.replica_id = replica_id or new_replica_id()
        self.local_loads = local_loads or dict
        self.snapshot_engines = snapshot_engines or list
        self.export_engine = export_engine or (lambda _e: None)
        self.on_redis_up = on_redis_up
        self.speculative = SharedSpeculativeCache(
            speculative_ttl_s, speculative_max_keys, publish=self._publish_speculative
        )
        self.warm = WarmStart()

    @property
    def up(self) -> bool:
        """Whether Redis is reachable (always False without Redis)."""
        return False

    async def start(self) -> None:
        if self.on_redis_up is not None:
            self.on_redis_up(False)

    async def stop(self) -> None:
        return None

    def loads_changed(self) -> None:
        """This replica's load on some engine changed: tell the other replicas soon."""
        return None

    def remote_load(self, engine: EngineId) -> EngineLoad:
        """The other replicas' summed accounting for ``engine`` (zero when they have none)."""
        return self.remote_loads().get(engine, _NO_LOAD)

    def remote_loads(self) -> Mapping[EngineId, EngineLoad]:
        """The other replicas' summed accounting per engine (engines without any are absent).
        The mapping is replaced, never changed in place: a caller may keep it."""
        return _NO_LOADS

    def take_snapshot(self, engine: EngineId) -> Snapshot | None:
        """The snapshot loaded at start for ``engine`` (each is handed out once)."""
        return None

    def _publish_speculative(self, engine: Engine, keys: Sequence[int]) -> None:
        return None

    def status(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "replica_id": self.replica_id,
            "redis_up": self.up,
            "warm_start": _warm_dict(self.warm),
        }


def _warm_dict(w: WarmStart) -> dict[str, Any]:
    return {
        "warm": w.engines_loaded > 0,
        "snapshots_found": w.snapshots_found,
        "engines_loaded": w.engines_loaded,
        "blocks": w.blocks,
        "min_snapshot_age_s": None if w.min_age_s is None else round(w.min_age_s, 3),
        "max_snapshot_age_s": None if w.max_age_s is None else round(w.max_age_s, 3),
        "engines": w.engines,
        "load_error": w.load_error,
    }
