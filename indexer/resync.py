"""The replay task of one event source: fetch, hand the answer to the source's state, apply
what the state says.

While a source's replay runs, its live messages stay queued (the subscriber's applier skips the
source), and at most ``concurrency`` replays fetch at once. An answer is fed only while the
state still waits for that very request (:meth:`~indexer.source_state.SourceState.awaits`): a
replay abandoned by a reset is cancelled, and even a late answer of it applies nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import zmq.asyncio

from indexer.replay import ReplayError, fetch_replay
from indexer.source import Source
from indexer.source_state import Action, RequestReplay
from indexer.wire import DecodedBatch, DecodeError, decode_payload

__all__ = ["Resync"]

log = logging.getLogger("indexer.subscriber")  # part of the subscriber

FEED_BATCH = 64
"""Replayed batches applied before the task yields to the loop."""


class Resync:
    """Runs the replays of a subscriber's sources. ``run(src, actions)`` carries out a state's
    actions and returns the replay they ask for, if any; ``resume(src)`` lets the source's
    queued live messages move again."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        timeout_s: float,
        concurrency: int,
        run: Callable[[Source, list[Action]], RequestReplay | None],
        resume: Callable[[Source], None],
    ) -> None:
        self.ctx = ctx
        self.timeout_s = timeout_s
        self.run = run
        self.resume = resume
        self._sem = asyncio.Semaphore(concurrency)

    def start(self, src: Source, request: RequestReplay) -> None:
        src.replay_task = asyncio.get_running_loop().create_task(
            self._replay(src, request), name=f"kv-replay {src.engine}"
        )

    def cancel(self, src: Source) -> None:
        """Stop the source's replay in flight (its answer is stale) and resume the source."""
        task = src.replay_task
        if task is None or task is asyncio.current_task():
            return
        task.cancel()
        src.replay_task = None
        self.resume(src)

    async def _replay(self, src: Source, request: RequestReplay) -> None:
        try:
            follow_up = await self._replay_once(src, request)
            if follow_up is not None and not src.removed:
                await self._replay_once(src, follow_up)  # a new publisher: from 0
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("replay for %s", src.engine)
            waited = src.state.replay
            if not src.removed and waited is not None:
                self.run(src, src.state.replay_crashed(waited.reason, time.monotonic()))
        finally:
            if src.replay_task is asyncio.current_task():
                src.replay_task = None
                self.resume(src)

    async def _replay_once(self, src: Source, request: RequestReplay) -> RequestReplay | None:
        """Fetch one replay and feed it to the source's state; return the replay the state
        asks for instead (its publisher restarted), if any."""
        assert src.replay_endpoint is not None
        state = src.state
        async with self._sem:
            try:
                result = await fetch_replay(
                    self.ctx, src.replay_endpoint, request.start, self.timeout_s
                )
            except ReplayError as exc:
                log.warning("replay for %s: %s", src.engine, exc)
                if not src.removed:
                    self.run(src, state.replay_failed(request, time.monotonic()))
                return None
        if src.removed or not state.awaits(request):
            return None
        batches = result.batches
        first_ts = _batch_ts(batches[0][1]) if request.verify_ts is not None and batches else None
        answer = state.replay_answered(
            request, result.reaches, first_ts, time.monotonic(), empty=not batches
        )
        follow_up = self.run(src, answer)
        if follow_up is None:
            await self._feed(src, request, batches)
            state.replay_done(request)
        return follow_up

    async def _feed(
        self, src: Source, request: RequestReplay, batches: list[tuple[int, bytes]]
    ) -> None:
        state = src.state
        n = 0
        for seq, payload in batches:
            if src.removed or not state.awaits(request):
                return
            if state.already_applied(seq):
                continue  # already applied from the live stream
            try:
                batch: DecodedBatch | None = decode_payload(payload)
            except DecodeError:
                src.decode_errors += 1
                batch = None
            self.run(src, state.replayed(seq, batch, time.monotonic()))
            if batch is not None:
                n += 1
                if n % FEED_BATCH == 0:
                    await asyncio.sleep(0)


def _batch_ts(payload: bytes) -> float | None:
    try:
        return decode_payload(payload).ts
    except DecodeError:
        return None
