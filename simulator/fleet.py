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
    def __init__(
        self, n_workers: int, config: EngineConfig, encoding: str = "map", dp_size: int = 1
    ) -> None:
        if n_workers < 1 or dp_size < 1:
            raise ValueError("n_workers and dp_size must be >= 1")
        self.config = config
        self.encoding = encoding
        self.dp_size = dp_size
        # engine index e = worker * dp_size + rank; each rank has its own seq numbers
        self.engines = [SimEngine(config) for _ in range(n_workers * dp_size)]
        self.now = 0.0
        self._seq = [0] * len(self.engines)
        self._events: list[tuple[int, int, int, bytes]] = []
        self._completed: list[CompletedRequest] = []
        # (time, worker) of each engine's next step start or step end
        self._pending_arrivals: list[tuple[float, int, int, tuple]] = []
        self._arrival_counter = 0
        self.rejected: list[str] = []  # future arrivals refused at admission (too long, full)

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
        priority: int = 0,
    ) -> None:
        """Queue a request; it reaches the worker at ``arrival_s`` (>= the current clock).
        ``priority``: vLLM's request priority (lower first; engines with scheduling policy
        ``priority`` only). Raises ValueError for a prompt that cannot fit the KV cache or a full
        queue."""
        if not 0 <= worker_idx < len(self.engines) // self.dp_size:
            raise ValueError(f"no worker {worker_idx}")
        if arrival_s <= self.now:
            e = self._pick_rank(worker_idx)
            self.engines[e].add_request(
                request_id,
                token_ids,
                max_tokens,
                self.now,
                lora_name,
                cache_salt,
                priority=priority,
            )
            self.engines[e].requests[request_id].arrival_s = arrival_s
            return
        self._arrival_counter += 1
        heapq.heappush(
            self._pending_arrivals,
            (
                arrival_s,
                self._arrival_counter,
                worker_idx,
                (request_id, token_ids, max_tokens, cache_salt, lora_name, priority),
            ),
        )

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
                arr, _, w, (rid, toks, mt, salt, lora, prio) = heapq.heappop(self._pending_arrivals)
                try:
                    self.engines[self._pick_rank(w)].add_request(
                        rid, toks, mt, arr, lora, salt, priority=prio
                    )
                except ValueError:
                    self.rejected.append(rid)
            for w, e in enumerate(self.engines):
                if e.in_flight() and e.next_step_time(self.now) <= self.now:
                    self._finish(w, e)
                if not e.in_flight() and e.next_step_time(self.now) <= self.now:
                    e.schedule(self.now)
        self.now = max(self.now, t_s)

    def _pick_rank(self, worker_idx: int) -> int:
        """vLLM's DP balancing inside one worker: least (waiting*4 + running)."""
        base = worker_idx * self.dp_size
        if self.dp_size == 1:
            return base
        return min(
            range(base, base + self.dp_size),
            key=lambda e: len(self.engines[e].waiting) * 4 + len(self.engines[e].running),
        )

    def _finish(self, idx: int, e: SimEngine) -> None:
        out = e.finish_step()
        w, rank = divmod(idx, self.dp_size)
        if out.events and e.events_enabled:
            payload = encode_batch(out.end_s, out.events, rank, self.encoding)
            self._events.append((w, rank, self._seq[idx], payload))
            self._seq[idx] += 1
        for r in out.finished:
            self._completed.append(
                CompletedRequest(
                    r.request_id,
                    w,
                    r.arrival_s,
                    r.first_token_s or out.end_s,
                    r.finish_s or out.end_s,
                    r.num_prompt,
                    *r.usage_hit(),
                    r.num_output,
                )
            )

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
        """Summed over the worker's DP ranks (kv_usage: mean)."""
        es = self.engines[worker_idx * self.dp_size : (worker_idx + 1) * self.dp_size]
        return WorkerLoad(
            sum(len(e.running) for e in es),
            sum(len(e.waiting) for e in es),
            sum(e.queued_prefill_tokens() for e in es),
            sum(e.kv_usage() for e in es) / len(es),
        )

    def reset_prefix_cache(self, worker_idx: int) -> bool:
        es = self.engines[worker_idx * self.dp_size : (worker_idx + 1) * self.dp_size]
        return all([e.reset_prefix_cache() for e in es])
