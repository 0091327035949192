"""The event subscriber against a protocol-exact vLLM 0.33 publisher on loopback ZMQ.

Synchronisation (no fixed sleeps): ZMQ's slow joiner means a PUB drops messages until the SUB's
subscription reaches it, and a seq lost that way would look like joining mid-stream. So every
test first polls ``status().connected`` (socket monitor: ZMTP handshake done), then *probes*: the
publisher sends a deliberately malformed 2-frame message ``[topic, b"probe"]`` every 10 ms until
the subscriber has counted one as a garbage frame. From then on the subscription is in place and
nothing is lost; the probes touch neither seq numbers nor the replay buffer, and the index ignores
them. Everything else waits with ``wait_idle`` or ``_until`` (deadline polling).
"""

from __future__ import annotations

import asyncio
import io
import itertools
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest

from indexer.index import PrefixIndex
from indexer.subscriber import Subscriber, concrete_endpoint
from indexer.wire import decode_payload
from tests.vllm_publisher import (
    Chains,
    VllmPublisher,
    all_blocks_cleared,
    encode_batch,
)

MODEL = "m"
DEADLINE = 8.0


async def _until(
    cond: Callable[[], bool], timeout: float = DEADLINE, what: str | Callable[[], str] = ""
) -> None:
    """Poll ``cond`` until ``timeout``; ``what`` names it, or is called at the timeout to
    describe the state then (a message built before the wait shows the state before it)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            why = what() if callable(what) else what or cond
            raise AssertionError(f"timed out waiting for {why}")
        await asyncio.sleep(0.005)


def _dump(sub: Subscriber, pub: VllmPublisher, worker: str = "w") -> str:
    """What a timed-out wait reports, read when it times out: the source's status and state,
    its queue, the scheduled applier turn and the replay task's stack."""
    src = sub._sources[(worker, 0)]
    task = src.replay_task
    lines = [
        f"publisher seq {pub.seq}, replay requests {pub.replay_requests[-10:]}",
        f"status {_st(sub, worker)}",
        f"state {src.state}",
        f"queue {[seq for seq, _, _ in src.queue]}, ready {list(sub._ready)}, "
        f"applier {sub._applier}, socket input {src.feed is not None and src.feed.has_input()}",
        f"replay task {task}",
    ]
    if task is not None:
        stack = io.StringIO()
        task.print_stack(file=stack)
        lines.append(stack.getvalue())
    return "\n".join(lines)


def _st(sub: Subscriber, worker: str, rank: int = 0):
    for s in sub.status():
        if s.worker_id == worker and s.dp_rank == rank:
            return s
    raise KeyError((worker, rank))


async def _sync(sub: Subscriber, pub: VllmPublisher, worker: str, rank: int = 0) -> None:
    """Wait until ``sub`` demonstrably receives ``pub``'s messages (see module docstring)."""
    if not sub.bind:
        await _until(lambda: _st(sub, worker, rank).connected, what="connected")
    deadline = time.monotonic() + DEADLINE
    seen = _st(sub, worker, rank).garbage_frames
    while _st(sub, worker, rank).garbage_frames == seen:
        if time.monotonic() > deadline:
            raise AssertionError("subscription never became live")
        pub.send_raw([pub.topic, b"probe"])
        await asyncio.sleep(0.01)
    assert await sub.wait_idle(DEADLINE)


def _reference(*pubs: tuple[tuple[str, int], VllmPublisher], model: str = MODEL) -> PrefixIndex:
    """The index a loss-free subscriber would build: every batch applied in seq order."""
    ref = PrefixIndex()
    for engine, pub in pubs:
        ref.add_engine(engine, model)
        for _, payload in pub.sent:
            ref.apply(engine, decode_payload(payload).events)
    return ref


def _assert_same(index: PrefixIndex, ref: PrefixIndex, engine, chains: Chains) -> None:
    got, want = index.engine_stats(engine), ref.engine_stats(engine)
    assert got is not None and want is not None
    assert got.resident == want.resident
    assert got.hashes == want.hashes
    root = index.root(MODEL)
    for prompt in chains.prompts:
        a = index.match(prompt, root, [engine]).get(engine)
        b = ref.match(prompt, ref.root(MODEL), [engine]).get(engine)
        assert (a.gpu_tokens if a else 0) == (b.gpu_tokens if b else 0)


@pytest.fixture
async def make():
    """Factory for (subscriber, publishers); everything is closed at the end."""
    subs: list[Subscriber] = []
    pubs: list[VllmPublisher] = []

    def pub(**kw) -> VllmPublisher:
        p = VllmPublisher(**kw)
        pubs.append(p)
        return p

    async def sub(index: PrefixIndex | None = None, **kw) -> Subscriber:
        s = Subscriber(index if index is not None else PrefixIndex(), **kw)
        subs.append(s)
        await s.start()
        return s

    yield pub, sub
    for s in subs:
        await s.stop()
    for p in pubs:
        p.close()


