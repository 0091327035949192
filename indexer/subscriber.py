"""Subscribe to vLLM KV-cache event streams and keep a :class:`PrefixIndex` in step with them.

One *source* is one vLLM scheduler: ``(worker_id, dp_rank)``, with its own sequence numbers.
What a source's messages mean -- in order, gap, replay, restart, degraded -- is decided by its
:class:`~indexer.source_state.SourceState` (the rules are in that module's docstring); this module
owns the sockets, queues and tasks around it and carries out the actions it returns.

Topologies (docs/vllm-reference.md §2.2):

* **connect** (vLLM binds ``tcp://*:P``): one SUB socket per worker and DP rank, connected to
  ``P + rank``; replay (DEALER) at ``replay_port + rank``.
* **bind** (vLLM connects out to us): one SUB socket bound at ``bind``; a message belongs to the
  worker whose topic equals its topic frame, the rank comes from the batch's
  ``data_parallel_rank``.

Data path, all on the event-loop thread (the index is single-threaded):

    socket --reader callback on ZMQ_FD (NOBLOCK, <= RECV_BATCH per turn)--> per-source bounded deque
           --applier turn (<= APPLY_BATCH msgs / APPLY_BUDGET_S per turn)--> decode -> SourceState
           --actions--> index.apply / clear_engine, replay task, on_reset

Reader and applier both return to the loop after bounded work, so a flood never starves it. Both
are plain loop callbacks, and no future or task changes hands per message: a connected socket's
reader turn applies what it queued right away (up to ``APPLY_BATCH`` messages); whatever is left,
and the bound socket's messages, go to applier turns scheduled with ``call_soon``, each of which
schedules the next while work is left.
A full deque drops the newest message (``queue_overflows``) and that seq becomes an ordinary gap:
memory stays bounded by ``queue_depth`` messages and ``queue_bytes`` payload bytes per source, plus
ZMQ's RCVHWM (``queue_depth`` messages).
While a replay is in flight the source's live messages stay queued; the replay runs in its own
task (:mod:`indexer.resync`, at most ``replay_concurrency`` at once) and feeds its batches to the
state in order.

A silent socket changes nothing (vLLM 0.33 sends no heartbeat; an idle engine is not an empty
one); :mod:`indexer.feed` reconnects and detects dead peers. A reconnect is queued in its place
among the source's messages, and the state then verifies the publisher before taking the next.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from indexer.endpoints import concrete_endpoint, offset_endpoint, resolve_endpoint
from indexer.feed import Feed, FeedOptions
from indexer.index import EngineId, PrefixIndex
from indexer.pacer import Pacer
from indexer.resync import Resync
from indexer.source import Source, SourceStatus
from indexer.source_state import (
    Action,
    Apply,
    MarkDegraded,
    MarkRebuilt,
    RequestReplay,
    ResetEngine,
    SourceState,
)
from indexer.wire import DecodedBatch, DecodeError, decode_payload

__all__ = ["SourceStatus", "Subscriber", "concrete_endpoint"]

log = logging.getLogger(__name__)

RECV_BATCH = 256
"""Messages a reader takes off its socket before yielding to the loop."""
RECV_BUDGET_S = 0.0005
"""...or this much time, whichever comes first (checked after every message): a flood of junk
on a socket costs every HTTP request at most this plus one message per loop turn
(tests/faults/test_garbage.py)."""
READ_INTERVAL_S = 0.002
"""While messages come faster than one per this, the sockets are read on a timer of this period
instead of per message (indexer.pacer): the most a message waits longer to be applied."""
APPLY_BATCH = 64
"""Messages the applier takes from one source before moving to the next."""
APPLY_BUDGET_S = 0.004
"""Applier time slice before it yields to the loop (readers, HTTP handlers)."""

_UNDECODABLE = DecodedBatch(0.0, [])
"""Queue marker: this message's payload failed to decode (counted once)."""
_RECONNECTED = DecodedBatch(0.0, [])
"""Queue entry: the SUB reconnected here; the messages queued before it came over the old
connection, the ones after it over the new one."""


@dataclass(eq=False, slots=True)
class _BoundWorker:
    worker_id: str
    topic: bytes
    sources: dict[int, Source]


