"""The per-source sequence / replay / restart / degraded rules, without sockets.

Each case feeds a :class:`SourceState` a list of events and pins the actions it answers, step by
step, and the counters it ends with. Steps:

* ``("live", seq)`` a decodable live message (its batch's ts is ``float(seq)``); ``("bad", seq)``
  an undecodable one; ``("cleared", seq)`` one that carries ``AllBlocksCleared``.
* ``("answer", reaches)`` / ``("answer", reaches, first_ts)`` the last requested replay answered;
  ``("fill", seq)`` / ``("fill_bad", seq)`` one of its batches (``skip`` when already applied);
  ``("fail",)`` it failed; ``("crash",)`` handling it raised.
* ``("reconnect",)``, ``("seed", seq, ts)``, ``("drop", seq)`` (full queue), ``("emptied",)``
  (queue ran dry), ``("reset", reason)``, ``("apply_failed",)``, ``("cap",)`` (index cap),
  ``("at", t)`` (the clock moves to ``t``).

Actions read ``apply N``, ``replay N (reason)`` (``ts=X`` when the answer is verified),
``reset: reason`` (``reset, index did: reason`` when the index already cleared the engine),
``degraded: reason``, ``rebuilt``.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from indexer.source_state import (
    MAX_REPLAY_STREAK,
    Action,
    Apply,
    MarkDegraded,
    MarkRebuilt,
    RequestReplay,
    ResetEngine,
    SourceState,
)
from indexer.wire import AllBlocksCleared, DecodedBatch

GAP_NO_REPLAY = "gap: no replay endpoint"


def _batch(seq: int, cleared: bool = False) -> DecodedBatch:
    return DecodedBatch(float(seq), [AllBlocksCleared()] if cleared else [])


def _show(action: Action) -> str:
    if isinstance(action, Apply):
        return f"apply {action.seq}"
    if isinstance(action, RequestReplay):
        verify = "" if action.verify_ts is None else f" ts={action.verify_ts}"
        return f"replay {action.start} ({action.reason}){verify}"
    if isinstance(action, ResetEngine):
        return f"reset: {action.reason}" if action.clear else f"reset, index did: {action.reason}"
    if isinstance(action, MarkDegraded):
        return f"degraded: {action.reason}"
    assert isinstance(action, MarkRebuilt)
    return "rebuilt"


class Driver:
    """Feeds steps to a state, remembering the replay it asked for last."""

    def __init__(self, state: SourceState) -> None:
        self.state = state
        self.now = 100.0
        self.request: RequestReplay | None = None

    def step(self, kind: str, *args: Any) -> list[str] | bool | None:
        s, now = self.state, self.now
        actions: list[Action]
        if kind in ("live", "bad", "cleared"):
            seq = args[0]
            batch = None if kind == "bad" else _batch(seq, kind == "cleared")
            actions = s.live(seq, batch, now)
        elif kind == "answer":
            assert self.request is not None
            first_ts = args[1] if len(args) > 1 else None
            actions = s.replay_answered(self.request, args[0], first_ts, now)
        elif kind in ("fill", "fill_bad"):
            if s.already_applied(args[0]):
                return ["skip"]
            batch = None if kind == "fill_bad" else _batch(args[0])
            actions = s.replayed(args[0], batch, now)
        elif kind == "fail":
            assert self.request is not None
            actions = s.replay_failed(self.request, now)
        elif kind == "crash":
            assert self.request is not None
            actions = s.replay_crashed(self.request.reason, now)
        elif kind == "reconnect":
            return s.reconnected()
        elif kind == "seed":
            return s.seed(args[0], args[1])
        elif kind == "drop":
            return s.dropped(args[0])
        elif kind == "emptied":
            actions = s.queue_emptied(now)
        elif kind == "reset":
            actions = s.reset(args[0], now)
        elif kind == "apply_failed":
            actions = s.apply_failed(now)
        elif kind == "cap":
            actions = s.index_capped(now)
        elif kind == "at":
            self.now = args[0]
            return None
        else:
            raise ValueError(kind)
        for a in actions:
            if isinstance(a, RequestReplay):
                self.request = a
        return [_show(a) for a in actions]


Step = tuple[tuple[Any, ...], Any]
CASES: dict[str, tuple[dict[str, Any], list[Step], dict[str, Any]]] = {
    "in order": (
        {},
        [(("live", 0), ["apply 0"]), (("live", 1), ["apply 1"]), (("live", 2), ["apply 2"])],
        {"last_seq": 2, "batches": 3, "gaps": 0, "degraded": False, "last_event_ts": 2.0},
    ),
    "gap filled by replay, re-offered live batch is a duplicate": (
        {},
        [
            (("live", 0), ["apply 0"]),
            (("live", 3), ["replay 0 (gap) ts=0.0"]),
            (("answer", True, 0.0), []),
            (("fill", 0), ["skip"]),
            (("fill", 1), ["apply 1"]),
            (("fill", 2), ["apply 2"]),
            (("fill", 3), ["apply 3"]),
            (("live", 3), []),
            (("live", 4), ["apply 4"]),
        ],
        {"last_seq": 4, "gaps": 1, "replays_ok": 1, "duplicates": 1, "replay_streak": 0},
    ),
    "gap without replay endpoint: reset, degraded, the batch is the new base": (
        {"can_replay": False},
        [
            (("live", 0), ["apply 0"]),
            (("live", 1), ["apply 1"]),
            (("live", 3), [f"degraded: {GAP_NO_REPLAY}", f"reset: {GAP_NO_REPLAY}", "apply 3"]),
            (("live", 4), ["apply 4"]),
        ],
        {"last_seq": 4, "gaps": 1, "resets": 1, "degraded_reason": GAP_NO_REPLAY},
    ),
    "replay fails: reset, degraded, the waiting batch is the new base": (
        {},
        [
            (("live", 0), ["apply 0"]),
            (("live", 2), ["replay 0 (gap) ts=0.0"]),
            (("fail",), ["degraded: gap: replay failed", "reset: gap: replay failed"]),
            (("live", 2), ["apply 2"]),
        ],
        {"last_seq": 2, "replays_failed": 1, "resets": 1, "degraded": True, "resync": False},
    ),
    "replay cannot reach back: reset, what it has is the new base": (
        {},
        [
            (("live", 0), ["apply 0"]),
            (("live", 6), ["replay 0 (gap) ts=0.0"]),
            (
                ("answer", False),
                ["degraded: gap: replay cannot reach back", "reset: gap: replay cannot reach back"],
            ),
            (("fill", 4), ["apply 4"]),
            (("fill", 5), ["apply 5"]),
            (("fill", 6), ["apply 6"]),
            (("live", 6), []),
        ],
        {"last_seq": 6, "replays_failed": 1, "replays_ok": 0, "resets": 1, "duplicates": 1},
    ),
    "replay with a hole": (
        {},
        [
            (("live", 0), ["apply 0"]),
            (("live", 5), ["replay 0 (gap) ts=0.0"]),
            (("answer", True, 0.0), []),
            (("fill", 1), ["apply 1"]),
            (
                ("fill", 3),
                ["degraded: gap: replay has a hole", "reset: gap: replay has a hole", "apply 3"],
            ),
            (("fill", 4), ["apply 4"]),
            (("fill", 5), ["apply 5"]),
        ],
        {"last_seq": 5, "resets": 1, "replays_ok": 1, "degraded_reason": "gap: replay has a hole"},
    ),
    "crash while handling a replay: reset with the reason it was asked for": (
        {},
        [
            (("live", 0), ["apply 0"]),
            (("live", 2), ["replay 0 (gap) ts=0.0"]),
            (("crash",), ["degraded: gap: internal error", "reset: gap: internal error"]),
            (("live", 9), ["apply 9"]),
        ],
        {"last_seq": 9, "replays_failed": 0, "resets": 1, "gaps": 1},
    ),
    "undecodable live batch repaired by replay, its old seq then ignored": (
        {},
        [
            (("live", 0), ["apply 0"]),
            (("bad", 1), ["replay 0 (undecodable batch) ts=0.0"]),
            (("answer", True, 0.0), []),
            (("fill", 1), ["apply 1"]),
            (("fill", 2), ["apply 2"]),
            (("bad", 1), []),
            (("live", 2), []),
            (("live", 3), ["apply 3"]),
        ],
        {"last_seq": 3, "gaps": 0, "duplicates": 1, "degraded": False, "resets": 0},
    ),
    "undecodable batch still undecodable in the replay: reset, skipped": (
        {},
        [
            (("live", 0), ["apply 0"]),
            (("bad", 1), ["replay 0 (undecodable batch) ts=0.0"]),
            (("answer", True, 0.0), []),
            (("fill_bad", 1), ["degraded: undecodable batch", "reset: undecodable batch"]),
            (("fill", 2), ["apply 2"]),
            (("bad", 1), []),
            (("live", 2), []),
        ],
        {"last_seq": 2, "resets": 1, "batches": 2, "degraded_reason": "undecodable batch"},
    ),
    "undecodable batch without replay endpoint: reset, skipped": (
        {"can_replay": False},
        [
            (("live", 0), ["apply 0"]),
            (
                ("bad", 1),
                [
                    "degraded: undecodable batch: no replay endpoint",
                    "reset: undecodable batch: no replay endpoint",
                ],
            ),
            (("live", 2), ["apply 2"]),
        ],
        {"last_seq": 2, "resets": 1, "gaps": 0, "batches": 2},
    ),
    "undecodable first batch": (
        {"can_replay": False},
        [
            (("bad", 0), ["degraded: undecodable batch", "reset: undecodable batch"]),
            (("live", 1), ["apply 1"]),
        ],
        {"last_seq": 1, "resets": 1},
    ),
    "undecodable first batch with replay: replayed from its seq": (
        {},
        [(("bad", 0), ["replay 0 (undecodable batch)"])],
        {"last_seq": None, "replay_streak": 1},
    ),
    f"{MAX_REPLAY_STREAK} replays in a row without an in-order live batch: reset": (
        {},
        [
            (("live", 0), ["apply 0"]),
            (("drop", 5), None),
            (("emptied",), ["replay 0 (queue overflow) ts=0.0"]),
            (("answer", True, 0.0), []),
            (("fill", 1), ["apply 1"]),
            (("fill", 2), ["apply 2"]),
            (("fill", 3), ["apply 3"]),
            (("drop", 9), None),
            (("emptied",), ["replay 3 (queue overflow) ts=3.0"]),
            (("answer", True, 3.0), []),
            (("fill", 4), ["apply 4"]),
            (("drop", 12), None),
            (("emptied",), ["replay 4 (queue overflow) ts=4.0"]),
            (("answer", True, 4.0), []),
            (("fill", 5), ["apply 5"]),
            (("drop", 15), None),
            (
                ("emptied",),
                [
                    "degraded: queue overflow: replay did not repair it",
                    "reset: queue overflow: replay did not repair it",
                ],
            ),
            (("live", 16), ["apply 16"]),
            (("live", 18), ["replay 16 (gap) ts=16.0"]),
        ],
        {"gaps": 5, "replays_ok": 3, "resets": 1, "replay_streak": 1, "overflow_max": None},
    ),
    "an in-order live batch ends the replay streak": (
        {},
        [
            (("live", 0), ["apply 0"]),
            (("live", 2), ["replay 0 (gap) ts=0.0"]),
            (("answer", True, 0.0), []),
            (("fill", 1), ["apply 1"]),
            (("live", 2), ["apply 2"]),
        ],
        {"replay_streak": 0, "gaps": 1},
    ),
    "queue overflow with nothing after it is a gap once the queue runs dry": (
        {},
        [
            (("live", 0), ["apply 0"]),
            (("drop", 2), None),
            (("drop", 1), None),
            (("emptied",), ["replay 0 (queue overflow) ts=0.0"]),
            (("emptied",), []),
        ],
        {"gaps": 1, "overflow_max": None},
    ),
    "queue overflow covered by later batches is no extra gap": (
        {},
        [
            (("live", 0), ["apply 0"]),
            (("drop", 1), None),
            (("live", 2), ["replay 0 (gap) ts=0.0"]),
            (("answer", True, 0.0), []),
            (("fill", 1), ["apply 1"]),
            (("fill", 2), ["apply 2"]),
            (("live", 2), []),
            (("emptied",), []),
        ],
        {"gaps": 1, "overflow_max": None, "duplicates": 1},
    ),
    "restart: the live stream goes back to 0": (
        {},
        [
            (("live", 0), ["apply 0"]),
            (("live", 1), ["apply 1"]),
            (("live", 2), ["apply 2"]),
            (("live", 0), ["reset: restart", "apply 0"]),
            (("live", 1), ["apply 1"]),
        ],
        {"restarts": 1, "resets": 0, "degraded": False, "last_seq": 1, "batches": 5},
    ),
    "restart seen from seq 0 ends a degradation": (
        {"can_replay": False},
        [
            (("live", 0), ["apply 0"]),
            (("live", 2), [f"degraded: {GAP_NO_REPLAY}", f"reset: {GAP_NO_REPLAY}", "apply 2"]),
            (("live", 0), ["reset: restart", "rebuilt", "apply 0"]),
        ],
        {"restarts": 1, "resets": 1, "degraded": False, "degraded_reason": None},
    ),
    "restart seen mid-stream: replayed from 0": (
        {},
        [
            (("live", 3), ["replay 0 (joined mid-stream)"]),
            (("answer", True), []),
            (("fill", 0), ["apply 0"]),
            (("fill", 1), ["apply 1"]),
            (("fill", 2), ["apply 2"]),
            (("fill", 3), ["apply 3"]),
            (("live", 3), []),
            (("live", 4), ["apply 4"]),
            (("live", 2), ["reset: restart", "replay 0 (joined mid-stream)"]),
        ],
        {"restarts": 1, "last_seq": None, "duplicates": 1, "replay_streak": 1},
    ),
    "restart seen mid-stream without replay: degraded, not reset": (
        {"can_replay": False},
        [
            (("live", 0), ["apply 0"]),
            (("live", 1), ["apply 1"]),
            (("live", 1), ["reset: restart", "degraded: joined mid-stream", "apply 1"]),
        ],
        {"restarts": 1, "resets": 0, "degraded_reason": "joined mid-stream"},
    ),
    "old seq while the live stream moves forward is a duplicate, not a restart": (
        {},
        [
            (("live", 0), ["apply 0"]),
            (("live", 4), ["replay 0 (gap) ts=0.0"]),
            (("answer", True, 0.0), []),
            (("fill", 1), ["apply 1"]),
            (("fill", 2), ["apply 2"]),
            (("fill", 3), ["apply 3"]),
            (("fill", 4), ["apply 4"]),
            (("fill", 5), ["apply 5"]),
            (("live", 4), []),
            (("live", 5), []),
            (("live", 6), ["apply 6"]),
        ],
        {"duplicates": 2, "restarts": 0, "last_live_seq": 6},
    ),
    "joined mid-stream, replay reaches 0: exact": (
        {},
        [
            (("live", 2), ["replay 0 (joined mid-stream)"]),
            (("answer", True), []),
            (("fill", 0), ["apply 0"]),
            (("fill", 1), ["apply 1"]),
            (("fill", 2), ["apply 2"]),
            (("live", 2), []),
        ],
        {"degraded": False, "replays_ok": 1, "batches": 3, "gaps": 0},
    ),
    "joined mid-stream, replay too short: degraded, not reset": (
        {},
        [
            (("live", 5), ["replay 0 (joined mid-stream)"]),
            (("answer", False), ["degraded: joined mid-stream"]),
            (("fill", 3), ["apply 3"]),
            (("fill", 4), ["apply 4"]),
            (("fill", 5), ["apply 5"]),
            (("live", 5), []),
        ],
        {"degraded_reason": "joined mid-stream", "resets": 0, "replays_failed": 1},
    ),
    "joined mid-stream, replay failed: degraded, the batch is the base": (
        {},
        [
            (("live", 5), ["replay 0 (joined mid-stream)"]),
            (("fail",), ["degraded: joined mid-stream"]),
            (("live", 5), ["apply 5"]),
        ],
        {"degraded_reason": "joined mid-stream", "resets": 0, "last_seq": 5},
    ),
    "joined mid-stream without replay endpoint": (
        {"can_replay": False},
        [(("live", 5), ["degraded: joined mid-stream", "apply 5"]), (("live", 6), ["apply 6"])],
        {"degraded_reason": "joined mid-stream", "resets": 0, "gaps": 0},
    ),
    "gap after a reconnect: replay from our last seq, same ts: ordinary gap": (
        {},
        [
            (("live", 0), ["apply 0"]),
            (("live", 1), ["apply 1"]),
            (("reconnect",), None),
            (("live", 4), ["replay 1 (reconnect) ts=1.0"]),
            (("answer", True, 1.0), []),
            (("fill", 1), ["skip"]),
            (("fill", 2), ["apply 2"]),
            (("fill", 3), ["apply 3"]),
            (("fill", 4), ["apply 4"]),
            (("live", 4), []),
        ],
        {"restarts": 0, "replays_ok": 1, "unverified": None, "last_seq": 4, "gaps": 1},
    ),
    "gap after a reconnect, other ts: restart, replayed from 0": (
        {},
        [
            (("live", 0), ["apply 0"]),
            (("live", 1), ["apply 1"]),
            (("reconnect",), None),
            (("live", 4), ["replay 1 (reconnect) ts=1.0"]),
            (("answer", True, 7.5), ["reset: restart", "replay 0 (joined mid-stream)"]),
            (("answer", True), []),
            (("fill", 0), ["apply 0"]),
            (
                ("fill", 4),
                [
                    "degraded: joined mid-stream: replay has a hole",
                    "reset: joined mid-stream: replay has a hole",
                    "apply 4",
                ],
            ),
        ],
        {"restarts": 1, "replays_ok": 2, "resets": 1},
    ),
    "gap after a reconnect, replayed first batch undecodable: restart": (
        {},
        [
            (("live", 0), ["apply 0"]),
            (("reconnect",), None),
            (("live", 2), ["replay 0 (reconnect) ts=0.0"]),
            (("answer", True, None), ["reset: restart", "replay 0 (joined mid-stream)"]),
        ],
        {"restarts": 1, "last_seq": None, "resync": False},
    ),
    "gap after a reconnect, replay cannot reach back: reset": (
        {},
        [
            (("live", 0), ["apply 0"]),
            (("live", 1), ["apply 1"]),
            (("reconnect",), None),
            (("live", 9), ["replay 1 (reconnect) ts=1.0"]),
            (
                ("answer", False),
                [
                    "degraded: reconnect: replay cannot reach back",
                    "reset: reconnect: replay cannot reach back",
                ],
            ),
            (("fill", 7), ["apply 7"]),
        ],
        {"replays_failed": 1, "restarts": 0, "resets": 1},
    ),
    "after a reconnect even the next seq waits for the replay; once verified, gaps are ordinary": (
        {},
        [
            (("live", 0), ["apply 0"]),
            (("reconnect",), None),
            (("live", 1), ["replay 0 (reconnect) ts=0.0"]),
            (("answer", True, 0.0), []),
            (("fill", 0), ["skip"]),
            (("fill", 1), ["apply 1"]),
            (("live", 1), []),
            (("live", 3), ["replay 1 (gap) ts=1.0"]),
        ],
        {"unverified": None, "restarts": 0, "gaps": 1},
    ),
    "warm-start seed: the next seq waits for the replay that verifies the seed": (
        {},
        [
            (("seed", 10, None), False),
            (("seed", 10, 5.0), True),
            (("seed", 12, 6.0), False),
            (("live", 11), ["replay 10 (warm start) ts=5.0"]),
            (("answer", True, 5.0), []),
            (("fill", 10), ["skip"]),
            (("fill", 11), ["apply 11"]),
            (("live", 11), []),
            (("seed", 20, 7.0), False),
        ],
        {"last_seq": 11, "batches": 1, "unverified": None},
    ),
    "warm-start seed without a replay endpoint: refused": (
        {"can_replay": False},
        [(("seed", 10, 5.0), False), (("live", 13), ["degraded: joined mid-stream", "apply 13"])],
        {"gaps": 0, "last_seq": 13},
    ),
    "warm-start seed with ts then a gap: verified": (
        {},
        [
            (("seed", 10, 5.0), True),
            (("live", 13), ["replay 10 (warm start) ts=5.0"]),
            (("answer", True, 5.0), []),
            (("fill", 10), ["skip"]),
            (("fill", 11), ["apply 11"]),
        ],
        {"restarts": 0, "last_event_ts": 11.0},
    ),
    "warm-start seed then an older seq: the engine restarted since the snapshot": (
        {},
        [
            (("seed", 10, 5.0), True),
            (("live", 4), ["reset: restart", "replay 0 (joined mid-stream)"]),
        ],
        {"restarts": 1},
    ),
    "rebuilt after enough clean batches and enough time": (
        {"can_replay": False, "rebuild_batches": 2, "rebuild_s": 10.0},
        [
            (("live", 0), ["apply 0"]),
            (("live", 2), [f"degraded: {GAP_NO_REPLAY}", f"reset: {GAP_NO_REPLAY}", "apply 2"]),
            (("at", 105.0), None),
            (("live", 3), ["apply 3"]),
            (("live", 4), ["apply 4"]),
            (("at", 110.0), None),
            (("live", 5), ["rebuilt", "apply 5"]),
        ],
        {"degraded": False, "clean_batches": 0},
    ),
    "rebuilt at once by AllBlocksCleared": (
        {"can_replay": False},
        [
            (("live", 0), ["apply 0"]),
            (("live", 2), [f"degraded: {GAP_NO_REPLAY}", f"reset: {GAP_NO_REPLAY}", "apply 2"]),
            (("cleared", 3), ["rebuilt", "apply 3"]),
        ],
        {"degraded": False},
    ),
    "a new loss restarts the rebuild count (the new base counts as clean)": (
        {"can_replay": False, "rebuild_batches": 2, "rebuild_s": 0.0},
        [
            (("live", 0), ["apply 0"]),
            (("live", 2), [f"degraded: {GAP_NO_REPLAY}", f"reset: {GAP_NO_REPLAY}", "apply 2"]),
            (("live", 4), [f"degraded: {GAP_NO_REPLAY}", f"reset: {GAP_NO_REPLAY}", "apply 4"]),
            (("live", 5), ["rebuilt", "apply 5"]),
        ],
        {"resets": 2, "degraded": False},
    ),
    "index cap: degraded, the index already dropped the engine": (
        {},
        [
            (("live", 0), ["apply 0"]),
            (("cap",), ["degraded: index cap", "reset, index did: index cap"]),
            (("live", 1), ["apply 1"]),
        ],
        {"resets": 1, "degraded_reason": "index cap", "last_seq": 1},
    ),
    "reset from outside keeps the sequence state": (
        {},
        [
            (("live", 0), ["apply 0"]),
            (
                ("reset", "worker unhealthy"),
                ["degraded: worker unhealthy", "reset: worker unhealthy"],
            ),
            (("live", 1), ["apply 1"]),
            (("live", 0), ["reset: restart", "rebuilt", "apply 0"]),
        ],
        {"resets": 1, "restarts": 1, "degraded": False, "clean_batches": 0},
    ),
    "a failure while applying: reset, the next batch is the new base": (
        {},
        [
            (("live", 0), ["apply 0"]),
            (("apply_failed",), ["degraded: internal error", "reset: internal error"]),
            (("live", 7), ["apply 7"]),
        ],
        {"resets": 1, "gaps": 0, "last_seq": 7},
    ),
    "a second mid-stream degradation is not reported again": (
        {},
        [
            (("live", 5), ["replay 0 (joined mid-stream)"]),
            (("fail",), ["degraded: joined mid-stream"]),
            (("live", 5), ["apply 5"]),
            (("live", 2), ["reset: restart", "replay 0 (joined mid-stream)"]),
            (("fail",), []),
        ],
        {"degraded_reason": "joined mid-stream", "replays_failed": 2},
    ),
}


def run_case(kwargs: dict[str, Any], steps: list[Any], final: dict[str, Any]) -> None:
    """One table case: every step's actions as listed, then the state's fields as listed."""
    params: dict[str, Any] = {"can_replay": True, "rebuild_batches": 256, "rebuild_s": 30.0}
    state = SourceState(**{**params, **kwargs})
    driver = Driver(state)
    for i, (step, want) in enumerate(steps):
        got = driver.step(*step)
        assert got == want, f"step {i} {step}: {got} != {want}"
    for name, value in final.items():
        assert getattr(state, name) == value, name


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_rules(case: str) -> None:
    run_case(*CASES[case])


def test_actions_carry_the_batch_and_the_time() -> None:
    state = SourceState(can_replay=False, rebuild_batches=1, rebuild_s=5.0)
    first = _batch(0)
    assert state.live(0, first, 1.0) == [Apply(0, first)]
    state.live(2, _batch(2), 3.0)
    assert state.degraded and state.degraded_since == 3.0
    assert not any(isinstance(a, MarkRebuilt) for a in state.live(3, _batch(3), 7.9))
    assert isinstance(state.live(4, _batch(4), 8.0)[0], MarkRebuilt)


def test_events_are_counted() -> None:
    state = SourceState(can_replay=False, rebuild_batches=1, rebuild_s=0.0)
    state.live(0, DecodedBatch(1.0, [AllBlocksCleared(), AllBlocksCleared()]), 0.0)
    state.live(1, DecodedBatch(2.0, [AllBlocksCleared()]), 0.0)
    assert (state.batches, state.events, state.last_event_ts) == (2, 3, 2.0)


class ShortcutDriver(Driver):
    """A driver that offers every decodable live message to ``next_in_order`` first, as the
    subscriber's applier does, and takes ``live`` only when the shortcut declines."""

    taken = 0

    def step(self, kind: str, *args: Any) -> list[str] | bool | None:
        if kind == "live" and self.state.next_in_order(args[0], _batch(args[0])):
            ShortcutDriver.taken += 1
            return [f"apply {args[0]}"]
        return super().step(kind, *args)


