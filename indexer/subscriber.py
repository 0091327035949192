"""Subscribe to vLLM KV-cache event streams and keep a :class:`PrefixIndex` in step with them.

One *source* is one vLLM scheduler: ``(worker_id, dp_rank)``, with its own sequence numbers.

Topologies (reference §2.2):

* **connect** (vLLM binds ``tcp://*:P``): one SUB socket per worker and DP rank, connected to
  ``P + rank``; replay (DEALER) at ``replay_port + rank``.
* **bind** (vLLM connects out to us): one SUB socket bound at ``bind``; a message belongs to the
  worker whose topic equals its topic frame, the rank comes from the batch's
  ``data_parallel_rank``.

Data path, all on the event-loop thread (the index is single-threaded):

    socket --reader callback on ZMQ_FD (NOBLOCK, <= RECV_BATCH per turn)--> per-source bounded deque
           --applier task (<= APPLY_BATCH msgs / APPLY_BUDGET_S per turn)--> decode -> index.apply

Reader and applier both return to the loop after bounded work, so a flood never starves it.
A full deque drops the newest message (``queue_overflows``) and that seq becomes an ordinary gap:
memory stays bounded by ``queue_depth`` messages per source plus ZMQ's RCVHWM (the same number).

Sequence logic per source:

* ``seq == last + 1``: apply.
* ``seq > last + 1`` (gap, PUB high-water drops, queue overflow) or an undecodable payload (a
  lost batch): replay from ``last + 1`` over DEALER. While a replay is in flight the source's live
  messages stay queued (bounded); after it, the replayed batches are applied in order and queued
  live messages the replay already covered (seq <= last applied while the live stream still
  moves forward) are skipped, so nothing is lost or applied twice.
* Repair impossible (no replay endpoint, replay timed out, first replayed seq > asked, a hole in
  the replay, the replayed batch still undecodable -- a publisher resending the same bad bytes
  is not retried -- or ``MAX_REPLAY_STREAK`` replays in a row without an in-order live batch):
  ``index.clear_engine``, ``resets += 1``, the source is **degraded**, ``on_reset(engine,
  reason)`` is called, and the next batch is accepted as the new base. Reasons read
  ``"<cause>: <detail>"``, cause in gap / undecodable batch / queue overflow, detail in
  no replay endpoint / replay failed / replay cannot reach back / replay has a hole / replay did
  not repair it; plus ``"undecodable batch"``, ``"index cap"``, ``"restart"`` (not degraded).
* The *live* stream going backwards (a decodable message whose seq is <= the previous live
  message's; ZMQ delivers one connection in order) means the engine restarted.
  ``restarts += 1``, ``clear_engine``, ``on_reset(engine, "restart")``, and the batch is handled
  like a first message: seq 0 starts an exact fresh state (and ends any degradation).
* A gap right after the SUB reconnected may be a restarted publisher whose new seqs already
  passed ours: the replay then starts at our last seq and that batch's ts must match ours;
  if not, it is a restart (reset, replay from 0).
* First message with seq > 0 (joined mid-stream, or restarted while unheard): replay from 0 when
  a replay endpoint exists; if that cannot reach seq 0 (or there is no replay) the source is
  degraded with reason ``"joined mid-stream"``: its index is not wrong, only incomplete.
* ``index.overflowed`` (the index's cap reset an engine): degraded with reason ``"index cap"``.

**Degraded / rebuilt.** Degraded means "the index under-reports this engine" (it may hold blocks
the index never saw); the router should not trust a *miss* on it. It clears when

* a batch containing ``AllBlocksCleared`` is applied (from then on the state is exact), or
* the source has applied ``rebuild_batches`` batches in order **and** ``rebuild_s`` seconds have
  passed since the degradation, without a new loss (the cache has turned over by then in any busy
  engine; defaults 256 batches and 30 s), or
* the engine restarts and we see it from seq 0.

A silent socket changes nothing (vLLM 0.33 sends no heartbeat; an idle engine is not an empty
one). ZMQ reconnects by itself (``reconnect_backoff_s``); ZMTP heartbeats detect dead peers, and
a socket monitor tracks ``connected``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from indexer.endpoints import WILDCARD_HOSTS, concrete_endpoint, offset_endpoint
from indexer.index import EngineId, PrefixIndex
from indexer.replay import ReplayError, fetch_replay
from indexer.wire import AllBlocksCleared, DecodedBatch, DecodeError, decode_payload

__all__ = ["SourceStatus", "Subscriber", "concrete_endpoint"]

log = logging.getLogger(__name__)

RECV_BATCH = 256
"""Messages a reader takes off its socket before yielding to the loop."""
RECV_BUDGET_S = 0.0005
"""...or this much time, whichever comes first (checked every 16 messages): a flood of junk on
a socket costs every HTTP request at most this per loop turn (tests/faults/test_garbage.py)."""
APPLY_BATCH = 64
"""Messages the applier takes from one source before moving to the next."""
APPLY_BUDGET_S = 0.004
"""Applier time slice before it yields to the loop (readers, HTTP handlers)."""
MAX_REPLAY_STREAK = 3
"""Consecutive replays of one source without an in-order live batch before it is reset."""

MID_STREAM = "joined mid-stream"
INDEX_CAP = "index cap"
RESTART = "restart"

_UNDECODABLE = DecodedBatch(0.0, [])
"""Queue marker: this message's payload failed to decode (counted once)."""
_MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


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


