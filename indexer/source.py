"""The subscriber's record of one event source, and the status it reports.

A source is one vLLM scheduler, ``(worker_id, dp_rank)``. Its record holds what the subscriber's
plumbing needs -- the queue of received messages, the socket, the replay task, the transport
counters -- around the :class:`~indexer.source_state.SourceState` that decides what its messages
mean.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

import msgspec

from indexer.feed import Feed
from indexer.index import EngineId
from indexer.source_state import SourceState
from indexer.wire import DecodedBatch

__all__ = ["Source", "SourceStatus"]


class SourceStatus(msgspec.Struct):
    """Health of one (worker_id, dp_rank) event source, for /debug and /metrics."""

    worker_id: str
    dp_rank: int
    endpoint: str
    replay_endpoint: str | None
    connected: bool
    last_seq: int | None
    last_event_ts: float | None
    """The ``ts`` (publisher wall clock) of the last applied batch."""
    batches: int
    events: int
    blocks: int
    """Blocks the index currently holds for this engine (all groups and media)."""
    events_per_s: float
    """Applied events per second over the last ~10 s."""
    gaps: int
    replays_ok: int
    replays_failed: int
    resets: int
    restarts: int
    decode_errors: int
    garbage_frames: int
    queue_overflows: int
    queue_depth: int
    degraded: bool
    degraded_reason: str | None
    last_applied_at: float | None = None
    """Local wall clock when the last batch was applied."""
    lag_s: float | None = None
    """``last_applied_at - last_event_ts`` of the last batch (includes clock skew)."""
    duplicates: int = 0
    """Live batches skipped because a replay had already applied them."""
    replaying: bool = False
    resync_restarts: int = 0
    """Publisher restarts found while the source was resyncing (also in ``restarts``)."""


@dataclass(eq=False, slots=True)
class Source:
    worker_id: str
    dp_rank: int
    endpoint: str
    replay_endpoint: str | None
    state: SourceState
    queue: deque[tuple[int, bytes, DecodedBatch | None]] = field(default_factory=deque)
    """Received messages ``(seq, payload, decoded batch or None)``, oldest first, and the
    subscriber's markers (e.g. where the socket reconnected)."""
    queued_bytes: int = 0
    """Payload bytes in ``queue`` (bounded by ``Subscriber.queue_bytes``)."""
    feed: Feed | None = None
    topic: str | None = None
    """Bound topology only: the worker's exact topic."""
    removed: bool = False
    seen: bool = False
    """A message of this source arrived (bound topology: the publisher is connected)."""
    last_applied_at: float | None = None
    decode_errors: int = 0
    garbage_frames: int = 0
    queue_overflows: int = 0
    replay_task: asyncio.Task[None] | None = None
    rate: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=11))
    """``(wall clock, events applied)`` samples, one per second at most."""
    engine: EngineId = field(init=False)
    """``(worker_id, dp_rank)``, built once: every applied batch is keyed by it."""

    def __post_init__(self) -> None:
        self.engine = (self.worker_id, self.dp_rank)

    def applied(self, now: float) -> None:
        """A batch was applied at wall clock ``now``."""
        self.last_applied_at = now
        rate = self.rate
        if not rate or now - rate[-1][0] >= 1.0:
            rate.append((now, self.state.events))

    def events_per_s(self, now: float) -> float:
        """Events per second over the samples of the last ~10 s (0 when idle that long)."""
        samples = [(t, n) for t, n in self.rate if now - t <= 10.5]
        if not samples:
            return 0.0
        t0, n0 = samples[0]
        span = max(now - t0, 1.0)
        return (self.state.events - n0) / span

    def status(self, endpoint: str, connected: bool, blocks: int, now: float) -> SourceStatus:
        state = self.state
        lag = (
            self.last_applied_at - state.last_event_ts
            if self.last_applied_at is not None and state.last_event_ts is not None
            else None
        )
        return SourceStatus(
            worker_id=self.worker_id,
            dp_rank=self.dp_rank,
            endpoint=endpoint,
            replay_endpoint=self.replay_endpoint,
            connected=connected,
            last_seq=state.last_seq,
            last_event_ts=state.last_event_ts,
            batches=state.batches,
            events=state.events,
            blocks=blocks,
            events_per_s=self.events_per_s(now),
            gaps=state.gaps,
            replays_ok=state.replays_ok,
            replays_failed=state.replays_failed,
            resets=state.resets,
            restarts=state.restarts,
            decode_errors=self.decode_errors,
            garbage_frames=self.garbage_frames,
            queue_overflows=self.queue_overflows,
            queue_depth=len(self.queue),
            degraded=state.degraded,
            degraded_reason=state.degraded_reason,
            last_applied_at=self.last_applied_at,
            lag_s=lag,
            duplicates=state.duplicates,
            replaying=self.replay_task is not None,
            resync_restarts=state.resync_restarts,
        )
