"""The sequence / replay / restart / degraded rules of one event source, as a pure state machine.

One *source* is one vLLM scheduler: ``(worker_id, dp_rank)``, with its own sequence numbers.
:class:`SourceState` is fed what happens to it -- a queued live message ``(seq, batch)``, a
replay's answer or failure, a reconnect, a warm-start seed, a reset -- and answers with a list of
actions for the caller (:mod:`indexer.subscriber`) to carry out in order: :class:`Apply` a batch
to the index, :class:`RequestReplay`, :class:`ResetEngine`, :class:`MarkDegraded`,
:class:`MarkRebuilt`. It holds no sockets, tasks or clocks: ``now`` (monotonic seconds) is passed
in, and every action it returns is taken as done.

Rules for a live message:

* ``seq == last + 1``: apply.
* ``seq > last + 1`` (gap, PUB high-water drops, queue overflow) or an undecodable payload (a
  lost batch): replay what is missing (*Identity* below says where the fetch starts). The
  caller keeps the source's live messages queued while the replay is in flight (the message
  that asked for it is offered again afterwards); the replayed batches are applied in order,
  and queued live messages the replay already covered (seq <= last applied while the live
  stream still moves forward) are skipped as ``duplicates``, so nothing is lost or applied
  twice.
* Repair impossible (no replay endpoint, replay timed out, first replayed seq > asked, a hole in
  the replay, the replayed batch still undecodable -- a publisher resending the same bad bytes
  is not retried -- or ``MAX_REPLAY_STREAK`` replays in a row without an in-order live batch
  and without the queue running dry with nothing missing, i.e. the source never catches up):
  the engine is reset (``resets += 1``, :class:`ResetEngine`), the source is **degraded**, and
  the next batch is accepted as the new base. Reasons read ``"<cause>: <detail>"``, cause in
  gap / undecodable batch / queue overflow, detail in no replay endpoint / replay failed / replay
  cannot reach back / replay has a hole / replay did not repair it; plus ``"undecodable
  batch"``, ``"index cap"``, ``"restart"`` (not degraded).
* The *live* stream going backwards (a decodable message whose seq is <= the previous live
  message's; ZMQ delivers one connection in order) means the engine restarted: ``restarts +=
  1``, :class:`ResetEngine` ``"restart"``, and the batch is handled like a first message: seq 0
  starts an exact fresh state (and ends any degradation).
* **Identity.** A seq alone never proves which incarnation of a publisher sent it (a restarted
  one counts again from 0 and may have reached any seq by the time we hear it). So every replay
  asked while the source holds a base starts at its last batch with a known ts and carries that
  ts (``verify_ts``): the answer's first batch must carry it, else the publisher restarted --
  whichever socket (live or replay) shows the new incarnation first. An empty answer is a
  restart too: a publisher keeps its latest batches, so it never reached ours. After every
  reconnect of the SUB and every warm start (:meth:`SourceState.seed`) the source is
  *unverified*: its next live message, whatever its seq (unless the stream went back), waits
  for such a replay (reason ``"reconnect"`` / ``"warm start"``); without a replay endpoint it
  cannot be verified, so the engine is reset (degraded) and that message is the new base. A
  warm start is refused (:meth:`SourceState.seed` False) without a replay endpoint or the
  snapshot's ts.
* A restart found while the source was resyncing (a repair asked and not yet confirmed by an
  in-order live batch, or a reset waiting for a new base) also counts ``resync_restarts``.
* A replay the source stopped waiting for (:meth:`SourceState.reset`, a failure) is stale:
  its answer and batches are ignored (:meth:`SourceState.awaits`).
* First message with seq > 0 (joined mid-stream, or restarted while unheard): replay from 0 when
  a replay endpoint exists; if that cannot reach seq 0 (or there is no replay) the source is
  degraded with reason ``"joined mid-stream"``: its index is not wrong, only incomplete.
* The index's cap reset the engine (:meth:`SourceState.index_capped`): degraded, ``"index cap"``.

**Degraded / rebuilt.** Degraded means "the index under-reports this engine" (it may hold blocks
the index never saw); the router should not trust a *miss* on it. It clears when

* a batch containing ``AllBlocksCleared`` is applied (from then on the state is exact), or
* the source has applied ``rebuild_batches`` batches in order **and** ``rebuild_s`` seconds have
  passed since the degradation, without a new loss (the cache has turned over by then in any busy
  engine), or
* the engine restarts and we see it from seq 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from indexer.wire import AllBlocksCleared, DecodedBatch

__all__ = [
    "INDEX_CAP",
    "MAX_REPLAY_STREAK",
    "MID_STREAM",
    "RECONNECT",
    "RESTART",
    "WARM_START",
    "Action",
    "Apply",
    "MarkDegraded",
    "MarkRebuilt",
    "RequestReplay",
    "ResetEngine",
    "SourceState",
]

MAX_REPLAY_STREAK = 3
"""Consecutive replays of one source without catching up (an in-order live batch, or the queue
running dry with nothing missing) before it is reset: a subscriber that stays behind sheds its
replay load instead of asking the publisher for ever."""

MID_STREAM = "joined mid-stream"
INDEX_CAP = "index cap"
RESTART = "restart"
RECONNECT = "reconnect"
WARM_START = "warm start"


class Apply(msgspec.Struct, frozen=True, gc=False):
    """Apply this batch to the engine's index."""

    seq: int
    batch: DecodedBatch


