"""Publisher restarts: told from the state the index holds after every reconnect and warm start,
whichever socket shows the new incarnation first; counted when found during a resync; a replay
in flight abandoned on reset. Plus the reader's per-message time bound.

The rules are pinned on :class:`SourceState` alone (steps as in ``tests/test_source_state.py``),
then end to end against the protocol-exact vLLM publisher on loopback ZMQ, with the helpers of
``tests/test_subscriber.py`` (probe synchronisation, deadline polling, reference index).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from typing import Any

import pytest
import zmq
import zmq.asyncio

from indexer.feed import Feed, FeedOptions
from indexer.index import PrefixIndex
from indexer.source_state import SourceState
from indexer.subscriber import RECV_BATCH, RECV_BUDGET_S, Subscriber
from indexer.wire import decode_payload
from router.config import WorkerSpec
from router.metrics import RouterMetrics, fleet_state
from router.workers import Worker
from simulator.testing import find_port_block
from tests import test_subscriber
from tests.test_source_state import Driver, run_case
from tests.test_subscriber import (
    DEADLINE,
    MODEL,
    _assert_same,
    _one,
    _reference,
    _st,
    _sync,
    _until,
)
from tests.vllm_publisher import Chains, VllmPublisher, encode_batch

ENGINE = ("w", 0)

make = test_subscriber.make
"""The fixture of ``tests/test_subscriber.py``: publisher and subscriber factories, all closed
at the end."""

# ---------------------------------------------------------------------- the rule, without sockets

Step = tuple[tuple[Any, ...], Any]
CASES: dict[str, tuple[dict[str, Any], list[Step], dict[str, Any]]] = {
    "reconnect, restarted publisher at exactly the next seq: replay shows it, rebuilt from 0": (
        {},
        [
            (("live", 0), ["apply 0"]),
            (("live", 1), ["apply 1"]),
            (("reconnect",), None),
            (("live", 2), ["replay 1 (reconnect) ts=1.0"]),
            (("answer", True, 901.0), ["reset: restart", "replay 0 (joined mid-stream)"]),
            (("answer", True), []),
            (("fill", 0), ["apply 0"]),
            (("fill", 1), ["apply 1"]),
            (("fill", 2), ["apply 2"]),
            (("live", 2), []),
            (("live", 3), ["apply 3"]),
        ],
        {"restarts": 1, "resync_restarts": 0, "resets": 0, "degraded": False, "last_seq": 3},
    ),
    "reconnect, same publisher at the next seq: verified, nothing dropped": (
        {},
        [
            (("live", 0), ["apply 0"]),
            (("reconnect",), None),
            (("live", 1), ["replay 0 (reconnect) ts=0.0"]),
            (("answer", True, 0.0), []),
            (("fill", 0), ["skip"]),
            (("fill", 1), ["apply 1"]),
            (("live", 1), []),
            (("live", 2), ["apply 2"]),
        ],
        {"restarts": 0, "resets": 0, "gaps": 0, "unverified": None, "batches": 3},
    ),
    "reconnect without a replay endpoint: the next seq cannot be verified, reset": (
        {"can_replay": False},
        [
            (("live", 0), ["apply 0"]),
            (("reconnect",), None),
            (
                ("live", 1),
                [
                    "degraded: reconnect: no replay endpoint",
                    "reset: reconnect: no replay endpoint",
                    "apply 1",
                ],
            ),
            (("live", 2), ["apply 2"]),
        ],
        {"restarts": 0, "resets": 1, "degraded": True, "unverified": None},
    ),
    "reconnect, seq 0 again: a restart at once, exact even without replay": (
        {"can_replay": False},
        [
            (("live", 0), ["apply 0"]),
            (("live", 1), ["apply 1"]),
            (("reconnect",), None),
            (("live", 0), ["reset: restart", "apply 0"]),
        ],
        {"restarts": 1, "resets": 0, "degraded": False, "unverified": None},
    ),
    "warm start, restarted publisher at exactly the next seq: replay shows it": (
        {},
        [
            (("seed", 10, 5.0), True),
            (("live", 11), ["replay 10 (warm start) ts=5.0"]),
            (("answer", True, 77.0), ["reset: restart", "replay 0 (joined mid-stream)"]),
        ],
        {"restarts": 1, "resync_restarts": 0, "last_seq": None, "unverified": None},
    ),
    "a warm start needs the snapshot's ts": (
        {},
        [(("seed", 10, None), False), (("live", 11), ["replay 0 (joined mid-stream)"])],
        {"last_seq": None},
    ),
    "restart shown by a repair replay: counted as found during resync": (
        {},
        [
            (("live", 0), ["apply 0"]),
            (("live", 1), ["apply 1"]),
            (("live", 4), ["replay 1 (gap) ts=1.0"]),
            (("answer", True, 55.0), ["reset: restart", "replay 0 (joined mid-stream)"]),
            (("answer", True), []),
            (("fill", 0), ["apply 0"]),
        ],
        {"restarts": 1, "resync_restarts": 1, "resets": 0, "gaps": 1},
    ),
    "restart shown by the live stream while a failed repair waits for a base: counted": (
        {},
        [
            (("live", 0), ["apply 0"]),
            (("live", 1), ["apply 1"]),
            (("live", 4), ["replay 1 (gap) ts=1.0"]),
            (("fail",), ["degraded: gap: replay failed", "reset: gap: replay failed"]),
            (("live", 0), ["reset: restart", "rebuilt", "apply 0"]),
        ],
        {"restarts": 1, "resync_restarts": 1, "degraded": False},
    ),
    "a reset abandons the replay in flight: its answer and batches change nothing": (
        {},
        [
            (("live", 0), ["apply 0"]),
            (("live", 3), ["replay 0 (gap) ts=0.0"]),
            (
                ("reset", "worker unhealthy"),
                ["degraded: worker unhealthy", "reset: worker unhealthy"],
            ),
            (("answer", True, 0.0), []),
            (("fill", 1), []),
            (("fill", 2), []),
            (("fail",), []),
        ],
        {"last_seq": 0, "replays_ok": 0, "replays_failed": 0, "replay": None, "batches": 1},
    ),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_restart_rules(case: str) -> None:
    run_case(*CASES[case])


def test_an_empty_verification_answer_is_a_restart() -> None:
    """The publisher we hear keeps its latest batches: one that answers nothing from our last
    applied seq on never got that far, so it is a new incarnation (rebuilt exactly from 0)."""
    state = SourceState(can_replay=True, rebuild_batches=256, rebuild_s=30.0)
    driver = Driver(state)
    steps: list[Step] = [
        (("live", 0), ["apply 0"]),
        (("live", 5), ["replay 0 (gap) ts=0.0"]),
        (("answer", True, 0.0), []),
        *[(("fill", seq), [f"apply {seq}"]) for seq in range(1, 9)],  # the replay ran ahead
        (("live", 5), []),
        (("reconnect",), None),
        (("live", 6), ["replay 8 (reconnect) ts=8.0"]),  # new incarnation, at seq 6 only
    ]
    for step, want in steps:
        assert driver.step(*step) == want, step
    assert driver.request is not None
    got = state.replay_answered(driver.request, False, None, 100.0, empty=True)
    assert [type(a).__name__ for a in got] == ["ResetEngine", "RequestReplay"]
    assert (got[1].start, state.restarts, state.resets, state.degraded) == (0, 1, 0, False)


def _final(steps: list[tuple[Any, ...]]) -> tuple[Any, ...]:
    state = SourceState(can_replay=True, rebuild_batches=256, rebuild_s=30.0)
    driver = Driver(state)
    applied: list[str] = []
    for step in steps:
        got = driver.step(*step)
        if isinstance(got, list):
            applied += [a for a in got if a.startswith(("apply", "reset"))]
    return state.last_seq, state.restarts, state.degraded, state.resets, applied[-5:]


def test_outcome_does_not_depend_on_which_socket_shows_the_restart() -> None:
    """Old incarnation applied to seq 1; the new one has batches 0..3 (other ts). Either the
    live stream shows it first (after the reconnect) or a repair replay's answer does."""
    new_history = [("fill", 0), ("fill", 1), ("fill", 2), ("fill", 3)]
    live_first = [
        ("live", 0),
        ("live", 1),
        ("reconnect",),
        ("live", 3),
        ("answer", True, 50.0),
        ("answer", True),
        *new_history,
        ("live", 3),
    ]
    replay_first = [
        ("live", 0),
        ("live", 1),
        ("bad", 2),  # the old incarnation's last batch, lost: repair in flight...
        ("answer", True, 50.0),  # ...answered by the new incarnation
        ("answer", True),
        *new_history,
        ("reconnect",),
        ("live", 3),
        ("answer", True, 3.0),
        ("fill", 3),
        ("live", 3),
    ]
    assert _final(live_first) == _final(replay_first)
    assert _final(live_first)[:4] == (3, 1, False, 0)


