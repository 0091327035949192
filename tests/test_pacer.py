"""Paced reads (indexer/pacer.py) over real ZMQ sockets: a burst on several sockets switches the
readers to one timer, every message still arrives once and in order, and once the sockets fall
silent the readers go back to reading on their FD, so a lone message is read at once again."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq
import zmq.asyncio

from indexer.feed import Feed, FeedOptions
from indexer.pacer import Pacer
from indexer.subscriber import RECV_BATCH, RECV_BUDGET_S
from tests.test_subscriber import DEADLINE, _until
from tests.vllm_publisher import VllmPublisher

INTERVAL_S = 0.02


async def test_a_burst_is_read_on_the_timer_and_silence_goes_back_to_fd_reads() -> None:
    ctx = zmq.asyncio.Context()
    pubs = [VllmPublisher(replay_endpoint=None) for _ in range(3)]
    pacer = Pacer(INTERVAL_S)
    got: list[list[int]] = [[] for _ in pubs]
    options = FeedOptions("", 100_000, (0.05, 0.1), 0.0, RECV_BATCH, RECV_BUDGET_S)

    def on_message(i: int, frames: list[bytes]) -> None:
        got[i].append(int.from_bytes(frames[1], "big"))

    feeds = [
        Feed(
            ctx,
            pub.endpoint,
            options,
            bind=False,
            on_message=lambda frames, i=i: on_message(i, frames),
            on_read=lambda: None,
            pacer=pacer,
        )
        for i, pub in enumerate(pubs)
    ]
    try:
        deadline = time.monotonic() + DEADLINE
        while not all(got):  # slow joiner: probe until every subscription is live
            assert time.monotonic() < deadline, "subscriptions never became live"
            for pub in pubs:
                pub.send_raw([b"", (0).to_bytes(8, "big"), b"probe"])
            await asyncio.sleep(0.01)
        await _until(lambda: not pacer.paced, what="probes over")
        for g in got:
            g.clear()

        # A burst: one message per socket at a time, each followed by a loop turn, so the readers
        # wake per message until the pacer sees the rate and takes over.
        n = 300
        for seq in range(1, n + 1):
            for pub in pubs:
                pub.send_raw([b"", seq.to_bytes(8, "big"), b"x" * 64])
            await asyncio.sleep(0)
            if seq == 100:
                await _until(lambda: pacer.paced, what="paced reads")
        await _until(lambda: all(len(g) == n for g in got), what="the burst read")
        assert all(g == list(range(1, n + 1)) for g in got)  # once each, in order
        assert pacer.entered >= 1 and pacer.ticks >= 1

        # Silence: after idle ticks the readers are on their FDs again.
        await _until(lambda: not pacer.paced, what="back to FD reads")
        ticks = pacer.ticks
        t0 = time.monotonic()
        pubs[1].send_raw([b"", (n + 1).to_bytes(8, "big"), b"late"])
        await _until(lambda: got[1][-1] == n + 1, what="a lone message")
        assert pacer.ticks == ticks  # read on its FD, no timer involved
        assert time.monotonic() - t0 < DEADLINE
    finally:
        pacer.close()
        for feed in feeds:
            feed.close()
        for pub in pubs:
            pub.close()
        ctx.destroy(linger=0)


def test_pacer_rejects_settings_it_cannot_honour() -> None:
    with pytest.raises(ValueError, match="enter_after >= 2"):
        Pacer(0.002, enter_after=1)
    with pytest.raises(ValueError, match="interval_s >= 0"):
        Pacer(-1.0)


async def test_interval_zero_never_paces_and_the_tick_grows_with_the_sockets() -> None:
    off = Pacer(0.0)
    for _ in range(10):
        off.woke()
    assert not off.paced and off.entered == 0

    class Reader:
        def pause(self) -> None: ...
        def resume(self) -> None: ...
        def poll(self) -> int:
            return 0

    pacer = Pacer(0.002, per_socket_s=0.0001)
    for _ in range(100):
        pacer.add(Reader())
    assert pacer.tick_s == pytest.approx(0.01)  # 100 sockets at 0.1 ms each beat 2 ms