@dataclass(eq=False, slots=True)
class _Source:
    worker_id: str
    dp_rank: int
    endpoint: str
    replay_endpoint: str | None
    queue: deque[tuple[int, bytes, DecodedBatch | None]] = field(default_factory=deque)
    feed: _Feed | None = None
    topic: str | None = None
    """Bound topology only: the worker's exact topic."""
    removed: bool = False
    seen: bool = False
    last_seq: int | None = None
    resync: bool = False
    """Accept the next batch as a new base whatever its seq (after a reset)."""
    last_event_ts: float | None = None
    last_applied_at: float | None = None
    batches: int = 0
    events: int = 0
    gaps: int = 0
    replays_ok: int = 0
    replays_failed: int = 0
    resets: int = 0
    restarts: int = 0
    decode_errors: int = 0
    garbage_frames: int = 0
    queue_overflows: int = 0
    duplicates: int = 0
    overflow_max: int | None = None
    """Highest seq dropped by a full queue and not yet accounted for."""
    replay_task: asyncio.Task[None] | None = None
    replay_streak: int = 0
    last_live_seq: int | None = None
    """Seq of the last decodable live message handled (restart = the live stream goes back)."""
    reconnected: bool = False
    """The SUB reconnected since the last live batch: a gap may hide a publisher restart."""
    degraded: bool = False
    degraded_reason: str | None = None
    degraded_since: float = 0.0
    clean_batches: int = 0
    rate: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=11))

    @property
    def engine(self) -> EngineId:
        return (self.worker_id, self.dp_rank)


@dataclass(eq=False, slots=True)
class _BoundWorker:
    worker_id: str
    topic: bytes
    sources: dict[int, _Source]