def _fields(state: SourceState) -> dict[str, Any]:
    out = {
        name: getattr(state, name)
        for name in SourceState.__dataclass_fields__
        if name not in ("_out", "_now")  # scratch of the event being handled
    }
    if state.replay is not None:  # (compared by identity; two drivers ask two requests)
        out["replay"] = _show(state.replay)
    return out


def _lockstep(kwargs: dict[str, Any], steps: list[tuple[Any, ...]]) -> None:
    """The same steps through both drivers: same actions and the same state after each."""
    params: dict[str, Any] = {"can_replay": True, "rebuild_batches": 256, "rebuild_s": 30.0}
    plain = Driver(SourceState(**{**params, **kwargs}))
    fast = ShortcutDriver(SourceState(**{**params, **kwargs}))
    for i, step in enumerate(steps):
        want, got = plain.step(*step), fast.step(*step)
        assert got == want, f"step {i} {step}: {got} != {want}"
        assert _fields(fast.state) == _fields(plain.state), f"step {i} {step}"


def test_in_order_shortcut_agrees_with_live_in_every_rule_case() -> None:
    before = ShortcutDriver.taken
    for kwargs, steps, _final in CASES.values():
        _lockstep(kwargs, [step for step, _want in steps])
    assert ShortcutDriver.taken - before > 10  # the shortcut is exercised, not always declined