class Subscriber:
    """Feed a :class:`PrefixIndex` from vLLM ZMQ KV-event streams (see the module docstring).

    Extensions beyond the base contract: ``rebuild_batches``/``rebuild_s`` (when degradation
    clears), ``on_batch(engine, seq, batch)`` called after every applied batch (lag metrics,
    benches), ``add_bound_worker(..., replay_endpoint=)``, :attr:`bound_endpoint`,
    :attr:`unrouted_frames` (bound socket: messages of no registered topic).
    """

    def __init__(
        self,
        index: PrefixIndex,
        *,
        topic: str = "",
        queue_depth: int = 10_000,
        queue_bytes: int = 64 << 20,
        replay_timeout_s: float = 2.0,
        replay_concurrency: int = 4,
        bind: str | None = None,
        reconnect_backoff_s: tuple[float, float] = (0.1, 5.0),
        on_reset: Callable[[EngineId, str], None] | None = None,
        rebuild_batches: int = 256,
        rebuild_s: float = 30.0,
        on_batch: Callable[[EngineId, int, DecodedBatch], None] | None = None,
        heartbeat_s: float = 5.0,
        read_interval_s: float = READ_INTERVAL_S,
    ) -> None:
        if queue_depth < 1 or replay_concurrency < 1 or queue_bytes < 1:
            raise ValueError("queue_depth, queue_bytes and replay_concurrency must be >= 1")
        self.index = index
        self.topic = topic
        self.queue_depth = queue_depth
        self.queue_bytes = queue_bytes
        """Payload bytes a source may hold queued: a few huge batches bound memory like many."""
        self.replay_timeout_s = replay_timeout_s
        self.replay_concurrency = replay_concurrency
        self.bind = bind
        self.reconnect_backoff_s = reconnect_backoff_s
        self.on_reset = on_reset
        self.rebuild_batches = rebuild_batches
        self.rebuild_s = rebuild_s
        self.on_batch = on_batch
        self.heartbeat_s = heartbeat_s
        self.pacer = Pacer(read_interval_s)
        """Reads the sockets on a timer while messages come faster than it (indexer.pacer)."""
        self.unrouted_frames = 0
        self.bound_endpoint: str | None = None
        self._sources: dict[EngineId, Source] = {}
        self._workers: dict[str, list[Source]] = {}
        self._bound: dict[bytes, _BoundWorker] = {}
        self._feeds: dict[EngineId, Feed] = {}
        self._bound_feed: Feed | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._ready: dict[Source, None] = {}  # ordered set of sources with work
        self._loop: asyncio.AbstractEventLoop | None = None
        self._applier: asyncio.Handle | None = None
        """The scheduled applier turn, if any."""
        self._resync: Resync | None = None
        self._running = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._running:
            return
        self._running = True
        self._ctx = zmq.asyncio.Context()
        self._loop = asyncio.get_running_loop()
        self._resync = Resync(
            self._ctx, self.replay_timeout_s, self.replay_concurrency, self._run, self._resume
        )
        if self.bind is not None:
            self._bound_feed = self._open_feed(self.bind, None)
        for src in self._sources.values():
            if src.feed is None and src.topic is None:  # (bound sources share the bound feed)
                self._feeds[src.engine] = self._open_feed(src.endpoint, src)
        for src in self._sources.values():
            if src.queue:
                self._ready[src] = None
        self._kick()

    async def stop(self) -> None:
        if not self._running:
            return
        self._running = False
        if self._applier is not None:
            self._applier.cancel()
            self._applier = None
        self.pacer.close()
        tasks = [s.replay_task for s in self._sources.values() if s.replay_task is not None]
        feeds = self._all_feeds()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for feed in feeds:
            feed.close()
        for src in self._sources.values():
            src.feed = None
            src.replay_task = None
        self._feeds.clear()
        self._bound_feed = None
        self._loop = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    # ------------------------------------------------------------------ workers

    def add_worker(
        self,
        worker_id: str,
        events_endpoint: str,
        replay_endpoint: str | None = None,
        dp_size: int = 1,
        model: str = "",
        host: str | None = None,
    ) -> None:
        """Subscribe to a worker's DP ranks at ``port + rank`` (connect topology)."""
        if worker_id in self._workers:
            raise ValueError(f"worker {worker_id!r} is already subscribed")
        if dp_size < 1:
            raise ValueError("dp_size must be >= 1")
        sources = []
        for rank in range(dp_size):
            ep = resolve_endpoint(events_endpoint, host, rank)
            rep = resolve_endpoint(replay_endpoint, host, rank) if replay_endpoint else None
            sources.append(self._new_source(worker_id, rank, ep, rep))
        self._workers[worker_id] = sources
        for src in sources:
            self._sources[src.engine] = src
            self.index.add_engine(src.engine, model)
            if self._running:
                self._feeds[src.engine] = self._open_feed(src.endpoint, src)

    def add_bound_worker(
        self,
        worker_id: str,
        topic: str,
        dp_size: int = 1,
        model: str = "",
        replay_endpoint: str | None = None,
    ) -> None:
        """Inverted topology: messages on the bound socket with this exact topic are this
        worker's; the rank is the batch's ``data_parallel_rank``."""
        if self.bind is None:
            raise ValueError("add_bound_worker needs Subscriber(bind=...)")
        if worker_id in self._workers:
            raise ValueError(f"worker {worker_id!r} is already subscribed")
        key = topic.encode()
        if key in self._bound:
            raise ValueError(f"topic {topic!r} already belongs to {self._bound[key].worker_id!r}")
        if not key.startswith(self.topic.encode()):
            raise ValueError(f"topic {topic!r} is outside the subscribed prefix {self.topic!r}")
        sources = {
            rank: self._new_source(
                worker_id,
                rank,
                f"{self.bind}#{topic}",
                offset_endpoint(replay_endpoint, rank) if replay_endpoint else None,
                topic=topic,
            )
            for rank in range(dp_size)
        }
        self._bound[key] = _BoundWorker(worker_id, key, sources)
        self._workers[worker_id] = list(sources.values())
        for src in sources.values():
            src.feed = self._bound_feed
            self._sources[src.engine] = src
            self.index.add_engine(src.engine, model)

    def remove_worker(self, worker_id: str) -> None:
        """Close the worker's sockets and drop its state from the index (every rank)."""
        sources = self._workers.pop(worker_id, None)
        if sources is None:
            return
        for key, bw in list(self._bound.items()):
            if bw.worker_id == worker_id:
                del self._bound[key]
        for src in sources:
            src.removed = True
            src.queue.clear()
            src.queued_bytes = 0
            self._ready.pop(src, None)
            if src.replay_task is not None:
                src.replay_task.cancel()
                src.replay_task = None
            feed = self._feeds.pop(src.engine, None)
            if feed is not None:
                feed.close()
            src.feed = None
            self._sources.pop(src.engine, None)
            self.index.remove_engine(src.engine)

    def drop_worker_state(self, worker_id: str, reason: str) -> int:
        """The worker went away (dead or unreachable): drop its index state, keep listening.

        Every rank is cleared and marked degraded (``resets += 1``); the sockets stay connected
        and the sequence state is kept, so a restarted worker (its seqs start again at 0) is
        recognised as a restart and rebuilt exactly, while a worker that was only unreachable
        is rebuilt by the usual rules. A replay in flight is cancelled: its answer describes
        the state just dropped. Returns the number of ranks cleared (0 if unknown or already
        dropped).
        """
        n = 0
        for src in self._workers.get(worker_id, []):
            state = src.state
            if state.degraded and state.degraded_reason == reason:
                continue  # already dropped for this outage
            if self._resync is not None:
                self._resync.cancel(src)
            self._run(src, state.reset(reason, time.monotonic()))
            n += 1
        return n

    def redial_worker(self, worker_id: str) -> int:
        """The worker answers again: dial its event sockets now rather than at ZMQ's next
        backed-off retry (:meth:`indexer.feed.Feed.redial`). Returns how many were dialled."""
        return sum(
            1
            for src in self._workers.get(worker_id, [])
            if src.topic is None and src.feed is not None and src.feed.redial()
        )

    def _new_source(
        self, worker_id: str, rank: int, endpoint: str, replay: str | None, topic: str | None = None
    ) -> Source:
        batches, seconds = self.rebuild_batches, self.rebuild_s
        state = SourceState(
            can_replay=replay is not None, rebuild_batches=batches, rebuild_s=seconds
        )
        return Source(worker_id, rank, endpoint, replay, state, topic=topic)

    # ------------------------------------------------------------------ inspection

    def status(self) -> list[SourceStatus]:
        now = time.time()
        return [self._status(src, now) for src in self._sources.values()]

    def _status(self, src: Source, now: float) -> SourceStatus:
        feed = src.feed if src.feed is not None else self._bound_feed
        endpoint = src.endpoint
        if src.topic is not None:
            connected = bool(feed is not None and feed.peers > 0 and src.seen)
            endpoint = f"{self.bound_endpoint or self.bind}#{src.topic}"
        else:
            connected = bool(feed is not None and feed.peers > 0)
        return src.status(endpoint, connected, self.index.resident_blocks(src.engine), now)

    def seed_seq(self, engine: EngineId, seq: int, event_ts: float | None = None) -> bool:
        """Treat ``engine`` as already applied up to ``seq`` (its index state was imported from
        a snapshot taken at that seq). Call right after :meth:`add_worker`, before any message
        of that engine is consumed; returns False (import nothing) if it is too late.

        ``event_ts`` is the ``ts`` of the snapshot's batch ``seq``. The first live batch then
        waits for a replay from ``seq``, whose first batch must carry ``event_ts``: an engine
        that restarted since the snapshot (whatever seq it reached) is cleared and rebuilt from
        its replay; the same publisher goes on from ``seq + 1``; a replay that cannot reach
        back resets the engine (exact or empty, never wrong). A seq ``<= seq`` is a restart at
        once. Without a replay endpoint or ``event_ts`` nothing could verify the snapshot, so
        this returns False.
        """
        src = self._sources.get(engine)
        if src is None or src.queue:
            return False
        return src.state.seed(seq, event_ts)

    def is_degraded(self, engine: EngineId) -> bool:
        src = self._sources.get(engine)
        return bool(src is not None and src.state.degraded)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until every socket and queue is drained and no replay is in flight."""
        deadline = time.monotonic() + timeout
        while True:
            if self._idle():
                await asyncio.sleep(0.005)  # let in-flight reader turns finish
                if self._idle():
                    return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.005)

    def _idle(self) -> bool:
        if any(s.queue or s.replay_task is not None for s in self._sources.values()):
            return False
        return not any(feed.has_input() for feed in self._all_feeds())

    def _all_feeds(self) -> list[Feed]:
        bound = [] if self._bound_feed is None else [self._bound_feed]
        return [*self._feeds.values(), *bound]

    # ------------------------------------------------------------------ sockets

    def _open_feed(self, endpoint: str, src: Source | None) -> Feed:
        """Open the bound socket (``src`` None) or the connected one of ``src``."""
        assert self._ctx is not None
        options = FeedOptions(
            self.topic,
            self.queue_depth,
            self.reconnect_backoff_s,
            self.heartbeat_s,
            RECV_BATCH,
            RECV_BUDGET_S,
        )
        if src is None:
            feed = Feed(
                self._ctx,
                endpoint,
                options,
                bind=True,
                on_message=self._route_bound,
                on_read=self._kick,
                pacer=self.pacer,
            )
            self.bound_endpoint = feed.endpoint
            for bw in self._bound.values():
                for s in bw.sources.values():
                    s.feed = feed
        else:
            feed = Feed(
                self._ctx,
                endpoint,
                options,
                bind=False,
                on_message=functools.partial(self._route_connect, src),
                on_read=functools.partial(self._read_done, src),
                on_reconnect=functools.partial(self._reconnected, src),
                pacer=self.pacer,
            )
            src.feed = feed
        return feed

    def _route_connect(self, src: Source, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            src.garbage_frames += 1
            return
        self._enqueue(src, int.from_bytes(frames[1], "big"), frames[2], None)

    def _route_bound(self, frames: list[bytes]) -> None:
        bw = self._bound.get(frames[0]) if frames else None
        if bw is None:
            self.unrouted_frames += 1
            return
        first = next(iter(bw.sources.values()))
        if len(frames) != 3 or len(frames[1]) != 8:
            first.garbage_frames += 1
            return
        seq = int.from_bytes(frames[1], "big")
        try:
            batch = decode_payload(frames[2])
        except DecodeError:
            if len(bw.sources) == 1:
                self._enqueue(first, seq, frames[2], None)  # a lost batch of the only rank
            else:
                first.decode_errors += 1  # rank unknown: its next seq will show the gap
            return
        src = bw.sources.get(batch.data_parallel_rank or 0)
        if src is None:
            first.garbage_frames += 1
            return
        self._enqueue(src, seq, frames[2], batch)

    def _reconnected(self, src: Source) -> None:
        """The feed saw a new handshake before routing any message of that connection: mark the
        place in the queue (never dropped: it is what makes the state verify the publisher)."""
        if src.removed or (src.queue and src.queue[-1][2] is _RECONNECTED):
            return
        src.queue.append((-1, b"", _RECONNECTED))
        if src.replay_task is None:
            self._ready[src] = None
            self._kick()

    def _enqueue(self, src: Source, seq: int, payload: bytes, batch: DecodedBatch | None) -> None:
        src.seen = True
        q = src.queue
        if len(q) >= self.queue_depth or src.queued_bytes + len(payload) > self.queue_bytes:
            src.queue_overflows += 1
            src.state.dropped(seq)
            if src.replay_task is None:
                self._ready[src] = None  # even with an empty queue the drop is a gap to repair
            return
        q.append((seq, payload, batch))
        src.queued_bytes += len(payload)
        if src.replay_task is None:
            self._ready[src] = None

    def _kick(self) -> None:
        """Schedule an applier turn if a source has work and none is scheduled."""
        if self._ready and self._applier is None and self._running and self._loop is not None:
            self._applier = self._loop.call_soon(self._apply_turn)

    def _resume(self, src: Source) -> None:
        """The source's replay ended: its queued messages may move again, and even with none
        its state hears the queue is dry (a drop may be missing, a caught-up streak ends)."""
        if not src.removed and self._running:
            self._ready[src] = None
            self._kick()

    # ------------------------------------------------------------------ applying

    def _read_done(self, src: Source) -> None:
        """A reader turn of ``src``'s own socket ended: apply what it queued in the same loop
        turn (one loop iteration per message, not two); the rest waits for applier turns."""
        if src in self._ready:
            self._serve(src)
        self._kick()

    def _apply_turn(self) -> None:
        """One applier turn: up to ``APPLY_BATCH`` messages of each source with work, round
        robin, until ``APPLY_BUDGET_S`` is spent; the next turn is scheduled if work is left."""
        self._applier = None
        if not self._running:
            return
        ready = self._ready
        clock = time.perf_counter
        t_end = clock() + APPLY_BUDGET_S
        try:
            for src in list(ready):
                if src in ready:  # (a replay may have started, or the worker gone, meanwhile)
                    self._serve(src)
                if clock() > t_end:
                    break
        finally:
            self._kick()

    def _serve(self, src: Source) -> None:
        """Apply up to ``APPLY_BATCH`` of the source's queued messages; a source with work left
        goes to the back of the ready order."""
        try:
            self._drain(src, APPLY_BATCH)
        except Exception:  # never let one source's data stop the applier
            log.exception("applying events of %s", src.engine)
            src.queue.clear()
            src.queued_bytes = 0
            self._run(src, src.state.apply_failed(time.monotonic()))
        ready = self._ready
        ready.pop(src, None)
        if src.queue and src.replay_task is None and not src.removed:
            ready[src] = None

    def _drain(self, src: Source, budget: int) -> None:
        q = src.queue
        state = src.state
        clock = time.monotonic
        n = 0
        while q and n < budget and src.replay_task is None:
            seq, payload, batch = q[0]
            if batch is _RECONNECTED:
                q.popleft()
                state.reconnected()
                continue
            if batch is None:
                try:
                    batch = decode_payload(payload)
                except DecodeError:
                    src.decode_errors += 1
                    batch = _UNDECODABLE
                q[0] = (seq, payload, batch)  # decoded once, even if it waits for a replay
            if batch is not _UNDECODABLE and state.next_in_order(seq, batch):
                self._apply(src, seq, batch)
                src.queued_bytes -= len(q.popleft()[1])
                n += 1
                continue
            live = state.live(seq, None if batch is _UNDECODABLE else batch, clock())
            request = self._run(src, live)
            if request is not None:
                self._start_replay(src, request)
                return  # the message stays queued until the replay ends
            src.queued_bytes -= len(q.popleft()[1])
            n += 1
        if not q and src.replay_task is None:
            request = self._run(src, state.queue_emptied(clock()))
            if request is not None:
                self._start_replay(src, request)

    def _run(self, src: Source, actions: list[Action]) -> RequestReplay | None:
        """Carry out a state's actions in order; return the replay it asks for, if any."""
        request = None
        for action in actions:
            if isinstance(action, Apply):
                self._apply(src, action.seq, action.batch)
            elif isinstance(action, ResetEngine):
                if action.clear:
                    self.index.clear_engine(src.engine)
                self._notify(src, action.reason)
            elif isinstance(action, MarkDegraded):
                log.warning("KV events of %s degraded: %s", src.engine, action.reason)
            elif isinstance(action, MarkRebuilt):
                log.info("KV events of %s rebuilt (was: %s)", src.engine, action.was)
            else:
                request = action
        return request

    def _apply(self, src: Source, seq: int, batch: DecodedBatch) -> None:
        self.index.apply(src.engine, batch.events)
        src.applied(time.time())
        if self.index.overflowed:
            self._index_overflow()
        if self.on_batch is not None:
            try:
                self.on_batch(src.engine, seq, batch)
            except Exception:
                log.exception("on_batch callback")

    def _index_overflow(self) -> None:
        overflowed = self.index.overflowed
        while overflowed:
            engine = overflowed.pop()
            src = self._sources.get(engine)
            if src is not None:
                self._run(src, src.state.index_capped(time.monotonic()))

    def _notify(self, src: Source, reason: str) -> None:
        if self.on_reset is None:
            return
        try:
            self.on_reset(src.engine, reason)
        except Exception:
            log.exception("on_reset callback")

    def _start_replay(self, src: Source, request: RequestReplay) -> None:
        assert self._resync is not None
        self._ready.pop(src, None)
        self._resync.start(src, request)