async def _one(make, *, replay: bool = True, pub_kw=None, **sub_kw):
    new_pub, new_sub = make
    pub = new_pub(replay_endpoint="tcp://127.0.0.1:*" if replay else None, **(pub_kw or {}))
    sub = await new_sub(**sub_kw)
    sub.add_worker("w", pub.endpoint, pub.replay_endpoint, model=MODEL)
    await _sync(sub, pub, "w")
    return pub, sub


# ---------------------------------------------------------------------- unit


def test_concrete_endpoint() -> None:
    assert concrete_endpoint("tcp://*:5557", "10.0.0.7") == "tcp://10.0.0.7:5557"
    assert concrete_endpoint("tcp://0.0.0.0:5557", "h", 2) == "tcp://h:5559"
    assert concrete_endpoint("tcp://*:5557", "fd00::1", 1) == "tcp://[fd00::1]:5558"
    assert concrete_endpoint("tcp://other:5557", "h", 1) == "tcp://other:5558"
    assert concrete_endpoint("tcp://*:0", "h", 3) == "tcp://h:0"
    assert concrete_endpoint("inproc://ev", "h", 1) == "inproc://ev_dp1"
    with pytest.raises(ValueError):
        concrete_endpoint("ipc:///tmp/x", "h", 1)
    assert concrete_endpoint("ipc:///tmp/x", "h", 0) == "ipc:///tmp/x"


# ---------------------------------------------------------------------- basic flow


async def test_applies_batches_in_order(make) -> None:
    pub, sub = await _one(make)
    chains = Chains(1)
    for _ in range(20):
        pub.publish(chains.request(4, chunks=2))
    pub.publish([chains.evict(3, 2)])
    await _until(lambda: _st(sub, "w").last_seq == 20, what="last seq")
    assert await sub.wait_idle(DEADLINE)
    _assert_same(sub.index, _reference((("w", 0), pub)), ("w", 0), chains)
    st = _st(sub, "w")
    assert (st.batches, st.gaps, st.resets, st.restarts, st.degraded) == (21, 0, 0, 0, False)
    assert st.events == 41 and st.blocks == 78 and st.connected
    assert st.last_event_ts is not None and st.replays_ok == 0 and st.events_per_s > 0