@dataclass(eq=False, slots=True)
class _Feed:
    """One SUB socket and the tasks that read it."""

    endpoint: str
    source: _Source | None  # connect topology; None for the bound socket
    sock: zmq.asyncio.Socket | None = None
    raw: zmq.Socket | None = None
    monitor: zmq.asyncio.Socket | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    peers: int = 0
    handshakes: int = 0
    closed: bool = False


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
        replay_timeout_s: float = 2.0,
        replay_concurrency: int = 4,
        bind: str | None = None,
        reconnect_backoff_s: tuple[float, float] = (0.1, 5.0),
        on_reset: Callable[[EngineId, str], None] | None = None,
        rebuild_batches: int = 256,
        rebuild_s: float = 30.0,
        on_batch: Callable[[EngineId, int, DecodedBatch], None] | None = None,
        heartbeat_s: float = 5.0,
    ) -> None:
        if queue_depth < 1 or replay_concurrency < 1:
            raise ValueError("queue_depth and replay_concurrency must be >= 1")
        self.index = index
        self.topic = topic
        self.queue_depth = queue_depth
        self.replay_timeout_s = replay_timeout_s
        self.replay_concurrency = replay_concurrency
        self.bind = bind
        self.reconnect_backoff_s = reconnect_backoff_s
        self.on_reset = on_reset
        self.rebuild_batches = rebuild_batches
        self.rebuild_s = rebuild_s
        self.on_batch = on_batch
        self.heartbeat_s = heartbeat_s
        self.unrouted_frames = 0
        self.bound_endpoint: str | None = None
        self._sources: dict[EngineId, _Source] = {}
        self._workers: dict[str, list[_Source]] = {}
        self._bound: dict[bytes, _BoundWorker] = {}
        self._feeds: dict[EngineId, _Feed] = {}
        self._bound_feed: _Feed | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._ready: dict[_Source, None] = {}  # ordered set of sources with work
        self._wake: asyncio.Event | None = None
        self._applier: asyncio.Task[None] | None = None
        self._replay_sem: asyncio.Semaphore | None = None
        self._running = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._running:
            return
        self._running = True
        self._ctx = zmq.asyncio.Context()
        self._wake = asyncio.Event()
        self._replay_sem = asyncio.Semaphore(self.replay_concurrency)
        self._applier = asyncio.get_running_loop().create_task(
            self._apply_loop(), name="kv-subscriber-applier"
        )
        if self.bind is not None:
            self._bound_feed = self._open_feed(self.bind, None)
        for src in self._sources.values():
            if src.feed is None and not self._is_bound(src):
                self._feeds[src.engine] = self._open_feed(src.endpoint, src)
        for src in self._sources.values():
            if src.queue:
                self._ready[src] = None
        self._wake.set()

    async def stop(self) -> None:
        if not self._running:
            return
        self._running = False
        tasks: list[asyncio.Task[None]] = []
        if self._applier is not None:
            tasks.append(self._applier)
        for src in self._sources.values():
            if src.replay_task is not None:
                tasks.append(src.replay_task)
        feeds = list(self._feeds.values())
        if self._bound_feed is not None:
            feeds.append(self._bound_feed)
        for feed in feeds:
            tasks.extend(feed.tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for feed in feeds:
            self._close_feed(feed)
        for src in self._sources.values():
            src.feed = None
            src.replay_task = None
        self._feeds.clear()
        self._bound_feed = None
        self._applier = None
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
            ep = _resolve(events_endpoint, host, rank)
            rep = _resolve(replay_endpoint, host, rank) if replay_endpoint else None
            sources.append(_Source(worker_id, rank, ep, rep))
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
            rank: _Source(
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
            self._ready.pop(src, None)
            if src.replay_task is not None:
                src.replay_task.cancel()
                src.replay_task = None
            feed = self._feeds.pop(src.engine, None)
            if feed is not None:
                for t in feed.tasks:
                    t.cancel()
                self._close_feed(feed)
            src.feed = None
            self._sources.pop(src.engine, None)
            self.index.remove_engine(src.engine)

    def drop_worker_state(self, worker_id: str, reason: str) -> int:
        """The worker went away (dead or unreachable): drop its index state, keep listening.

        Every rank is cleared and marked degraded (``resets += 1``); the sockets stay connected
        and the sequence state is kept, so a restarted worker (its seqs start again at 0) is
        recognised as a restart and rebuilt exactly, while a worker that was only unreachable
        is rebuilt by the usual rules. Returns the number of ranks cleared (0 if unknown or
        already dropped).
        """
        n = 0
        for src in self._workers.get(worker_id, []):
            if src.degraded and src.degraded_reason == reason:
                continue  # already dropped for this outage
            self._reset(src, reason)
            n += 1
        return n

    # ------------------------------------------------------------------ inspection

    def status(self) -> list[SourceStatus]:
        now = time.time()
        out = []
        for src in self._sources.values():
            feed = src.feed if src.feed is not None else self._bound_feed
            endpoint = src.endpoint
            if src.topic is not None:
                connected = bool(feed is not None and feed.peers > 0 and src.seen)
                endpoint = f"{self.bound_endpoint or self.bind}#{src.topic}"
            else:
                connected = bool(feed is not None and feed.peers > 0)
            lag = (
                src.last_applied_at - src.last_event_ts
                if src.last_applied_at is not None and src.last_event_ts is not None
                else None
            )
            out.append(
                SourceStatus(
                    worker_id=src.worker_id,
                    dp_rank=src.dp_rank,
                    endpoint=endpoint,
                    replay_endpoint=src.replay_endpoint,
                    connected=connected,
                    last_seq=src.last_seq,
                    last_event_ts=src.last_event_ts,
                    batches=src.batches,
                    events=src.events,
                    blocks=self.index.resident_blocks(src.engine),
                    events_per_s=_rate(src, now),
                    gaps=src.gaps,
                    replays_ok=src.replays_ok,
                    replays_failed=src.replays_failed,
                    resets=src.resets,
                    restarts=src.restarts,
                    decode_errors=src.decode_errors,
                    garbage_frames=src.garbage_frames,
                    queue_overflows=src.queue_overflows,
                    queue_depth=len(src.queue),
                    degraded=src.degraded,
                    degraded_reason=src.degraded_reason,
                    last_applied_at=src.last_applied_at,
                    lag_s=lag,
                    duplicates=src.duplicates,
                    replaying=src.replay_task is not None,
                )
            )
        return out

    def seed_seq(self, engine: EngineId, seq: int, event_ts: float | None = None) -> bool:
        """Treat ``engine`` as already applied up to ``seq`` (its index state was imported from
        a snapshot taken at that seq). Call right after :meth:`add_worker`, before any message
        of that engine is consumed; returns False (import nothing) if it is too late.

        The first live batch then decides, by the ordinary rules: ``seq + 1`` applies; a later
        seq is a gap, replayed from ``seq + 1`` (a replay that cannot reach back resets the
        engine: exact or empty, never wrong); a seq ``<= seq`` means the engine restarted since
        the snapshot, so it is cleared. With ``event_ts`` (the snapshot batch's ``ts``) the
        first gap is verified like one after a reconnect: an engine that restarted *and*
        already passed ``seq`` is caught by comparing that batch's ts.
        """
        src = self._sources.get(engine)
        if src is None or src.last_seq is not None or src.queue:
            return False
        src.last_seq = seq
        src.last_live_seq = seq
        if event_ts is not None:
            src.last_event_ts = event_ts
            src.reconnected = True
        return True

    def is_degraded(self, engine: EngineId) -> bool:
        src = self._sources.get(engine)
        return bool(src is not None and src.degraded)

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
        feeds = list(self._feeds.values())
        if self._bound_feed is not None:
            feeds.append(self._bound_feed)
        for feed in feeds:
            raw = feed.raw
            if raw is not None and not raw.closed and raw.get(zmq.EVENTS) & zmq.POLLIN:
                return False
        return True

    # ------------------------------------------------------------------ sockets

    def _is_bound(self, src: _Source) -> bool:
        return src.topic is not None

    def _open_feed(self, endpoint: str, src: _Source | None) -> _Feed:
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.SUB)
        lo, hi = self.reconnect_backoff_s
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self.queue_depth)
        sock.setsockopt(zmq.RECONNECT_IVL, max(1, int(lo * 1000)))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, max(1, int(hi * 1000)))
        if self.heartbeat_s > 0:
            sock.setsockopt(zmq.HEARTBEAT_IVL, int(self.heartbeat_s * 1000))
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.heartbeat_s * 3000))
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        feed = _Feed(endpoint, src, sock, zmq.Socket.shadow(sock.underlying))
        feed.monitor = sock.get_monitor_socket(_MONITOR_EVENTS)
        loop = asyncio.get_running_loop()
        if src is None:
            sock.bind(endpoint)
            self.bound_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            feed.endpoint = self.bound_endpoint
            for bw in self._bound.values():
                for s in bw.sources.values():
                    s.feed = feed
        else:
            sock.connect(endpoint)
            src.feed = feed
        loop.add_reader(feed.raw.FD, self._on_readable, feed)
        loop.call_soon(self._on_readable, feed)  # anything queued before the reader was added
        feed.tasks.append(loop.create_task(self._monitor_loop(feed), name=f"kv-mon {endpoint}"))
        return feed

    def _close_feed(self, feed: _Feed) -> None:
        feed.closed = True
        if feed.raw is not None and not feed.raw.closed:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(feed.raw.FD)
        if feed.sock is not None and not feed.sock.closed:
            with contextlib.suppress(zmq.ZMQError):
                feed.sock.disable_monitor()
            feed.sock.close(linger=0)
        if feed.monitor is not None and not feed.monitor.closed:
            feed.monitor.close(linger=0)
        feed.peers = 0

    async def _monitor_loop(self, feed: _Feed) -> None:
        assert feed.monitor is not None
        while True:
            try:
                frames = await feed.monitor.recv_multipart()
                event = parse_monitor_message(frames)["event"]
            except asyncio.CancelledError:
                raise
            except Exception:  # a monitor hiccup must not stop the subscriber
                log.debug("monitor of %s", feed.endpoint, exc_info=True)
                await asyncio.sleep(0.1)
                continue
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                feed.peers += 1
                feed.handshakes += 1
                if feed.source is not None and feed.handshakes > 1:
                    feed.source.reconnected = True
            elif event == zmq.EVENT_DISCONNECTED:
                feed.peers = max(feed.peers - 1, 0)

    def _on_readable(self, feed: _Feed) -> None:
        """Drain up to RECV_BATCH messages without blocking; reschedule if more remain.

        Called by the loop when the socket's (edge-triggered) ZMQ_FD fires, and by itself via
        ``call_soon`` when it stopped at the budget: no futures or tasks per message.
        """
        raw = feed.raw
        if raw is None or raw.closed or feed.closed:
            return
        route = self._route_connect if feed.source is not None else self._route_bound
        n = 0
        more = True
        try:
            t_end = time.perf_counter() + RECV_BUDGET_S
            while n < RECV_BATCH:
                frames = raw.recv_multipart(zmq.NOBLOCK)
                n += 1
                try:
                    route(feed, frames)
                except Exception:  # nothing a socket delivers may stop the reader
                    log.exception("routing a message from %s", feed.endpoint)
                if not n & 15 and time.perf_counter() > t_end:
                    break  # time budget spent: rescheduled below (more is True)
        except zmq.Again:
            # Reading EVENTS re-arms the edge-triggered FD; a message may have slipped in.
            more = bool(raw.get(zmq.EVENTS) & zmq.POLLIN)
        except zmq.ZMQError as exc:
            if raw.closed or feed.closed:
                return
            log.warning("recv on %s: %s", feed.endpoint, exc)
        if n:
            self._kick()
        if more:
            asyncio.get_running_loop().call_soon(self._on_readable, feed)

    def _route_connect(self, feed: _Feed, frames: list[bytes]) -> None:
        src = feed.source
        assert src is not None
        if len(frames) != 3 or len(frames[1]) != 8:
            src.garbage_frames += 1
            return
        self._enqueue(src, int.from_bytes(frames[1], "big"), frames[2], None)

    def _route_bound(self, feed: _Feed, frames: list[bytes]) -> None:
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

    def _enqueue(self, src: _Source, seq: int, payload: bytes, batch: DecodedBatch | None) -> None:
        src.seen = True
        q = src.queue
        if len(q) >= self.queue_depth:
            src.queue_overflows += 1
            if src.overflow_max is None or seq > src.overflow_max:
                src.overflow_max = seq
            return
        q.append((seq, payload, batch))
        if src.replay_task is None:
            self._ready[src] = None

    def _kick(self) -> None:
        if self._ready and self._wake is not None:
            self._wake.set()

    # ------------------------------------------------------------------ applying

    async def _apply_loop(self) -> None:
        assert self._wake is not None
        wake = self._wake
        clock = time.perf_counter
        while True:
            if not self._ready:
                wake.clear()
                await wake.wait()
            t0 = clock()
            for src in list(self._ready):
                try:
                    self._drain(src, APPLY_BATCH)
                except Exception:  # never let one source's data stop the applier
                    log.exception("applying events of %s", src.engine)
                    src.queue.clear()
                    self._reset(src, "internal error")
                    src.resync = True
                if not src.queue or src.replay_task is not None or src.removed:
                    self._ready.pop(src, None)
                if clock() - t0 > APPLY_BUDGET_S:
                    await asyncio.sleep(0)
                    t0 = clock()
            await asyncio.sleep(0)

    def _drain(self, src: _Source, budget: int) -> None:
        q = src.queue
        n = 0
        while q and n < budget and src.replay_task is None:
            seq, payload, batch = q[0]
            if batch is None:
                try:
                    batch = decode_payload(payload)
                except DecodeError:
                    src.decode_errors += 1
                    batch = _UNDECODABLE
                q[0] = (seq, payload, batch)  # decoded once, even if it waits for a replay
            if batch is _UNDECODABLE:
                if not self._handle(src, seq, None):
                    return  # a replay started; the message stays queued until it ends
            else:
                if not self._handle(src, seq, batch):
                    return
                src.last_live_seq = seq
                src.reconnected = False
            q.popleft()
            n += 1
        if (
            not q
            and src.replay_task is None
            and src.overflow_max is not None
            and (src.last_seq is None or src.overflow_max > src.last_seq)
        ):
            # The newest messages were dropped by the full queue and nothing came after them.
            start = 0 if src.last_seq is None else src.last_seq + 1
            src.overflow_max = None
            src.gaps += 1
            self._lose(src, start, "queue overflow", None, None)

    def _handle(self, src: _Source, seq: int, batch: DecodedBatch | None) -> bool:
        """Process one live batch (None: undecodable); False when it must wait for a replay."""
        last = src.last_seq
        if last is not None and not src.resync and seq <= last:
            if batch is None:
                return True  # garbage with an old seq: nothing to repair, nothing to reset
            if src.last_live_seq is None or seq > src.last_live_seq:
                # The live stream is still moving forward: a replay already applied this one.
                src.duplicates += 1
                return True
            # The live stream itself went backwards (ZMQ delivers in order): a new publisher.
            src.restarts += 1
            src.last_seq = last = None
            src.overflow_max = None
            src.replay_streak = 0
            self.index.clear_engine(src.engine)
            self._notify(src, RESTART)
            if seq == 0:
                self._undegrade(src)
        if last is None or src.resync:
            if last is None and not src.resync and seq > 0:
                if src.replay_endpoint is not None and src.replay_streak == 0:
                    src.replay_streak += 1
                    self._start_replay(src, 0, MID_STREAM)
                    return False
                self._degrade(src, MID_STREAM)
            if batch is None:
                if not src.resync and src.replay_endpoint is not None:
                    return self._lose(src, seq, "undecodable batch", seq, None)  # first seq 0
                self._reset(src, "undecodable batch")
                src.last_seq = seq
                src.resync = False
                return True
            self._apply(src, seq, batch)
            return True
        if seq == last + 1:
            if batch is None:
                return self._lose(src, seq, "undecodable batch", seq, None)
            src.replay_streak = 0
            self._apply(src, seq, batch)
            return True
        src.gaps += 1
        if (
            src.reconnected
            and src.replay_endpoint is not None
            and src.last_event_ts is not None
            and src.replay_streak < MAX_REPLAY_STREAK
        ):
            # A gap across a reconnect: lost messages, or a restarted publisher whose new seqs
            # already passed ours? Replay from our last seq and compare that batch's ts.
            src.replay_streak += 1
            self._start_replay(src, last, "gap", verify_ts=src.last_event_ts)
            return False
        return self._lose(src, last + 1, "gap", seq, batch)

    def _lose(
        self,
        src: _Source,
        start: int,
        reason: str,
        seq: int | None,
        batch: DecodedBatch | None,
    ) -> bool:
        """Batches from ``start`` on are missing: replay them, or reset and go on from ``seq``."""
        if src.replay_endpoint is not None and src.replay_streak < MAX_REPLAY_STREAK:
            src.replay_streak += 1
            self._start_replay(src, start, reason)
            return False
        if src.replay_endpoint is None:
            self._reset(src, f"{reason}: no replay endpoint")
        else:
            self._reset(src, f"{reason}: replay did not repair it")
        src.replay_streak = 0
        src.resync = True
        if seq is None:
            return True
        if batch is None:
            src.last_seq = seq  # skip the undecodable batch; the next one is the new base
            src.resync = False
            return True
        self._apply(src, seq, batch)
        return True

    def _apply(self, src: _Source, seq: int, batch: DecodedBatch) -> None:
        events = batch.events
        self.index.apply(src.engine, events)
        src.last_seq = seq
        src.resync = False
        src.batches += 1
        src.events += len(events)
        src.last_event_ts = batch.ts
        now = src.last_applied_at = time.time()
        rate = src.rate
        if not rate or now - rate[-1][0] >= 1.0:
            rate.append((now, src.events))
        if src.overflow_max is not None and seq >= src.overflow_max:
            src.overflow_max = None
        if src.degraded:
            src.clean_batches += 1
            if any(type(ev) is AllBlocksCleared for ev in events) or (
                src.clean_batches >= self.rebuild_batches
                and time.monotonic() - src.degraded_since >= self.rebuild_s
            ):
                self._undegrade(src)
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
                src.resets += 1
                self._degrade(src, INDEX_CAP)
                self._notify(src, INDEX_CAP)

    # ------------------------------------------------------------------ replay

    def _start_replay(
        self, src: _Source, start: int, reason: str, verify_ts: float | None = None
    ) -> None:
        self._ready.pop(src, None)
        src.replay_task = asyncio.get_running_loop().create_task(
            self._replay(src, start, reason, verify_ts), name=f"kv-replay {src.engine}"
        )

    async def _replay(self, src: _Source, start: int, reason: str, verify_ts: float | None) -> None:
        try:
            if await self._replay_once(src, start, reason, verify_ts) and not src.removed:
                await self._replay_once(src, 0, MID_STREAM, None)  # a new publisher: from 0
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("replay for %s", src.engine)
            if not src.removed:
                self._replay_failed(src, reason, "internal error")
        finally:
            if src.replay_task is asyncio.current_task():
                src.replay_task = None
            if src.queue and not src.removed and self._running:
                self._ready[src] = None
                self._kick()

    async def _replay_once(
        self, src: _Source, start: int, reason: str, verify_ts: float | None
    ) -> bool:
        """Fetch and apply one replay. With ``verify_ts``, ``start`` is our last applied seq
        and its batch must carry that ts; otherwise the publisher restarted: the engine is reset
        and True returned (the caller then replays from 0)."""
        assert self._replay_sem is not None and self._ctx is not None
        assert src.replay_endpoint is not None
        async with self._replay_sem:
            try:
                result = await fetch_replay(
                    self._ctx, src.replay_endpoint, start, self.replay_timeout_s
                )
            except ReplayError as exc:
                log.warning("replay for %s: %s", src.engine, exc)
                if not src.removed:
                    src.replays_failed += 1
                    self._replay_failed(src, reason, "replay failed")
                return False
        if src.removed:
            return False
        batches, reaches = result.batches, result.reaches
        if verify_ts is not None and reaches:
            try:
                same = decode_payload(batches[0][1]).ts == verify_ts
            except DecodeError:
                same = False
            if not same:
                src.replays_ok += 1
                src.restarts += 1
                src.last_seq = None
                src.resync = False
                src.overflow_max = None
                self.index.clear_engine(src.engine)
                self._notify(src, RESTART)
                return True
            batches = batches[1:]
            start += 1
        await self._apply_replay(src, start, reason, batches, reaches)
        return False

    def _replay_failed(self, src: _Source, reason: str, detail: str) -> None:
        if reason == MID_STREAM:
            self._degrade(src, MID_STREAM)  # nothing to drop: we never had its older state
        else:
            self._reset(src, f"{reason}: {detail}")
        src.resync = True

    async def _apply_replay(
        self,
        src: _Source,
        start: int,
        reason: str,
        batches: list[tuple[int, bytes]],
        reaches: bool,
    ) -> None:
        if reaches:
            src.replays_ok += 1
            if start == 0 and src.last_seq is None:
                self._undegrade(src)  # the whole history of a (new) publisher: exact
        else:
            src.replays_failed += 1
            self._replay_failed(src, reason, "replay cannot reach back")
        n = 0
        for seq, payload in batches:
            if src.removed:
                return
            last = src.last_seq
            if not src.resync:
                expected = start if last is None else last + 1
                if last is not None and seq <= last:
                    continue  # already applied from the live stream
                if seq != expected:
                    self._reset(src, f"{reason}: replay has a hole")
                    src.resync = True
            try:
                batch = decode_payload(payload)
            except DecodeError:
                src.decode_errors += 1
                self._reset(src, "undecodable batch")
                src.last_seq = seq
                src.resync = False
                continue
            self._apply(src, seq, batch)
            n += 1
            if n % APPLY_BATCH == 0:
                await asyncio.sleep(0)

    # ------------------------------------------------------------------ degradation

    def _reset(self, src: _Source, reason: str) -> None:
        self.index.clear_engine(src.engine)
        src.resets += 1
        self._degrade(src, reason)
        self._notify(src, reason)

    def _degrade(self, src: _Source, reason: str) -> None:
        if src.degraded and src.degraded_reason == MID_STREAM and reason == MID_STREAM:
            return
        src.degraded = True
        src.degraded_reason = reason
        src.degraded_since = time.monotonic()
        src.clean_batches = 0
        log.warning("KV events of %s degraded: %s", src.engine, reason)

    def _undegrade(self, src: _Source) -> None:
        if src.degraded:
            log.info("KV events of %s rebuilt (was: %s)", src.engine, src.degraded_reason)
        src.degraded = False
        src.degraded_reason = None
        src.clean_batches = 0

    def _notify(self, src: _Source, reason: str) -> None:
        if self.on_reset is None:
            return
        try:
            self.on_reset(src.engine, reason)
        except Exception:
            log.exception("on_reset callback")


def _resolve(endpoint: str, host: str | None, rank: int) -> str:
    if host:
        return concrete_endpoint(endpoint, host, rank)
    if endpoint.startswith("tcp://"):
        h = endpoint[len("tcp://") :].rpartition(":")[0]
        if h in WILDCARD_HOSTS:
            raise ValueError(f"endpoint {endpoint!r} has a wildcard host; pass host=")
    return offset_endpoint(endpoint, rank)


def _rate(src: _Source, now: float) -> float:
    """Events per second over the samples of the last ~10 s (0 when idle that long)."""
    samples = [(t, n) for t, n in src.rate if now - t <= 10.5]
    if not samples:
        return 0.0
    t0, n0 = samples[0]
    span = max(now - t0, 1.0)
    return (src.events - n0) / span
