"""Fetch missed batches from a vLLM publisher's replay (ROUTER) endpoint.

Protocol (docs/vllm-reference.md §2.4): a ``DEALER`` sends ``[b"", start_seq (8 bytes BE)]``;
the publisher answers one message per buffered batch with ``seq >= start``: ``[b"", topic, seq8,
payload]`` (vLLM >= 0.33) or ``[b"", seq8, payload]`` (<= 0.24), then an end marker whose *last
frame is empty*. ``REQ`` must not be used: it accepts one reply per request, so it would see one
batch.

The publisher keeps only its last ``buffer_steps`` batches and never says "too old": the caller
compares the first replayed seq with the one it asked for (:attr:`ReplayResult.reaches`).
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import zmq
import zmq.asyncio

__all__ = ["ReplayError", "ReplayResult", "fetch_replay"]


class ReplayError(Exception):
    """The replay did not complete (timeout, unreachable endpoint, malformed reply)."""


class ReplayResult(msgspec.Struct):
    start: int
    batches: list[tuple[int, bytes]]
    """(seq, payload) in the order received, i.e. ascending seq."""
    malformed: int = 0
    """Reply messages that were neither a batch nor the end marker (dropped)."""

    @property
    def reaches(self) -> bool:
        """True when the replay starts exactly at the requested seq (nothing older missing)."""
        return bool(self.batches) and self.batches[0][0] == self.start


async def fetch_replay(
    ctx: zmq.asyncio.Context,
    endpoint: str,
    start: int,
    timeout_s: float,
    *,
    max_batches: int = 1_000_000,
) -> ReplayResult:
    """Ask ``endpoint`` for every buffered batch from ``start`` on.

    ``timeout_s`` bounds the wait for the first reply and every gap between two replies (a large
    replay that keeps flowing is not cut off); the whole exchange is also capped at
    ``10 * timeout_s``. Raises :class:`ReplayError`.
    """
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)  # the publisher sends its whole buffer at once
    deadline = time.monotonic() + 10 * timeout_s
    result = ReplayResult(start, [])
    try:
        sock.connect(endpoint)
        await sock.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            wait = min(timeout_s, deadline - time.monotonic())
            if wait <= 0:
                raise ReplayError(f"replay from {endpoint} exceeded {10 * timeout_s:.1f}s")
            try:
                frames = await asyncio.wait_for(sock.recv_multipart(), wait)
            except TimeoutError:
                raise ReplayError(f"replay from {endpoint} timed out after {wait:.1f}s") from None
            if frames and frames[0] == b"":
                frames = frames[1:]  # the DEALER keeps the empty delimiter
            if not frames or frames[-1] == b"":
                return result  # end marker: [b"", ff*8, b""] or [ff*8, b""]
            if len(frames) == 3:
                seq_frame, payload = frames[1], frames[2]
            elif len(frames) == 2:
                seq_frame, payload = frames[0], frames[1]
            else:
                result.malformed += 1
                continue
            if len(seq_frame) != 8:
                result.malformed += 1
                continue
            result.batches.append((int.from_bytes(seq_frame, "big"), payload))
            if len(result.batches) > max_batches:
                raise ReplayError(f"replay from {endpoint} exceeded {max_batches} batches")
    except zmq.ZMQError as exc:
        raise ReplayError(f"replay from {endpoint} failed: {exc}") from None
    finally:
        sock.close(linger=0)