@pytest.mark.parametrize("seed", range(40))
def test_in_order_shortcut_agrees_with_live_on_random_streams(seed: int) -> None:
    """Gaps, restarts, drops, reconnects, undecodable and clearing batches and resets in random
    order, on a source without replay (so the stream never waits): the degraded, resync and
    unverified states all occur and the shortcut must step aside in each."""
    rng = random.Random(seed)
    seq = 0
    steps: list[tuple[Any, ...]] = []
    for _ in range(300):
        r = rng.random()
        if r < 0.6:
            steps.append(("live", seq))
            seq += 1
        elif r < 0.7:
            seq += rng.randint(1, 3)  # a gap
        elif r < 0.75:
            seq = rng.randint(0, 3) if rng.random() < 0.5 else max(seq - 2, 0)  # restart
        elif r < 0.8:
            steps.append(("drop", seq))
            seq += 1
        elif r < 0.85:
            steps.append(("emptied",))
        elif r < 0.88:
            steps.append(("reconnect",))
        elif r < 0.91:
            steps.append(("bad", seq))
            seq += 1
        elif r < 0.94:
            steps.append(("cleared", seq))
            seq += 1
        elif r < 0.97:
            steps.append(("at", 100.0 + rng.random() * 100))
        else:
            steps.append(("reset", "worker unreachable"))
    before = ShortcutDriver.taken
    _lockstep({"can_replay": False, "rebuild_batches": rng.randint(1, 8), "rebuild_s": 5.0}, steps)
    assert ShortcutDriver.taken > before