class RequestReplay(msgspec.Struct, frozen=True, eq=False, gc=False):
    """Fetch every buffered batch from ``start`` on. From :meth:`SourceState.live` it means the
    message was not consumed: keep it (and the later ones) queued and offer it again after the
    replay. With ``verify_ts``, ``start`` is a batch the source already applied and the
    answer's first batch must carry that ts (see :meth:`SourceState.replay_answered`).

    Compared by identity: an answer belongs to the one request that asked for it."""

    start: int
    reason: str
    verify_ts: float | None = None


class ResetEngine(msgspec.Struct, frozen=True, gc=False):
    """The engine's index state is dropped: clear it (unless the index already did, ``clear``
    False) and report ``reason`` to the reset callback."""

    reason: str
    clear: bool = True


class MarkDegraded(msgspec.Struct, frozen=True, gc=False):
    """The source became degraded (its state already says so; this is for the log)."""

    reason: str


class MarkRebuilt(msgspec.Struct, frozen=True, gc=False):
    """The source is no longer degraded; ``was`` is the reason it had."""

    was: str | None


Action = Apply | RequestReplay | ResetEngine | MarkDegraded | MarkRebuilt


@dataclass(eq=False, slots=True, kw_only=True)
class SourceState:
    """Sequence state and counters of one source (see the module docstring)."""

    can_replay: bool
    """The source has a replay endpoint."""
    rebuild_batches: int
    rebuild_s: float
    last_seq: int | None = None
    resync: bool = False
    """Accept the next batch as a new base whatever its seq (after a reset)."""
    last_event_ts: float | None = None
    """The ``ts`` (publisher wall clock) of the last applied batch."""
    last_ts_seq: int | None = None
    """Seq of the batch ``last_event_ts`` belongs to (this incarnation), None when unknown."""
    last_live_seq: int | None = None
    """Seq of the last decodable live message handled (restart = the live stream goes back)."""
    unverified: str | None = None
    """Why the publisher must prove it is the one whose state we hold before its next live
    message is taken (:data:`RECONNECT`, :data:`WARM_START`), or None."""
    replay: RequestReplay | None = None
    """The replay the source waits for; answers to any other are stale."""
    overflow_max: int | None = None
    """Highest seq dropped by a full queue and not yet accounted for."""
    replay_streak: int = 0
    degraded: bool = False
    degraded_reason: str | None = None
    degraded_since: float = 0.0
    clean_batches: int = 0
    batches: int = 0
    events: int = 0
    gaps: int = 0
    replays_ok: int = 0
    replays_failed: int = 0
    resets: int = 0
    restarts: int = 0
    resync_restarts: int = 0
    """Restarts found while the source was resyncing (also counted in ``restarts``)."""
    duplicates: int = 0
    """Live batches skipped because a replay had already applied them."""
    _out: list[Action] = field(default_factory=list, init=False, repr=False)
    """Actions of the event being handled."""
    _now: float = field(default=0.0, init=False, repr=False)
    _fill_start: int = field(default=0, init=False, repr=False)
    """Seq the replay being fed starts at."""
    _fill_reason: str = field(default="", init=False, repr=False)

    # ------------------------------------------------------------------ events

    def live(self, seq: int, batch: DecodedBatch | None, now: float) -> list[Action]:
        """One queued live message, in arrival order (``batch`` None: its payload is
        undecodable). A :class:`RequestReplay` among the actions means it was not consumed."""
        out = self._begin(now)
        if self._handle(seq, batch) and batch is not None:
            self.last_live_seq = seq
        return out

    def next_in_order(self, seq: int, batch: DecodedBatch) -> bool:
        """The common case of :meth:`live`, without building actions: a decodable batch right
        after the last applied one, on a source that is verified, not resyncing and not
        degraded. Returns True when it took the batch -- the caller applies it, exactly as if
        ``live`` had returned ``[Apply(seq, batch)]`` -- and False (nothing changed) when the
        batch needs :meth:`live`."""
        last = self.last_seq
        if (
            last is None
            or seq != last + 1
            or self.resync
            or self.degraded
            or self.unverified is not None
            or (self.last_live_seq is not None and seq <= self.last_live_seq)
        ):
            return False
        self.replay_streak = 0
        self.last_seq = self.last_ts_seq = self.last_live_seq = seq
        self.batches += 1
        self.events += len(batch.events)
        self.last_event_ts = batch.ts
        if self.overflow_max is not None and seq >= self.overflow_max:
            self.overflow_max = None
        return True

    def dropped(self, seq: int) -> None:
        """A full queue dropped the live message ``seq``."""
        if self.overflow_max is None or seq > self.overflow_max:
            self.overflow_max = seq

    def queue_emptied(self, now: float) -> list[Action]:
        """The queue ran dry with no replay in flight: messages dropped by a full queue that
        nothing came after are a gap now. With nothing missing, the source has caught up with
        everything it received, which ends a replay streak: the losses it repaired are
        behind it (a batch that showed a gap and arrived already replayed is not an in-order
        live batch, yet the repair worked)."""
        out = self._begin(now)
        if self.overflow_max is not None and (
            self.last_seq is None or self.overflow_max > self.last_seq
        ):
            start = 0 if self.last_seq is None else self.last_seq + 1
            self.overflow_max = None
            self.gaps += 1
            self._lose(start, "queue overflow", None, None)
        elif self.last_seq is not None and not self.resync:
            self.replay_streak = 0
        return out

    def reconnected(self) -> None:
        """The SUB socket completed a handshake again after its first one; call it in order
        with the live messages (those before it came over the old connection)."""
        self.unverified = RECONNECT

    def seed(self, seq: int, event_ts: float | None) -> bool:
        """Take the engine as applied up to ``seq``, whose batch carried ``event_ts`` (a warm
        start from a snapshot). False if the source already has a seq, or if the snapshot could
        never be told from a restarted publisher's state (no replay endpoint, no ts)."""
        if self.last_seq is not None or event_ts is None or not self.can_replay:
            return False
        self.last_seq = self.last_live_seq = self.last_ts_seq = seq
        self.last_event_ts = event_ts
        self.unverified = WARM_START
        return True

    def reset(self, reason: str, now: float) -> list[Action]:
        """Drop the engine's state from outside (the worker went away); sequence state is kept
        and the replay in flight, if any, is stale."""
        out = self._begin(now)
        self.replay = None
        self._reset(reason)
        return out

    def apply_failed(self, now: float) -> list[Action]:
        """Handling a queued message raised (the caller dropped the queue): reset, and take the
        next batch as a new base."""
        out = self._begin(now)
        self.replay = None
        self._reset("internal error")
        self.resync = True
        return out

    def index_capped(self, now: float) -> list[Action]:
        """The index's entry cap dropped this engine."""
        out = self._begin(now)
        self.resets += 1
        self._degrade(INDEX_CAP)
        out.append(ResetEngine(INDEX_CAP, clear=False))
        return out

    # ------------------------------------------------------------------ replay events

    def awaits(self, request: RequestReplay) -> bool:
        """``request`` is the replay the source waits for (its answer is not stale)."""
        return self.replay is request

    def replay_answered(
        self,
        request: RequestReplay,
        reaches: bool,
        first_ts: float | None,
        now: float,
        *,
        empty: bool = False,
    ) -> list[Action]:
        """The replay of ``request`` answered; ``reaches``: its first batch is ``request.start``;
        ``first_ts``: that batch's ts (None if undecodable), read only with ``verify_ts``;
        ``empty``: it holds no batch at all.

        A :class:`RequestReplay` among the actions means the publisher restarted (the ts did
        not match, or it has not even reached the batch we applied: the one we heard keeps its
        latest batches): fetch that one instead and feed none of this answer's batches.
        Otherwise feed them in order with :meth:`replayed`, skipping those
        :meth:`already_applied`, then call :meth:`replay_done`. A stale request changes
        nothing."""
        out = self._begin(now)
        if request is not self.replay:
            return out
        start, reason = request.start, request.reason
        if request.verify_ts is not None and (reaches or empty):
            if empty or first_ts != request.verify_ts:
                self.replays_ok += 1
                self._restarted()
                self._request(RequestReplay(0, MID_STREAM))  # a new publisher: from 0
                return out
            self.unverified = None  # the publisher is the one whose state we hold
            start += 1  # the first batch is one we applied (already_applied skips it)
        if reaches:
            self.replays_ok += 1
            if start == 0 and self.last_seq is None:
                self._undegrade()  # the whole history of a (new) publisher: exact
        else:
            self.replays_failed += 1
            self._replay_failed(reason, "replay cannot reach back")
        self._fill_start, self._fill_reason = start, reason
        return out

    def already_applied(self, seq: int) -> bool:
        """This replayed batch is older than what the live stream already applied."""
        return not self.resync and self.last_seq is not None and seq <= self.last_seq

    def replayed(self, seq: int, batch: DecodedBatch | None, now: float) -> list[Action]:
        """One batch of the answer (``batch`` None: undecodable), after :meth:`already_applied`;
        ignored once the source stopped waiting for the replay."""
        out = self._begin(now)
        if self.replay is None:
            return out
        if not self.resync:
            last = self.last_seq
            expected = self._fill_start if last is None else last + 1
            if seq != expected:
                self._reset(f"{self._fill_reason}: replay has a hole")
                self.resync = True
        if batch is None:
            self._reset("undecodable batch")
            self.last_seq = seq
            self.resync = False
        else:
            self._apply(seq, batch)
        return out

    def replay_done(self, request: RequestReplay) -> None:
        """Every batch of the answer to ``request`` was fed."""
        if self.replay is request:
            self.replay = None

    def replay_failed(self, request: RequestReplay, now: float) -> list[Action]:
        """The replay of ``request`` got no complete answer (timeout, unreachable, malformed)."""
        out = self._begin(now)
        if request is not self.replay:
            return out
        self.replay = None
        self.replays_failed += 1
        self._replay_failed(request.reason, "replay failed")
        return out

    def replay_crashed(self, reason: str, now: float) -> list[Action]:
        """Handling a replay asked for ``reason`` raised."""
        out = self._begin(now)
        self.replay = None
        self._replay_failed(reason, "internal error")
        return out

    # ------------------------------------------------------------------ rules

    def _begin(self, now: float) -> list[Action]:
        self._now = now
        out: list[Action] = []
        self._out = out
        return out

    def _handle(self, seq: int, batch: DecodedBatch | None) -> bool:
        """Process one live message; False when it must wait for a replay."""
        if batch is not None and self.last_live_seq is not None and seq <= self.last_live_seq:
            # The live stream itself went backwards (ZMQ delivers in order): a new publisher.
            self._restarted()
            if seq == 0:
                self._undegrade()
        elif self.unverified is not None:
            if self.last_seq is not None and not self.resync:
                return self._verify(seq, batch)
            self.unverified = None  # no state to verify: the next batch is a base anyway
        last = self.last_seq
        if last is not None and not self.resync and seq <= last:
            if batch is not None:  # (garbage with an old seq: nothing to repair or reset)
                self.duplicates += 1  # the live stream moves forward: a replay applied it
            return True
        if last is None or self.resync:
            return self._base(seq, batch)
        if seq == last + 1:
            if batch is None:
                return self._lose(seq, "undecodable batch", seq, None)
            self.replay_streak = 0
            self._apply(seq, batch)
            return True
        self.gaps += 1
        return self._lose(last + 1, "gap", seq, batch)

    def _verify(self, seq: int, batch: DecodedBatch | None) -> bool:
        """First live message since a reconnect or warm start: its seq cannot say whether the
        publisher restarted, only a replay of our last batch with its ts can."""
        reason = self.unverified
        assert reason is not None and self.last_seq is not None
        if seq > self.last_seq + 1:
            self.gaps += 1  # seen as a gap whatever the replay then says
        if self.can_replay and self.last_ts_seq is not None:
            self._request(RequestReplay(self.last_ts_seq, reason, self.last_event_ts))
            return False
        detail = "no replay endpoint" if not self.can_replay else "no batch to compare"
        self._reset(f"{reason}: {detail}")
        self.resync = True
        return self._base(seq, batch)

    def _base(self, seq: int, batch: DecodedBatch | None) -> bool:
        """A first message, or the first after a reset: it becomes the base."""
        if self.last_seq is None and not self.resync and seq > 0:
            if self.can_replay and self.replay_streak == 0:
                self.replay_streak += 1
                self._request(RequestReplay(0, MID_STREAM))
                return False
            self._degrade(MID_STREAM)
        if batch is None:
            if not self.resync and self.can_replay:
                return self._lose(seq, "undecodable batch", seq, None)  # first seq 0
            self._reset("undecodable batch")
            self.last_seq = seq
            self.resync = False
            return True
        self._apply(seq, batch)
        return True

    def _lose(self, start: int, reason: str, seq: int | None, batch: DecodedBatch | None) -> bool:
        """Batches from ``start`` on are missing: replay them, or reset and go on from ``seq``."""
        if self.can_replay and self.replay_streak < MAX_REPLAY_STREAK:
            self.replay_streak += 1
            last, ts_seq = self.last_seq, self.last_ts_seq
            if last is not None and start == last + 1 and ts_seq is not None:
                self._request(RequestReplay(ts_seq, reason, self.last_event_ts))  # verified
            else:
                self._request(RequestReplay(start, reason))
            return False
        if not self.can_replay:
            self._reset(f"{reason}: no replay endpoint")
        else:
            self._reset(f"{reason}: replay did not repair it")
        self.replay_streak = 0
        self.resync = True
        if seq is None:
            return True
        if batch is None:
            self.last_seq = seq  # skip the undecodable batch; the next one is the new base
            self.resync = False
            return True
        self._apply(seq, batch)
        return True

    def _request(self, request: RequestReplay) -> None:
        self.replay = request
        self._out.append(request)

    def _restarted(self) -> None:
        """The publisher is a new incarnation: drop the engine, its history starts at seq 0."""
        self.restarts += 1
        if self.resync or self.replay_streak > 0:
            self.resync_restarts += 1
        self.last_seq = self.last_live_seq = self.last_ts_seq = None
        self.resync = False
        self.unverified = None
        self.overflow_max = None
        self.replay_streak = 0
        self._out.append(ResetEngine(RESTART))

    def _apply(self, seq: int, batch: DecodedBatch) -> None:
        events = batch.events
        self.last_seq = self.last_ts_seq = seq
        self.resync = False
        self.batches += 1
        self.events += len(events)
        self.last_event_ts = batch.ts
        if self.overflow_max is not None and seq >= self.overflow_max:
            self.overflow_max = None
        if self.degraded:
            self.clean_batches += 1
            if any(type(ev) is AllBlocksCleared for ev in events) or (
                self.clean_batches >= self.rebuild_batches
                and self._now - self.degraded_since >= self.rebuild_s
            ):
                self._undegrade()
        self._out.append(Apply(seq, batch))

    def _replay_failed(self, reason: str, detail: str) -> None:
        if reason == MID_STREAM:
            self._degrade(MID_STREAM)  # nothing to drop: we never had its older state
        else:
            self._reset(f"{reason}: {detail}")
        self.resync = True

    def _reset(self, reason: str) -> None:
        self.resets += 1
        self.unverified = None  # nothing left to verify: the engine is empty
        self._degrade(reason)
        self._out.append(ResetEngine(reason))

    def _degrade(self, reason: str) -> None:
        if self.degraded and self.degraded_reason == MID_STREAM and reason == MID_STREAM:
            return
        self.degraded = True
        self.degraded_reason = reason
        self.degraded_since = self._now
        self.clean_batches = 0
        self._out.append(MarkDegraded(reason))

    def _undegrade(self) -> None:
        if self.degraded:
            self._out.append(MarkRebuilt(self.degraded_reason))
        self.degraded = False
        self.degraded_reason = None
        self.clean_batches = 0