# ---------------------------------------------------------------------- end to end


class HeldReplayPublisher(VllmPublisher):
    """Serves replay requests only once :attr:`ready` is set: a request that arrives while the
    process is still starting waits in its ROUTER, as it would in a real restarting vLLM."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.ready = threading.Event()
        super().__init__(*args, **kwargs)

    def _serve_replay(self) -> None:
        self.ready.wait(DEADLINE)
        super()._serve_replay()


def _gpu_tokens(sub: Subscriber, prompt: list[int]) -> int:
    """Predicted GPU hit of ``prompt`` followed by one more token (so all its blocks count)."""
    m = sub.index.match([*prompt, 1], sub.index.root(MODEL), [ENGINE]).get(ENGINE)
    return m.gpu_tokens if m else 0


def _gone(sub: Subscriber, prompts: list[list[int]]) -> bool:
    return all(_gpu_tokens(sub, p) == 0 for p in prompts)


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
async def test_restart_at_the_next_seq_drops_the_stale_state(make, replay: bool) -> None:
    new_pub, _ = make
    pub, sub = await _one(make, replay=replay, reconnect_backoff_s=(0.05, 0.1))
    old = Chains(40)
    for _ in range(5):
        pub.publish(old.request(3))
    await _until(lambda: _st(sub, "w").last_seq == 4, what="old history applied")
    assert not _gone(sub, old.prompts)
    port = pub.port
    rport = int(pub.replay_endpoint.rsplit(":", 1)[1]) if pub.replay_endpoint else None
    pub.close()
    await _until(lambda: not _st(sub, "w").connected, what="disconnect seen")
    pub2 = new_pub(
        endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{rport}" if rport else None
    )
    new = Chains(41)
    for _ in range(5):
        pub2.publish(new.request(2), drop=True)  # 0..4 while nobody listened
    await _sync(sub, pub2, "w")
    pub2.publish(new.request(2))  # seq 5: exactly the seq the old state expects next
    await _until(lambda: _st(sub, "w").last_seq == 5, what="seq 5 taken")
    assert await sub.wait_idle(DEADLINE)
    st = _st(sub, "w")
    assert _gone(sub, old.prompts)  # nothing of the old incarnation is predicted
    assert _gpu_tokens(sub, new.prompts[-1]) == 32  # the new batch is applied
    if replay:
        assert (st.restarts, st.resets, st.degraded) == (1, 0, False)
        assert pub2.replay_requests == [4, 0]
        _assert_same(sub.index, _reference((ENGINE, pub2)), ENGINE, new)
    else:
        assert (
            st.degraded and st.resets == 1 and st.degraded_reason == "reconnect: no replay endpoint"
        )


async def _restart_scenario(make, replay_first: bool, worker: str = "w"):
    """Old publisher: seqs 0..4 applied, 5 lost, 6 live. The restarted one has published 0..8
    unheard and then publishes 9 live. ``replay_first``: the old one has no working replay
    endpoint, so the repair of seq 5 is still in flight when the new one starts, and its answer
    (from the new one) comes before any live message of the new one. Otherwise the old one
    repairs it and the new one shows itself on the live stream first."""
    new_pub, new_sub = make
    rport = find_port_block(1)
    pub = new_pub(replay_endpoint=None if replay_first else f"tcp://127.0.0.1:{rport}")
    sub = await new_sub(reconnect_backoff_s=(0.05, 0.1), replay_timeout_s=DEADLINE)
    sub.add_worker(worker, pub.endpoint, f"tcp://127.0.0.1:{rport}", model=MODEL)
    await _sync(sub, pub, worker)
    old = Chains(70)
    for _ in range(5):
        pub.publish(old.request(3))
    await _until(lambda: _st(sub, worker).last_seq == 4, what="old history applied")
    pub.publish(old.request(3), drop=True)
    pub.publish(old.request(3))
    if replay_first:
        await _until(lambda: _st(sub, worker).replaying, what="repair in flight")
    else:
        await _until(lambda: _st(sub, worker).last_seq == 6, what="repaired by the old one")
    port = pub.port
    pub.close()
    pub2 = HeldReplayPublisher(endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{rport}")
    try:
        new = Chains(71)
        for _ in range(9):
            pub2.publish(new.request(2), drop=True)
        pub2.ready.set()
        await _sync(sub, pub2, worker)
        pub2.publish(new.request(2))
        await _until(lambda: _st(sub, worker).last_seq == 9, what="seq 9 taken")
        assert await sub.wait_idle(DEADLINE)
        return sub, pub2, old, new
    finally:
        pub2.close()


@pytest.mark.parametrize("replay_first", [False, True], ids=["live-first", "replay-first"])
async def test_restart_outcome_does_not_depend_on_which_socket_shows_it(
    make,
    replay_first: bool,
) -> None:
    sub, pub2, old, new = await _restart_scenario(make, replay_first)
    st = _st(sub, "w")
    assert (st.restarts, st.resets, st.degraded, st.last_seq) == (1, 0, False, 9)
    assert _gone(sub, old.prompts)
    _assert_same(sub.index, _reference((ENGINE, pub2)), ENGINE, new)


class EagerPublisher:
    """A restarted publisher whose live batch leaves the moment our subscription reaches it
    (an XPUB sees the subscription), so it arrives right behind the connection's handshake.
    Its replay ROUTER (a :class:`VllmPublisher` whose own PUB stays unused) buffers
    ``history`` and that batch."""

    def __init__(self, port: int, rport: int, history: list[bytes], live: bytes) -> None:
        self.replay = VllmPublisher(replay_endpoint=f"tcp://*:{rport}")
        for payload in history:
            self.replay.publish_payload(payload, drop=True)
        self.seq = self.replay.publish_payload(live, drop=True)
        self.ctx = zmq.Context()
        self.xpub = self.ctx.socket(zmq.XPUB)
        self.xpub.setsockopt(zmq.LINGER, 0)
        self.xpub.bind(f"tcp://*:{port}")
        self.sent = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(live,), daemon=True)
        self._thread.start()

    def _serve(self, live: bytes) -> None:
        if self.xpub.poll(int(DEADLINE * 1000)) and self.xpub.recv()[:1] == b"\x01":
            self.xpub.send_multipart([b"", self.seq.to_bytes(8, "big"), live])
            self.sent.set()

    def close(self) -> None:
        self._thread.join(DEADLINE)
        self.xpub.close(linger=0)
        self.ctx.term()
        self.replay.close()


async def _eager_restart(sub: Subscriber, port: int, rport: int, restart: int) -> None:
    await _until(lambda: not _st(sub, "w").connected, what="disconnect seen")
    chains = Chains(90 + restart)
    history = [encode_batch(chains.request(2)) for _ in range(4 + restart)]  # live: last + 1
    eager = EagerPublisher(port, rport, history, encode_batch(chains.request(2)))
    try:
        # The loop is busy until the batch is on its way, so the handshake and the batch are
        # both waiting when it runs again (ZMQ reconnects on its own threads).
        assert eager.sent.wait(DEADLINE), "never subscribed to"
        await _until(
            lambda: _st(sub, "w").restarts == restart and _st(sub, "w").last_seq == eager.seq,
            what=f"restart {restart} taken",
        )
        assert await sub.wait_idle(DEADLINE)
        st = _st(sub, "w")
        assert (st.resets, st.degraded) == (0, False)
        _assert_same(sub.index, _reference((ENGINE, eager.replay)), ENGINE, chains)
    finally:
        eager.close()


async def test_first_batch_right_behind_the_handshake_is_verified(make) -> None:
    """The reconnect is queued before any message of the new connection, whichever socket the
    loop serves first: three restarts in a row, each new incarnation's first batch carrying
    exactly the seq we expect next and sent the moment it is subscribed to."""
    pub, sub = await _one(make, reconnect_backoff_s=(0.02, 0.05))
    port, rport = pub.port, int(pub.replay_endpoint.rsplit(":", 1)[1])
    chains = Chains(90)
    for _ in range(5):
        pub.publish(chains.request(2))
    await _until(lambda: _st(sub, "w").last_seq == 4, what="first history applied")
    pub.close()
    for restart in range(1, 4):
        await _eager_restart(sub, port, rport, restart)


async def test_restart_during_resync_is_counted_and_reported(make) -> None:
    url = "http://w:8000"
    sub, _, _, _ = await _restart_scenario(make, replay_first=True, worker=url)
    st = _st(sub, url)
    assert (st.restarts, st.resync_restarts) == (1, 1)
    worker = Worker(WorkerSpec(url=url), client=None)  # type: ignore[arg-type]
    metrics = RouterMetrics(lambda: fleet_state([worker], sub.index, {url: sub.status()}))
    text = metrics.render().decode()
    assert f'kvrouter_publisher_restarts_total{{worker="{url}"}} 1.0' in text
    assert f'kvrouter_publisher_restarts_during_resync_total{{worker="{url}"}} 1.0' in text


async def test_replay_in_flight_is_cancelled_when_the_source_is_reset(make) -> None:
    applied: list[int] = []
    pub, sub = await _one(
        make, replay_timeout_s=0.5, on_batch=lambda engine, seq, batch: applied.append(seq)
    )
    chains = Chains(50)
    for _ in range(3):
        pub.publish(chains.request(2))
    await _until(lambda: _st(sub, "w").last_seq == 2, what="seqs 0..2 applied")
    pub.replay_delay_s = 0.2  # the answer is slow: the reset comes while it is in flight
    for _ in range(3):
        pub.publish(chains.request(2), drop=True)
    pub.publish(chains.request(2))  # seq 6: a gap, repaired by replay
    await _until(lambda: len(pub.replay_requests) == 1, what="replay asked")
    pub.mute_replay = True  # replays asked after the reset go unanswered
    before = len(applied)
    assert sub.drop_worker_state("w", "worker unhealthy") == 1
    assert not _st(sub, "w").replaying  # cancelled at once
    await _until(lambda: len(pub.replay_spans) == 1, what="the old answer fully sent")
    await _until(lambda: len(pub.replay_requests) == 2, what="the next replay asked")
    assert await sub.wait_idle(DEADLINE)
    st = _st(sub, "w")
    assert applied[before:] == [6]  # nothing of the old answer; seq 6 is the new base
    assert st.replays_ok == 0 and st.degraded and st.degraded_reason == "gap: replay failed"


async def test_warm_start_then_restarted_publisher_is_detected(make) -> None:
    new_pub, new_sub = make
    old = Chains(60)  # the snapshot another replica took at seq 4 of the old incarnation
    snap = PrefixIndex()
    snap.add_engine(ENGINE, MODEL)
    for i in range(5):
        snap.apply(ENGINE, decode_payload(encode_batch(old.request(3), ts=1000.0 + i)).events)
    pub = new_pub()  # the engine restarted since the snapshot
    new = Chains(61)
    for _ in range(5):
        pub.publish(new.request(2), drop=True)  # 0..4 before the router came up
    sub = await new_sub()
    sub.add_worker("w", pub.endpoint, pub.replay_endpoint, model=MODEL)
    sub.index.import_engine(ENGINE, snap.export_engine(ENGINE))
    assert sub.seed_seq(ENGINE, 4, 1004.0)
    assert not _gone(sub, old.prompts)
    await _sync(sub, pub, "w")
    pub.publish(new.request(2))  # seq 5: exactly the seq after the snapshot's
    await _until(lambda: _st(sub, "w").last_seq == 5, what="seq 5 taken")
    assert await sub.wait_idle(DEADLINE)
    st = _st(sub, "w")
    assert (st.restarts, st.resets, st.degraded) == (1, 0, False)
    assert pub.replay_requests == [4, 0]
    assert _gone(sub, old.prompts)
    _assert_same(sub.index, _reference((ENGINE, pub)), ENGINE, new)


async def test_warm_start_of_the_same_publisher_goes_on_from_the_snapshot(make) -> None:
    """The verification costs one replay and nothing else: the snapshot's state is kept."""
    new_pub, new_sub = make
    pub = new_pub()
    chains = Chains(62)
    for _ in range(5):
        pub.publish(chains.request(2), drop=True)
    sub = await new_sub()
    sub.add_worker("w", pub.endpoint, pub.replay_endpoint, model=MODEL)
    ref = _reference((ENGINE, pub))
    sub.index.import_engine(ENGINE, ref.export_engine(ENGINE))
    assert sub.seed_seq(ENGINE, 4, decode_payload(pub.sent[4][1]).ts)
    await _sync(sub, pub, "w")
    pub.publish(chains.request(2))
    await _until(lambda: _st(sub, "w").last_seq == 5, what="seq 5 taken")
    assert await sub.wait_idle(DEADLINE)
    st = _st(sub, "w")
    assert (st.restarts, st.resets, st.degraded, st.batches) == (0, 0, False, 1)
    assert pub.replay_requests == [4]
    _assert_same(sub.index, _reference((ENGINE, pub)), ENGINE, chains)


