"""Fast in-process fleet: N ``SimEngine`` workers on a simulated clock, no sockets.

Used by ``bench/routing_bench.py`` for trace replays. Each engine runs exactly the code of
the HTTP worker; only the clock differs. Events come out as the exact msgpack payloads a
real vLLM publishes, so the router's own decoder and index consume them unchanged.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from simulator.engine import EngineConfig, SimEngine
from simulator.events import encode_batch


@dataclass(frozen=True, slots=True)
class CompletedRequest:
    request_id: str
    worker_idx: int
    arrival_s: float
    first_token_s: float
    finish_s: float
    prompt_tokens: int
    cached_tokens: int  # GPU prefix-cache hit
    cpu_loaded_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    running: int
    waiting: int
    queued_prefill_tokens: int
    kv_usage: float


class FastFleet:
    def __init__(self, n_workers: int, config: EngineConfig, encoding: str = "map") -> None:
        if n_workers < 1:
            raise ValueError("n_workers must be >= 1")
        self.config = config
        self.encoding = encoding
        self.engines = [SimEngine(config) for _ in range(n_workers)]
        self.now = 0.0
        self._seq = [0] * n_workers
        self._events: list[tuple[int, int, int, bytes]] = []
        self._completed: list[CompletedRequest] = []
        # (time, worker) of each engine's next step start or step end
        self._pending_arrivals: list[tuple[float, int, int, tuple]] = []
        self._arrival_counter = 0

    # ---- driving -------------------------------------------------------------------------
    def submit(
        self,
        worker_idx: int,
        request_id: str,
        token_ids: list[int],
        max_tokens: int,
        arrival_s: float,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Queue a request; it reaches the engine at ``arrival_s`` (>= the current clock)."""
        if arrival_s <= self.now:
            self.engines[worker_idx].add_request(
                request_id, token_ids, max_tokens, self.now, lora_name, cache_salt)
            self.engines[worker_idx].requests[request_id].arrival_s = arrival_s
            return
        self._arrival_counter += 1
        heapq.heappush(self._pending_arrivals, (
            arrival_s, self._arrival_counter, worker_idx,
            (request_id, token_ids, max_tokens, cache_salt, lora_name)))

    def next_event_time(self) -> float:
        t = self._pending_arrivals[0][0] if self._pending_arrivals else math.inf
        for e in self.engines:
            t = min(t, e.next_step_time(self.now))
        return t

    def run_until(self, t_s: float) -> None:
        """Advance the simulated clock to ``t_s``, running every step that ends by then."""
        while True:
            t = self.next_event_time()
            if t > t_s:
                break
            self.now = max(self.now, t)
            while self._pending_arrivals and self._pending_arrivals[0][0] <= self.now:
                arr, _, w, (rid, toks, mt, salt, lora) = heapq.heappop(self._pending_arrivals)
                self.engines[w].add_request(rid, toks, mt, arr, lora, salt)
            for w, e in enumerate(self.engines):
                if e.in_flight() and e.next_step_time(self.now) <= self.now:
                    self._finish(w, e)
                if not e.in_flight() and e.next_step_time(self.now) <= self.now:
                    e.schedule(self.now)
        self.now = max(self.now, t_s)

    def _finish(self, w: int, e: SimEngine) -> None:
        out = e.finish_step()
        if out.events and e.events_enabled:
            payload = encode_batch(out.end_s, out.events, 0, self.encoding)
            self._events.append((w, 0, self._seq[w], payload))
            self._seq[w] += 1
        for r in out.finished:
            self._completed.append(CompletedRequest(
                r.request_id, w, r.arrival_s, r.first_token_s or out.end_s,
                r.finish_s or out.end_s, r.num_prompt, r.cached_tokens,
                r.cpu_loaded_tokens, r.num_output))

    # ---- outputs ---------------------------------------------------------------------------
    def drain_events(self) -> list[tuple[int, int, int, bytes]]:
        """``(worker_idx, dp_rank, seq, payload)`` in publish order since the last call."""
        ev, self._events = self._events, []
        return ev

    def completed(self) -> list[CompletedRequest]:
        """Requests finished since the last call."""
        out, self._completed = self._completed, []
        return out

    def load(self, worker_idx: int) -> WorkerLoad:
        e = self.engines[worker_idx]
        return WorkerLoad(len(e.running), len(e.waiting), e.queued_prefill_tokens(),
                          e.kv_usage())

    def reset_prefix_cache(self, worker_idx: int) -> bool:
        return self.engines[worker_idx].reset_prefix_cache()
