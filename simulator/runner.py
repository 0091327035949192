"""Wall-clock driver of one ``SimEngine`` (one DP rank) inside an asyncio loop.

Steps exactly like ``FastFleet`` (schedule -> sleep for the modelled duration -> finish),
publishes each step's batch through the ZMQ publisher and hands new tokens to waiting
HTTP handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass

from simulator.engine import SimEngine
from simulator.events import encode_batch
from simulator.publisher import ZmqPublisher

log = logging.getLogger("kvrouter.sim")


@dataclass
class TokenOut:
    token: int | None  # None: request ended without a new token (aborted / engine restart)
    finished: bool
    cached_tokens: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0


class EngineRunner:
    def __init__(
        self, engine: SimEngine, dp_rank: int, publisher: ZmqPublisher | None, encoding: str = "map"
    ) -> None:
        self.engine = engine
        self.dp_rank = dp_rank
        self.publisher = publisher
        self.encoding = encoding
        self.events_enabled = True
        self._t0 = time.monotonic()
        self._wake = asyncio.Event()
        self._streams: dict[str, asyncio.Queue[TokenOut]] = {}
        self._task: asyncio.Task[None] | None = None
        self.steps = 0
        self.published = 0  # batches handed to the current publisher (== its next seq)
        self._to_abort: set[str] = set()

    def now(self) -> float:
        return time.monotonic() - self._t0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self.publisher is not None:
            await asyncio.to_thread(self.publisher.close)

    # ---- requests -------------------------------------------------------------------------
    def submit(
        self,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        lora_name: str | None,
        cache_salt: str | None,
        session_id: str | None = None,
        report_full: bool = False,
        priority: int = 0,
    ) -> asyncio.Queue[TokenOut]:
        q: asyncio.Queue[TokenOut] = asyncio.Queue()
        self.engine.add_request(
            request_id,
            prompt,
            max_tokens,
            self.now(),
            lora_name,
            cache_salt,
            session_id,
            report_full,
            priority,
        )
        self._streams[request_id] = q
        self._wake.set()
        return q

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if not self.engine.in_flight():
            self.engine.abort(request_id)
        else:
            self._to_abort.add(request_id)

    def restart_engine(self) -> None:
        """Drop every request and the whole cache (a vLLM restart); streams end."""
        for q in self._streams.values():
            q.put_nowait(TokenOut(None, True))
        self._streams.clear()
        self.engine.restart()
        self._wake.set()

    def sleep(self, level: int) -> bool:
        """vLLM's ``POST /sleep`` (mode "abort"): requests in flight end, new ones wait until
        :meth:`wake_up`; at level 1 or 2 the prefix cache goes, announced with the next step as
        a reset is. False when a step is running and the cache could not be dropped."""
        for rid, q in list(self._streams.items()):
            q.put_nowait(TokenOut(None, True))
            self.abort(rid)
        self.engine.sleep_level = level
        return level < 1 or self.engine.reset_prefix_cache()

    def wake_up(self) -> None:
        self.engine.sleep_level = None
        self._wake.set()

    def kick(self) -> None:
        self._wake.set()

    # ---- loop --------------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            try:
                await self._run()
            except asyncio.CancelledError:
                raise
            except Exception:  # a simulator bug must not hang every client forever
                log.exception("engine step failed; restarting the simulated engine")
                self.restart_engine()

    async def _run(self) -> None:
        while True:
            eng = self.engine
            now = self.now()
            t = eng.next_step_time(now)
            if t == math.inf:
                self._wake.clear()
                await self._wake.wait()
                continue
            if t > now:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), t - now)
                continue
            end = eng.schedule(now)
            await asyncio.sleep(max(0.0, end - self.now()))
            if not eng.in_flight():  # the engine was restarted during the step
                continue
            out = eng.finish_step()
            self.steps += 1
            if out.events and self.events_enabled and eng.events_enabled and self.publisher:
                self.publisher.publish(
                    encode_batch(
                        time.time() + eng.config.event_clock_skew_s,
                        out.events,
                        self.dp_rank,
                        self.encoding,
                    )
                )
                self.published += 1
            for rid, tok in out.new_tokens.items():
                q = self._streams.get(rid)
                if q is None:
                    continue
                req = eng.requests.get(rid)
                fin = req is None
                src = next((r for r in out.finished if r.request_id == rid), req)
                assert src is not None
                q.put_nowait(
                    TokenOut(
                        tok,
                        fin,
                        sum(src.usage_hit()),
                        src.num_prompt,
                        src.num_output,
                    )
                )
                if fin:
                    self._streams.pop(rid, None)
            for rid in list(self._to_abort):
                eng.abort(rid)
            self._to_abort.clear()
            await asyncio.sleep(0)  # let handlers run between steps