# ---------------------------------------------------------------------- the reader's time bound


async def test_reader_yields_to_the_loop_after_every_message_over_its_budget() -> None:
    """A burst of large batches, each taking longer to handle than the per-turn budget: the
    reader hands the loop back after every one of them, not after a fixed count."""
    chains = Chains(80)
    payload = encode_batch([e for _ in range(400) for e in chains.request(8)])
    n_msgs = 40
    turns: list[int] = [0]  # burst messages routed per reader turn
    ticks = 0  # loop turns seen by a concurrent task
    seen_at: list[int] = []  # ``ticks`` when each burst message was routed
    probe_seq = (1 << 63).to_bytes(8, "big")
    probes = 0

    def on_message(frames: list[bytes]) -> None:
        nonlocal probes
        if frames[1] == probe_seq:
            probes += 1
            return
        decode_payload(frames[2])  # the real work of a large batch,
        spin_until = time.perf_counter() + 2 * RECV_BUDGET_S  # made over the budget on any host
        while time.perf_counter() < spin_until:
            pass
        turns[-1] += 1
        seen_at.append(ticks)

    def on_read() -> None:
        turns.append(0)

    async def probe() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    ctx = zmq.asyncio.Context()
    pub = VllmPublisher(replay_endpoint=None)
    options = FeedOptions("", 100_000, (0.05, 0.1), 0.0, RECV_BATCH, RECV_BUDGET_S)
    feed = Feed(ctx, pub.endpoint, options, bind=False, on_message=on_message, on_read=on_read)
    ticker = asyncio.get_running_loop().create_task(probe())
    try:
        deadline = time.monotonic() + DEADLINE
        while not probes:  # slow joiner: probe until the subscription is live
            assert time.monotonic() < deadline, "subscription never became live"
            pub.send_raw([b"", probe_seq, b"probe"])
            await asyncio.sleep(0.01)
        for seq in range(n_msgs):  # one burst, all queued on the socket before the reader runs
            pub.send_raw([b"", seq.to_bytes(8, "big"), payload])
        await _until(lambda: len(seen_at) == n_msgs, what="burst read")
        assert max(turns) == 1, turns
        assert all(b > a for a, b in itertools.pairwise(seen_at)), seen_at
    finally:
        ticker.cancel()
        await asyncio.gather(ticker, return_exceptions=True)
        feed.close()
        pub.close()
        ctx.destroy(linger=0)