def _free_adjacent_ports() -> int:
    """A port P such that P and P + 1 are free (DP rank r publishes on P + r)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no adjacent free ports")


# ---------------------------------------------------------------------- gaps and replay


@pytest.mark.parametrize("legacy", [False, True], ids=["v0.33-3frame", "v0.24-2frame"])
async def test_dropped_messages_repaired_by_replay(make, legacy: bool) -> None:
    pub, sub = await _one(make, pub_kw={"legacy_replay": legacy})
    chains = Chains(2)
    for i in range(30):
        pub.publish(chains.request(3, chunks=3), drop=i in {3, 4, 10, 29})
    pub.publish([chains.evict(0)])
    await _until(lambda: _st(sub, "w").last_seq == 30, what="last seq 30")
    assert await sub.wait_idle(DEADLINE)
    st = _st(sub, "w")
    assert st.gaps >= 1 and st.replays_ok >= 1 and st.replays_failed == 0
    assert not st.degraded and st.resets == 0
    assert st.batches == len(pub.sent)  # every batch applied exactly once
    assert pub.replay_requests[0] == 2  # from the last applied batch: its ts proves continuity
    _assert_same(sub.index, _reference((("w", 0), pub)), ("w", 0), chains)


async def test_gap_without_replay_resets_degrades_and_rebuilds(make) -> None:
    resets: list[tuple] = []
    pub, sub = await _one(
        make,
        replay=False,
        rebuild_batches=3,
        rebuild_s=0.0,
        on_reset=lambda e, r: resets.append((e, r)),
    )
    chains = Chains(3)
    for _ in range(4):
        pub.publish(chains.request(2))
    pub.publish(chains.request(2), drop=True)
    pub.publish(chains.request(2))  # seq 5: the gap is seen here and this is the new base
    await _until(lambda: _st(sub, "w").gaps == 1, what="gap")
    assert await sub.wait_idle(DEADLINE)
    st = _st(sub, "w")
    assert st.degraded and st.degraded_reason == "gap: no replay endpoint"
    assert st.resets == 1 and st.last_seq == 5 and st.blocks == 2  # only the new base
    assert resets == [(("w", 0), "gap: no replay endpoint")]
    pub.publish(chains.request(2))
    await _until(lambda: _st(sub, "w").last_seq == 6)
    assert _st(sub, "w").degraded  # 2 clean batches < 3
    pub.publish(chains.request(2))
    await _until(lambda: _st(sub, "w").last_seq == 7)
    assert not _st(sub, "w").degraded and _st(sub, "w").degraded_reason is None
    # An AllBlocksCleared rebuilds at once: the state is exact from there.
    pub.publish(chains.request(2), drop=True)
    pub.publish(chains.request(2))
    await _until(lambda: _st(sub, "w").gaps == 2)
    assert _st(sub, "w").degraded
    pub.publish([all_blocks_cleared(), *chains.request(2)])
    await _until(lambda: _st(sub, "w").last_seq == 10)
    st = _st(sub, "w")
    assert not st.degraded and st.blocks == 2 and st.resets == 2


async def test_replay_that_cannot_reach_back_degrades(make) -> None:
    pub, sub = await _one(make, pub_kw={"buffer_steps": 3})
    chains = Chains(4)
    pub.publish(chains.request(2))
    await _until(lambda: _st(sub, "w").last_seq == 0)
    for _ in range(5):
        pub.publish(chains.request(2), drop=True)
    pub.publish(chains.request(2))  # seq 6; the buffer holds seqs 4..6 only
    await _until(lambda: _st(sub, "w").last_seq == 6, what="seq 6")
    assert await sub.wait_idle(DEADLINE)
    st = _st(sub, "w")
    assert st.replays_failed == 1 and st.replays_ok == 0 and st.resets == 1
    assert st.degraded and st.degraded_reason == "gap: replay cannot reach back"
    # Reset, then what the replay could give (4..6) applied as the new base.
    ref = PrefixIndex()
    ref.add_engine(("w", 0), MODEL)
    for _, payload in pub.sent[4:]:
        ref.apply(("w", 0), decode_payload(payload).events)
    _assert_same(sub.index, ref, ("w", 0), chains)


async def test_replay_timeout_degrades_and_continues(make) -> None:
    """A replay that never answers ends within its timeout (well inside the 10x cap on a
    whole exchange): the source resets instead of waiting for it, and live batches go on."""
    pub, sub = await _one(make, replay_timeout_s=0.3)
    pub.mute_replay = True
    chains = Chains(5)
    pub.publish(chains.request(2))
    pub.publish(chains.request(2), drop=True)
    pub.publish(chains.request(2))
    await _until(lambda: _st(sub, "w").replaying, what=lambda: _dump(sub, pub))
    await _until(lambda: not _st(sub, "w").replaying, timeout=2.5, what=lambda: _dump(sub, pub))
    assert pub.replay_requests == [0]
    assert await sub.wait_idle(DEADLINE)
    st = _st(sub, "w")
    assert st.replays_failed == 1
    assert st.degraded and st.degraded_reason == "gap: replay failed"
    assert st.last_seq == 2 and st.blocks == 2
    pub.publish(chains.request(2))
    await _until(lambda: _st(sub, "w").last_seq == 3)
    assert _st(sub, "w").blocks == 4


async def test_undecodable_live_payload_repaired_by_replay(make) -> None:
    pub, sub = await _one(make)
    chains = Chains(6)
    pub.publish(chains.request(2))
    pub.publish(chains.request(2), live_payload=b"\xc1 not msgpack")  # buffer keeps the real one
    pub.publish(chains.request(2))
    await _until(lambda: _st(sub, "w").last_seq == 2)
    assert await sub.wait_idle(DEADLINE)
    st = _st(sub, "w")
    assert st.decode_errors == 1 and st.replays_ok == 1 and not st.degraded
    assert st.batches == 3
    _assert_same(sub.index, _reference((("w", 0), pub)), ("w", 0), chains)


async def test_undecodable_batch_replay_once_then_reset(make) -> None:
    pub, sub = await _one(make)
    chains = Chains(7)
    pub.publish(chains.request(2))
    pub.publish_payload(b"\xc1 not msgpack")  # the publisher's buffer has the same bytes
    pub.publish(chains.request(2))
    await _until(lambda: _st(sub, "w").last_seq == 2)
    assert await sub.wait_idle(DEADLINE)
    st = _st(sub, "w")
    assert st.decode_errors == 2  # live, then replayed
    assert st.degraded and st.degraded_reason == "undecodable batch" and st.resets == 1
    assert st.blocks == 2  # reset, then seq 2 (from the replay)
    assert st.batches == 2


# ---------------------------------------------------------------------- restarts, joining


async def test_publisher_restart_resets_engine(make) -> None:
    new_pub, _ = make
    resets: list[tuple] = []
    pub, sub = await _one(
        make, replay=False, reconnect_backoff_s=(0.02, 0.1), on_reset=lambda e, r: resets.append(r)
    )
    chains = Chains(8)
    for _ in range(5):
        pub.publish(chains.request(3))
    await _until(lambda: _st(sub, "w").last_seq == 4)
    port = pub.port
    pub.close()
    pub2 = new_pub(endpoint=f"tcp://*:{port}", replay_endpoint=None)
    await _sync(sub, pub2, "w")
    chains2 = Chains(9)
    for _ in range(3):
        pub2.publish(chains2.request(2))
    await _until(lambda: _st(sub, "w").restarts == 1 and _st(sub, "w").last_seq == 2)
    assert await sub.wait_idle(DEADLINE)
    st = _st(sub, "w")
    assert not st.degraded and st.resets == 0 and resets == ["restart"]
    _assert_same(sub.index, _reference((("w", 0), pub2)), ("w", 0), chains2)
    root = sub.index.root(MODEL)
    assert not sub.index.match(chains.prompts[0], root)[("w", 0)].gpu_tokens


async def test_a_worker_back_is_dialled_at_once_not_at_the_backed_off_retry(make) -> None:
    """ZMQ's retries back off while a publisher is down (here to 60 s); once the worker is
    known to be back, ``redial_worker`` connects now, and the restart is found from its seqs."""
    new_pub, _ = make
    pub, sub = await _one(make, replay=False, reconnect_backoff_s=(60.0, 60.0))
    chains = Chains(11)
    for _ in range(3):
        pub.publish(chains.request(3))
    await _until(lambda: _st(sub, "w").last_seq == 2)
    assert sub.redial_worker("w") == 0  # connected: nothing to do
    port = pub.port
    pub.close()
    await _until(lambda: not _st(sub, "w").connected, what="the disconnect")
    pub2 = new_pub(endpoint=f"tcp://*:{port}", replay_endpoint=None)
    assert sub.redial_worker("w") == 1 and sub.redial_worker("nobody") == 0
    await _sync(sub, pub2, "w")  # within DEADLINE, far below the 60 s retry
    pub2.publish(Chains(12).request(2))
    await _until(lambda: _st(sub, "w").restarts == 1 and _st(sub, "w").last_seq == 0)
    root = sub.index.root(MODEL)
    assert not sub.index.match(chains.prompts[0], root)[("w", 0)].gpu_tokens


@pytest.mark.parametrize(
    ("replay", "buffer_steps", "degraded"),
    [(True, 100, False), (True, 2, True), (False, 100, True)],
    ids=["replay-from-0", "replay-short", "no-replay"],
)
async def test_joining_mid_stream(make, replay: bool, buffer_steps: int, degraded: bool) -> None:
    new_pub, new_sub = make
    pub = new_pub(
        replay_endpoint="tcp://127.0.0.1:*" if replay else None, buffer_steps=buffer_steps
    )
    chains = Chains(10)
    for _ in range(5):
        pub.publish(chains.request(2))  # nobody listens yet
    sub = await new_sub()
    sub.add_worker("w", pub.endpoint, pub.replay_endpoint, model=MODEL)
    await _sync(sub, pub, "w")
    for _ in range(3):
        pub.publish(chains.request(2))
    await _until(lambda: _st(sub, "w").last_seq == 7)
    assert await sub.wait_idle(DEADLINE)
    st = _st(sub, "w")
    assert st.degraded is degraded
    if degraded:
        assert st.degraded_reason == "joined mid-stream" and st.resets == 0
    else:
        assert st.replays_ok == 1 and pub.replay_requests == [0]
        assert st.batches == 8
        _assert_same(sub.index, _reference((("w", 0), pub)), ("w", 0), chains)


# ---------------------------------------------------------------------- garbage


async def test_garbage_frames_counted_and_dropped(make) -> None:
    pub, sub = await _one(make)
    chains = Chains(11)
    for _ in range(3):
        pub.publish(chains.request(2))
    await _until(lambda: _st(sub, "w").last_seq == 2)
    assert await sub.wait_idle(DEADLINE)
    before = _st(sub, "w")
    stats = sub.index.engine_stats(("w", 0))
    good = encode_batch(chains.request(2))
    t = pub.topic
    pub.send_raw([t])  # 1 frame
    pub.send_raw([t, (3).to_bytes(8, "big")])  # 2 frames
    pub.send_raw([t, (3).to_bytes(8, "big"), good, b"extra"])  # 4 frames
    pub.send_raw([t, b"\x00" * 7, good])  # 7-byte seq
    pub.send_raw([t, b"\x00" * 9, good])  # 9-byte seq
    pub.send_raw([t, (1).to_bytes(8, "big"), b"\xc1\xff junk"])  # not msgpack
    pub.send_raw([t, (2).to_bytes(8, "big"), encode_batch([{"type": 5}])])  # not a batch
    pub.send_raw([t, (2).to_bytes(8, "big"), b"\x93\xa1x\x90\x00"])  # ts is a string
    await _until(lambda: _st(sub, "w").garbage_frames == before.garbage_frames + 5)
    await _until(lambda: _st(sub, "w").decode_errors == before.decode_errors + 3)
    assert await sub.wait_idle(DEADLINE)
    after = _st(sub, "w")
    assert after.last_seq == 2 and after.resets == 0 and not after.degraded
    assert sub.index.engine_stats(("w", 0)) == stats
    pub.publish(chains.request(2))
    await _until(lambda: _st(sub, "w").last_seq == 3)
    _assert_same(sub.index, _reference((("w", 0), pub)), ("w", 0), chains)


# ---------------------------------------------------------------------- topologies


async def test_dp_rank_1_on_port_plus_1(make) -> None:
    new_pub, new_sub = make
    port = _free_adjacent_ports()
    p0 = new_pub(endpoint=f"tcp://*:{port}", replay_endpoint=None, dp_rank=0)
    p1 = new_pub(endpoint=f"tcp://*:{port + 1}", replay_endpoint=None, dp_rank=1)
    sub = await new_sub()
    sub.add_worker("w", f"tcp://*:{port}", dp_size=2, model=MODEL, host="127.0.0.1")
    assert _st(sub, "w", 1).endpoint == f"tcp://127.0.0.1:{port + 1}"
    await _sync(sub, p0, "w", 0)
    await _sync(sub, p1, "w", 1)
    c0, c1 = Chains(12), Chains(13)
    for _ in range(4):
        p0.publish(c0.request(2))
        p1.publish(c1.request(3))
    await _until(lambda: _st(sub, "w", 0).last_seq == 3 and _st(sub, "w", 1).last_seq == 3)
    ref = _reference((("w", 0), p0), (("w", 1), p1))
    _assert_same(sub.index, ref, ("w", 0), c0)
    _assert_same(sub.index, ref, ("w", 1), c1)
    assert _st(sub, "w", 1).blocks == 12


async def test_bind_topology_dispatches_by_topic_and_rank(make) -> None:
    new_pub, new_sub = make
    sub = await new_sub(bind="tcp://127.0.0.1:*", topic="kv")
    sub.add_bound_worker("a", "kv-a", model=MODEL)
    sub.add_bound_worker("b", "kv-b", dp_size=2, model=MODEL)
    ep = sub.bound_endpoint
    assert ep is not None and ep.startswith("tcp://127.0.0.1:")
    pa = new_pub(endpoint=ep, replay_endpoint=None, topic="kv-a")
    pb0 = new_pub(endpoint=ep, replay_endpoint=None, topic="kv-b", dp_rank=0)
    pb1 = new_pub(endpoint=ep, replay_endpoint=None, topic="kv-b", dp_rank=1)
    stranger = new_pub(endpoint=ep, replay_endpoint=None, topic="kv-zzz")
    for p, w in ((pa, "a"), (pb0, "b"), (pb1, "b")):
        await _sync(sub, p, w)  # probes of rank 1 are garbage too, counted on rank 0
    ca, cb0, cb1 = Chains(14), Chains(15), Chains(16)
    for _ in range(3):
        pa.publish(ca.request(2))
        pb0.publish(cb0.request(3))
        pb1.publish(cb1.request(4))
    await _until(
        lambda: [_st(sub, *e).last_seq for e in (("a", 0), ("b", 0), ("b", 1))] == [2, 2, 2]
    )
    await _until(lambda: all(_st(sub, *e).connected for e in (("a", 0), ("b", 0), ("b", 1))))
    ref = _reference((("a", 0), pa), (("b", 0), pb0), (("b", 1), pb1))
    for engine, chains in ((("a", 0), ca), (("b", 0), cb0), (("b", 1), cb1)):
        _assert_same(sub.index, ref, engine, chains)
    # An unregistered topic under the prefix is counted, not applied (published until seen).
    await _until(lambda: stranger.publish([]) >= 0 and sub.unrouted_frames > 0, what="unrouted")
    assert all(s.gaps == 0 and not s.degraded for s in sub.status())


async def test_twenty_workers_at_once(make) -> None:
    new_pub, new_sub = make
    sub = await new_sub()
    pubs = [new_pub() for _ in range(20)]
    for i, p in enumerate(pubs):
        sub.add_worker(f"w{i}", p.endpoint, p.replay_endpoint, model=MODEL)
    for i, p in enumerate(pubs):
        await _sync(sub, p, f"w{i}")
    chains = [Chains(100 + i) for i in range(20)]
    for _ in range(10):
        for p, c in zip(pubs, chains, strict=True):
            p.publish(c.request(4, chunks=2))
    await _until(lambda: all(s.last_seq == 9 for s in sub.status()), what="all workers")
    ref = _reference(*((((f"w{i}", 0)), p) for i, p in enumerate(pubs)))
    for i, c in enumerate(chains):
        _assert_same(sub.index, ref, (f"w{i}", 0), c)
    assert all(s.gaps == 0 and s.batches == 10 for s in sub.status())


# ---------------------------------------------------------------------- concurrency, bounds


async def test_repaired_losses_never_add_up_to_a_reset(make) -> None:
    """A stream that loses every other batch while it trickles: each loss is repaired by one
    replay, and the batch that showed the gap arrives already applied by that replay. Once the
    queue has run dry with nothing missing the source has caught up, so however many such
    losses follow, none counts towards the replay-streak bound (no reset, exact index)."""
    pub, sub = await _one(make)
    chains = Chains(16)
    pub.publish(chains.request(2))
    await _until(lambda: _st(sub, "w").last_seq == 0)
    for round_ in range(1, 6):
        pub.publish(chains.request(2), drop=True)
        seq = pub.publish(chains.request(2))  # a gap; its replay also applies this batch
        await _until(lambda r=round_: _st(sub, "w").replays_ok == r, what=lambda: _dump(sub, pub))
        assert await sub.wait_idle(DEADLINE)
        st = _st(sub, "w")
        assert st.last_seq == seq and st.duplicates == round_, _dump(sub, pub)
    st = _st(sub, "w")
    assert st.resets == 0 and not st.degraded and st.gaps == 5 and st.batches == pub.seq
    _assert_same(sub.index, _reference((("w", 0), pub)), ("w", 0), chains)


async def test_live_messages_during_slow_replay_neither_lost_nor_doubled(make) -> None:
    pub, sub = await _one(make, pub_kw={"replay_delay_s": 0.01})
    chains = Chains(17)
    pub.publish(chains.request(2))
    pub.publish(chains.request(2), drop=True)
    saw_buffering = False
    for _ in range(60):
        pub.publish(chains.request(2, chunks=2))
        await asyncio.sleep(0.002)
        st = _st(sub, "w")
        saw_buffering |= st.replaying and st.queue_depth > 0
    await _until(lambda: _st(sub, "w").last_seq == 61, what="seq 61")
    assert await sub.wait_idle(DEADLINE)
    st = _st(sub, "w")
    assert saw_buffering and st.duplicates > 0
    assert st.batches == len(pub.sent) == 62 and not st.degraded and st.replays_ok >= 1
    _assert_same(sub.index, _reference((("w", 0), pub)), ("w", 0), chains)


async def test_queue_bytes_bound_is_a_counted_gap(make) -> None:
    """A few huge batches are bounded like many small ones: past ``queue_bytes`` a message is
    a counted overflow and its seq an ordinary gap, repaired by replay."""
    pub, sub = await _one(make, queue_bytes=6_000)
    await _overflow_then_repaired(pub, sub, Chains(19), 16)  # ~1 KB payloads: five fill the bound
    assert all(s.queued_bytes == 0 for s in sub._sources.values())


async def test_batch_over_queue_bytes_with_nothing_after_it_is_repaired(make) -> None:
    """A batch larger than ``queue_bytes`` is dropped from an empty queue; the publisher then
    falls silent, so no later seq would show the gap: the drop itself is repaired by replay."""
    pub, sub = await _one(make, queue_bytes=6_000)
    chains = Chains(20)
    pub.publish(chains.request(2))
    await _until(lambda: _st(sub, "w").last_seq == 0)
    pub.publish(chains.request(150))  # ~10 KB
    await _until(lambda: _st(sub, "w").last_seq == 1, what=lambda: _dump(sub, pub))
    assert await sub.wait_idle(DEADLINE)
    st = _st(sub, "w")
    assert st.queue_overflows == 1 and st.gaps == 1 and st.replays_ok == 1 and not st.degraded
    _assert_same(sub.index, _reference((("w", 0), pub)), ("w", 0), chains)


async def test_queue_overflow_is_a_counted_gap(make) -> None:
    pub, sub = await _one(make, queue_depth=4)
    await _overflow_then_repaired(pub, sub, Chains(18), 1)


async def _overflow_then_repaired(pub: Any, sub: Subscriber, chains: Chains, blocks: int) -> None:
    """Bursts published without yielding outrun the applier until the queue overflows; then
    every batch is applied once (the overflow counted as a gap, repaired by replay) and the
    index equals the loss-free one."""
    for _ in range(20):
        for _ in range(50):
            pub.publish(chains.request(blocks))
        await asyncio.sleep(0.02)
        if _st(sub, "w").queue_overflows:
            break
    n = pub.seq
    await _until(lambda: _st(sub, "w").last_seq == n - 1, what=lambda: _dump(sub, pub))
    assert await sub.wait_idle(DEADLINE)
    st = _st(sub, "w")
    assert st.queue_overflows > 0 and st.gaps > 0 and st.replays_ok > 0
    assert st.batches == n and not st.degraded
    _assert_same(sub.index, _reference((("w", 0), pub)), ("w", 0), chains)


async def test_index_cap_marks_engine_degraded(make) -> None:
    resets: list[str] = []
    pub, sub = await _one(
        make, index=PrefixIndex(max_entries=20), on_reset=lambda e, r: resets.append(r)
    )
    chains = Chains(19)
    for _ in range(6):
        pub.publish(chains.request(4))
    await _until(lambda: _st(sub, "w").last_seq == 5)
    st = _st(sub, "w")
    assert st.degraded and st.degraded_reason == "index cap" and "index cap" in resets
    assert sub.index.overflowed == []


async def test_remove_worker_drops_state_and_socket(make) -> None:
    new_pub, new_sub = make
    sub = await new_sub()
    p1, p2 = new_pub(), new_pub()
    sub.add_worker("w1", p1.endpoint, p1.replay_endpoint, model=MODEL)
    sub.add_worker("w2", p2.endpoint, p2.replay_endpoint, model=MODEL)
    await _sync(sub, p1, "w1")
    await _sync(sub, p2, "w2")
    c1, c2 = Chains(20), Chains(21)
    p1.publish(c1.request(2))
    p2.publish(c2.request(2))
    await _until(lambda: all(s.last_seq == 0 for s in sub.status()))
    sub.remove_worker("w1")
    assert not sub.index.has_engine(("w1", 0)) and sub.index.has_engine(("w2", 0))
    assert [s.worker_id for s in sub.status()] == ["w2"]
    p1.publish(c1.request(2))
    p2.publish(c2.request(2))
    await _until(lambda: _st(sub, "w2").last_seq == 1)
    assert await sub.wait_idle(DEADLINE)
    assert not sub.index.has_engine(("w1", 0))
    sub.remove_worker("w1")  # idempotent
    sub.add_worker("w1", p1.endpoint, p1.replay_endpoint, model=MODEL)  # can come back


async def test_start_stop_idempotent_and_add_before_start() -> None:
    pub = VllmPublisher(replay_endpoint=None)
    sub = Subscriber(PrefixIndex())
    try:
        sub.add_worker("w", pub.endpoint, model=MODEL)  # before start: connects on start
        await sub.start()
        await sub.start()
        await _sync(sub, pub, "w")
        pub.publish(Chains(22).request(2))
        await _until(lambda: _st(sub, "w").last_seq == 0)
    finally:
        await sub.stop()
        await sub.stop()
        pub.close()
    assert not _st(sub, "w").connected


async def test_silence_and_restart_that_overtakes_our_seq(make) -> None:
    """A dead publisher changes nothing in the index; its replacement, whose new seqs already
    passed ours when we reconnect, is recognised as a restart (replayed batch ts differs)."""
    new_pub, _ = make
    resets: list[str] = []
    pub, sub = await _one(
        make, reconnect_backoff_s=(1.0, 1.0), on_reset=lambda e, r: resets.append(r)
    )
    chains = Chains(30)
    for _ in range(3):
        pub.publish(chains.request(2))
    await _until(lambda: _st(sub, "w").last_seq == 2)
    blocks = _st(sub, "w").blocks
    port, rport = pub.port, int(pub.replay_endpoint.rsplit(":", 1)[1])
    pub.close()
    await _until(lambda: not _st(sub, "w").connected, what="disconnect seen")
    st = _st(sub, "w")
    assert st.blocks == blocks and not st.degraded and st.resets == 0  # silence is not empty
    pub2 = new_pub(endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{rport}")
    chains2 = Chains(31)
    for _ in range(10):  # published before the subscriber reconnects (1 s backoff): unseen
        pub2.publish(chains2.request(2))
    await _sync(sub, pub2, "w")
    pub2.publish(chains2.request(2))  # seq 10 > our 2 + 1: looks like a gap
    await _until(lambda: _st(sub, "w").last_seq == 10 and _st(sub, "w").restarts == 1)
    assert await sub.wait_idle(DEADLINE)
    st = _st(sub, "w")
    assert not st.degraded and st.resets == 0 and resets == ["restart"]
    assert pub2.replay_requests == [2, 0]
    _assert_same(sub.index, _reference((("w", 0), pub2)), ("w", 0), chains2)


async def test_replay_concurrency_is_bounded(make) -> None:
    new_pub, new_sub = make
    sub = await new_sub(replay_concurrency=1)
    pubs = [new_pub(replay_delay_s=0.01) for _ in range(3)]
    for i, p in enumerate(pubs):
        sub.add_worker(f"w{i}", p.endpoint, p.replay_endpoint, model=MODEL)
        await _sync(sub, p, f"w{i}")
    chains = [Chains(40 + i) for i in range(3)]
    for p, c in zip(pubs, chains, strict=True):
        p.publish(c.request(1))
        for _ in range(10):
            p.publish(c.request(1), drop=True)
        p.publish(c.request(1))
    await _until(lambda: all(s.last_seq == 11 for s in sub.status()), what="all repaired")
    spans = sorted(span for p in pubs for span in p.replay_spans)
    assert len(spans) == 3
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start >= end - 0.005, "two replays were served at the same time"
    for i, (p, c) in enumerate(zip(pubs, chains, strict=True)):
        _assert_same(sub.index, _reference(((f"w{i}", 0), p)), (f"w{i}", 0), c)


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_random_losses_always_repaired(make, seed: int) -> None:
    """Random drops, corrupted live copies, evictions and bursts: with replay, the index always
    ends equal to the loss-free one and every batch is applied exactly once."""
    import random

    rng = random.Random(seed)
    depth = rng.choice([8, 64, 10_000])
    pub, sub = await _one(make, queue_depth=depth)
    chains = Chains(seed)
    for i in range(150):
        # The publisher runs at most three queues ahead of what is applied: a queue of 8 still
        # overflows and is repaired, but a starved CPU cannot turn the run into an endless
        # burst that only tests the replay-streak bound (three replays in a row that never
        # catch up, then a reset).
        if pub.seq - (_st(sub, "w").last_seq or 0) > 3 * min(depth, 64):
            await _until(
                lambda: pub.seq - (_st(sub, "w").last_seq or 0) <= depth,
                what=lambda: _dump(sub, pub),
            )
        if i > 5 and rng.random() < 0.3:
            events = [chains.evict(rng.randrange(i // 2), 1)]
        else:
            events = chains.request(rng.randint(1, 4), chunks=rng.randint(1, 2))
        r = rng.random()
        if r < 0.1:
            pub.publish(events, drop=True)
        elif r < 0.13:
            pub.publish(events, live_payload=b"\xc1")
        else:
            pub.publish(events)
        if rng.random() < 0.1:
            await asyncio.sleep(0.005)
        elif rng.random() < 0.6:
            await asyncio.sleep(0)
    pub.publish(chains.request(1))
    n = pub.seq
    await _until(lambda: _st(sub, "w").last_seq == n - 1, what=lambda: _dump(sub, pub))
    assert await sub.wait_idle(DEADLINE)
    st = _st(sub, "w")
    assert not st.degraded and st.resets == 0 and st.restarts == 0
    assert st.batches == n
    _assert_same(sub.index, _reference((("w", 0), pub)), ("w", 0), chains)


async def test_bind_topology_with_replay_and_removal(make) -> None:
    new_pub, new_sub = make
    sub = await new_sub(bind="tcp://127.0.0.1:*")
    sub.add_bound_worker("a", "kv-a", model=MODEL, replay_endpoint=None)
    ep = sub.bound_endpoint
    assert ep is not None
    pa = new_pub(endpoint=ep, topic="kv-a")
    sub.remove_worker("a")
    sub.add_bound_worker("a", "kv-a", model=MODEL, replay_endpoint=pa.replay_endpoint)
    await _sync(sub, pa, "a")
    chains = Chains(50)
    for i in range(10):
        pa.publish(chains.request(2), drop=i in {2, 3})
    await _until(lambda: _st(sub, "a").last_seq == 9)
    assert await sub.wait_idle(DEADLINE)
    st = _st(sub, "a")
    assert st.replays_ok == 1 and st.batches == 10 and not st.degraded
    assert st.endpoint == f"{ep}#kv-a" and st.connected
    _assert_same(sub.index, _reference((("a", 0), pa)), ("a", 0), chains)
    sub.remove_worker("a")
    assert sub.status() == [] and not sub.index.has_engine(("a", 0))
    pa.publish(chains.request(2))
    await _until(lambda: sub.unrouted_frames > 0, what="unrouted after removal")
