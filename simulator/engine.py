"""One simulated vLLM engine core (one DP rank): scheduler, KV cache, CPU tier, timing.

The same code runs in the HTTP server (wall clock) and in ``FastFleet`` (simulated clock).
A step is split in two, like vLLM's ``EngineCore.step``:
``schedule(now)`` decides the batch and allocates/caches blocks (events are produced at
schedule time, ``KVCacheManager.allocate_slots``) and returns the step's duration;
``finish_step()`` applies the model output at ``now + duration`` (new tokens, finished
requests freed tail first) and returns the step's events, published once per step only if
non-empty (``Scheduler.update_from_output`` L2623-2637: KV-manager events first, then the
connector's).

Scheduling follows vLLM v1 (continuous batching, chunked prefill): running requests first
(decode = 1 token, unfinished prefills chunked by the token budget), then waiting requests
in FIFO order while the budget, ``max_num_seqs`` and free blocks allow. A running request
that cannot get a block preempts the most recently scheduled running request (recompute).
With ``scheduling_policy="priority"`` (vLLM's ``--scheduling-policy priority``) the waiting
queue is ordered by (priority, arrival), lowest first, and the preemption victim is the
running request with the largest (priority, arrival). Under ``fcfs`` vLLM's V1 engine takes a
non-zero priority and ignores it; its V0 engine refused it (``reject_priority``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import xxhash

from simulator.events import Event
from simulator.hashing import RequestHasher
from simulator.kv_cache import GroupSpec, KVCacheManager, parse_groups
from simulator.offload import CpuTier
from simulator.request import (
    FINISHED,
    RUNNING,
    WAITING,
    WAITING_FOR_REMOTE_KVS,
    Request,
)


@dataclass
class EngineConfig:
    """Every knob of one simulated engine (one DP rank)."""

    model: str = "sim-model"
    block_size: int = 16
    num_gpu_blocks: int = 4096  # KV capacity in blocks, shared by all groups (incl. null)
    groups: str = "full"  # e.g. "full", "full,swa:64", "swa:64,full", "full,mamba"
    retention_interval: int | None = 0  # vLLM prefix_cache_retention_interval (None=dense)
    max_model_len: int = 131072
    max_num_batched_tokens: int = 8192  # token budget per step
    max_num_seqs: int = 256
    max_waiting: int = 10000  # bounded request queue
    scheduling_policy: str = "fcfs"  # fcfs | priority (vLLM's --scheduling-policy)
    reject_priority: bool = False  # vLLM's V0 engine: a non-zero priority under fcfs is an error
    # timing
    prefill_tokens_per_s: float = 20000.0
    cpu_load_tokens_per_s: float = 200000.0
    decode_s_per_token: float = 0.02  # one decode step (per generated token)
    step_overhead_s: float = 0.0005
    slowdown: float = 1.0  # fault: multiply every step duration
    admit_waiting: bool = True  # fault (False): a stalled scheduler, waiting requests stay put
    # CPU tier
    cpu_chunks: int = 0
    cpu_chunk_tokens: int = 256
    cpu_events: str = "placeholder"  # placeholder | self_describing
    # events
    enable_events: bool = True
    event_block_size_lie: int | None = None
    event_clock_skew_s: float = 0.0  # misconfiguration: event batch timestamps run this far ahead
    enable_prefix_caching: bool = True  # off: no block is cached, so no hit and no BlockStored
    loras: tuple[str, ...] = ()
    lora_ids: dict[str, int] = field(default_factory=dict)
    """Adapter name -> int id (the worker's adapter registry; else the position in ``loras``)."""
    max_loras: int = 1  # distinct adapters in one batch (vLLM's --max-loras, default 1)
    vocab_size: int = 32000
    group_specs: list[GroupSpec] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not self.group_specs:
            self.group_specs = parse_groups(self.groups)
        if self.block_size <= 0 or self.num_gpu_blocks < 2:
            raise ValueError("block_size must be > 0 and num_gpu_blocks >= 2")
        sizes = {g.block_size or self.block_size for g in self.group_specs}
        if self.cpu_chunks > 0 and len(sizes) > 1:
            # as vLLM's OffloadingConnector: chunking needs one block size for all groups
            raise ValueError("a CPU tier needs every KV-cache group to share one block size")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError("scheduling_policy must be fcfs or priority")


@dataclass
class StepOutput:
    start_s: float
    end_s: float
    new_tokens: dict[str, int]  # request_id -> token generated this step
    finished: list[Request]
    events: list[Event]


class QueueFull(Exception):
    pass


TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
"""vLLM's ``vllm:time_to_first_token_seconds`` buckets (``vllm/v1/metrics/loggers.py``)."""


class SimEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._build()
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.sleep_level: int | None = None
        """vLLM's sleep mode: the level while asleep (the scheduler admits nothing), else None."""
        self.external_queries = 0
        self.external_hits = 0
        self.ttft_buckets = [0] * len(TTFT_BUCKETS_S)
        """Requests whose first token came within each bound of ``TTFT_BUCKETS_S`` (cumulative,
        as vLLM's ``vllm:time_to_first_token_seconds`` histogram)."""
        self.first_tokens = 0
        self.ttft_sum_s = 0.0
        self.events_enabled = config.enable_events

    def _build(self) -> None:
        c = self.config
        self.kv = KVCacheManager(
            c.group_specs,
            c.num_gpu_blocks,
            c.block_size,
            c.retention_interval,
            c.event_block_size_lie,
            enable_caching=c.enable_prefix_caching,
        )
        # largest token count whose blocks (all groups) fit the pool
        lo, hi = 0, c.num_gpu_blocks * max(self.kv.gbs)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (
                (mid, hi)
                if self.kv.blocks_for_tokens(mid) <= c.num_gpu_blocks - 1
                else (lo, mid - 1)
            )
        self._cap_tokens = lo
        self.cpu: CpuTier | None = None
        if c.cpu_chunks > 0:
            fa = [g for g, s in enumerate(c.group_specs) if s.kind == "full_attention"]
            self.cpu = CpuTier(
                c.cpu_chunks,
                c.cpu_chunk_tokens,
                self.kv.hbs,
                c.cpu_events == "self_describing",
                fa[0] if fa else 0,
            )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._inflight: tuple[float, float, list[tuple[Request, int]]] | None = None
        self._pending_events: list[Event] = []  # e.g. AllBlocksCleared from a reset

    # ---- admission -----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        arrival_s: float,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        session_id: str | None = None,
        report_full: bool = False,
        priority: int = 0,
    ) -> Request:
        c = self.config
        if priority != 0 and c.scheduling_policy != "priority" and c.reject_priority:
            # vLLM's V0 engine, word for word (the server answers 400); V1 ignores the priority
            raise ValueError(f"Got priority {priority} but Priority scheduling is not enabled.")
        if len(self.waiting) >= c.max_waiting:
            raise QueueFull("request queue is full")
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        if not prompt:
            raise ValueError("prompt must not be empty")
        if len(prompt) >= c.max_model_len:
            raise ValueError(f"prompt has {len(prompt)} tokens, max_model_len is {c.max_model_len}")
        if self.kv.blocks_for_tokens(len(prompt)) > c.num_gpu_blocks - 1:
            raise ValueError("prompt does not fit in the KV cache")
        # Clamp so that prompt + output always fit the pool: a lone request can then never
        # preempt itself forever (vLLM bounds this through max_model_len vs. capacity).
        cap_tokens = self._cap_tokens
        max_tokens = max(
            1, min(int(max_tokens), c.max_model_len - len(prompt), cap_tokens - len(prompt))
        )
        lora_id = None
        if lora_name is not None:
            lora_id = c.lora_ids.get(lora_name) or c.loras.index(lora_name) + 1
        req = Request(
            request_id,
            prompt,
            max_tokens,
            arrival_s,
            len(c.group_specs),
            c.block_size,
            lora_name,
            lora_id,
            cache_salt,
            session_id,
            RequestHasher(self.kv.hbs, lora_name, cache_salt),
            priority,
        )
        req.report_full = report_full
        self.requests[request_id] = req
        if c.scheduling_policy == "priority":
            self._insert_by_priority(req)
        else:
            self.waiting.append(req)
        return req

    def _insert_by_priority(self, req: Request) -> None:
        """Into the waiting queue at its (priority, arrival) place: vLLM's priority queue pops
        in that order. Scanned from the back, where a new arrival usually belongs."""
        key = (req.priority, req.arrival_s)
        w = self.waiting
        i = len(w)
        while i > 0 and (w[i - 1].priority, w[i - 1].arrival_s) > key:
            i -= 1
        w.insert(i, req)

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None or req.status == FINISHED:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = FINISHED

    # ---- queries -------------------------------------------------------------------------
    def has_work(self) -> bool:
        # A queued AllBlocksCleared alone does not start a step: it rides on the next one.
        return bool(self.running or self.waiting or (self.cpu is not None and self.cpu.busy()))

    def in_flight(self) -> bool:
        return self._inflight is not None

    def next_step_time(self, now: float) -> float:
        """When the next step can start (math.inf if idle)."""
        if self._inflight is not None:
            return self._inflight[1]
        if self.running or (self.cpu is not None and self.cpu.busy()):
            return now
        if not self.waiting:
            return math.inf
        t = math.inf
        for r in self.waiting:
            if r.status != WAITING_FOR_REMOTE_KVS or r.load_ready_s <= now:
                return now
            t = min(t, r.load_ready_s)
        return t

    def queued_prefill_tokens(self) -> int:
        n = sum(len(r.all_token_ids) - r.num_computed for r in self.waiting)
        return n + sum(max(0, r.num_prompt - r.num_computed) for r in self.running)

    def kv_usage(self) -> float:
        return self.kv.pool.usage()

    # ---- reset ---------------------------------------------------------------------------
    def reset_prefix_cache(self, reset_external: bool = False) -> bool:
        ok = self.kv.pool.reset_prefix_cache()
        if ok:
            # AllBlocksCleared is queued; it goes out with the next step's batch (§2.5).
            self._pending_events.extend(self.kv.pool.take_events())
        if reset_external and self.cpu is not None:
            self.cpu.reset()  # silent, as OffloadingConnector.reset_cache
        return ok

    def silent_reset(self) -> None:
        """Fault: forget every cached block without announcing it (no AllBlocksCleared)."""
        pool = self.kv.pool
        for cg in pool.cached:
            for key_blocks in cg.values():
                for b in key_blocks:
                    pool.block_key[b] = None
            cg.clear()
        for b in list(pool.free_hashed):
            pool.free_unhashed.append(b)
        pool.free_hashed.clear()
        for req in list(self.running) + list(self.waiting):
            req.num_cached = [len(x) for x in req.blocks]  # nothing left to announce
        if self.cpu is not None:
            self.cpu.reset()

    def restart(self) -> None:
        """Full engine restart: every request dropped and the cache emptied, no events."""
        self._build()
        self.sleep_level = None

    # ---- stepping --------------------------------------------------------------------------
    def _step_duration(self, prefill: int, decode: int, load: int) -> float:
        c = self.config
        d = c.step_overhead_s + prefill / c.prefill_tokens_per_s
        if decode:
            d += c.decode_s_per_token
        return max(d * c.slowdown, 1e-6)

    def _first_schedule(self, req: Request, now: float) -> bool:
        """Prefix-cache lookup for a waiting request; returns False if it must wait."""
        kv, c = self.kv, self.config
        hit, per_group, longest = kv.find_hit(req)
        kv.set_reachable(req, hit, longest)
        if req.report_full and hit:
            kv.emit_cached_block_events(req, hit)
            req.report_full = False  # once, even if the request has to wait and retry
        ext = 0
        if self.cpu is not None:
            ext = self.cpu.lookup(req, hit)
        req.hit_done = True
        self.prefix_queries += len(req.all_token_ids)
        self.prefix_hits += hit
        if self.cpu is not None:
            self.external_queries += len(req.all_token_ids) - hit
            self.external_hits += ext
        if ext:
            if not kv.allocate_slots(req, 0, per_group, hit, ext):
                req.hit_done = False  # looked up again next step: do not count twice
                self.prefix_queries -= len(req.all_token_ids)
                self.prefix_hits -= hit
                self.external_queries -= len(req.all_token_ids) - hit
                self.external_hits -= ext
                return False
            self.cpu.touch(req, hit + ext)  # type: ignore[union-attr]
            req.num_computed = hit
            req.cached_tokens = hit
            req.cpu_loaded_tokens = ext
            req.status = WAITING_FOR_REMOTE_KVS
            req.load_ready_s = now + ext / c.cpu_load_tokens_per_s
            return False
        req.cached_tokens = hit
        if req.first_hit is None:
            req.first_hit = (hit, 0)
        self._hit_groups = per_group
        self._hit_tokens = hit
        return True

    def schedule(self, now: float) -> float:
        """Start a step at ``now``; returns its end time. Requires ``not in_flight()``."""
        assert self._inflight is None
        c, kv = self.config, self.kv
        budget = c.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        prefill_tokens = decode_tokens = 0
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(len(req.all_token_ids) - req.num_computed, budget)
            while not kv.allocate_slots(req, n):
                victim = self._victim()
                at = self.running.index(victim)
                del self.running[at]
                if at < i:  # scheduled earlier in this step: its tokens go back to the budget
                    j = next(k for k, (r, _) in enumerate(scheduled) if r is victim)
                    m = scheduled.pop(j)[1]
                    budget += m
                    if victim.num_computed < victim.num_prompt:
                        prefill_tokens -= m
                    else:
                        decode_tokens -= m
                    i -= 1
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                scheduled.append((req, n))
                budget -= n
                if req.num_computed < req.num_prompt:
                    prefill_tokens += n
                else:
                    decode_tokens += n
                i += 1
                continue
            break
        if not preempted:
            prefill_tokens += self._schedule_waiting(now, budget, scheduled)
        if self.cpu is not None:
            for req, n in scheduled:
                self.cpu.prepare_store(req, req.num_computed + n)
        end = now + self._step_duration(prefill_tokens, decode_tokens, 0)
        self._inflight = (now, end, scheduled)
        return end

    def _finish_cpu_load(self, req: Request) -> None:
        """A waiting request's CPU-tier load is done: the loaded tokens count as computed."""
        req.num_computed += req.cpu_loaded_tokens
        if req.num_computed >= len(req.all_token_ids):
            # vLLM (_update_waiting_for_remote_kv): a load that covers the whole prompt still
            # recomputes its last token.
            req.num_computed = len(req.all_token_ids) - 1
            req.cpu_loaded_tokens = req.num_computed - req.cached_tokens
        self.kv.cache_blocks(req, req.num_computed)
        if req.first_hit is None:
            req.first_hit = (req.cached_tokens, req.cpu_loaded_tokens)
        req.status = WAITING

    def _schedule_waiting(
        self, now: float, budget: int, scheduled: list[tuple[Request, int]]
    ) -> int:
        """Admit waiting requests in queue order into this step's batch (``scheduled``) while
        ``budget``, ``max_num_seqs`` and free blocks allow; returns the prefill tokens added.

        A request that cannot get its blocks stops the queue for every request that holds none,
        as vLLM's scan stops there; requests behind it that already hold blocks (a finished or
        running CPU load) still go. Stopping for those too strands them: the head waits for
        blocks that only their completion frees, and nothing runs again: the KV-offloading
        deadlock vLLM avoids by keeping such loads from queuing behind requests holding none."""
        c, kv = self.config, self.kv
        if not c.admit_waiting or self.sleep_level is not None:
            return 0
        added = 0
        skipped: list[Request] = []
        blocked = False
        # vLLM's Scheduler.schedule: a waiting request whose adapter would be one more than
        # max_loras distinct adapters in the batch is skipped until a slot frees up.
        loras = {r.lora_id for r in self.running if r.lora_id}
        while self.waiting and budget > 0 and len(self.running) < c.max_num_seqs:
            req = self.waiting[0]
            if blocked and not any(req.blocks):
                skipped.append(self.waiting.popleft())
                continue
            if req.lora_id and req.lora_id not in loras and len(loras) >= c.max_loras:
                skipped.append(self.waiting.popleft())
                continue
            if req.status == WAITING_FOR_REMOTE_KVS:
                if req.load_ready_s > now:
                    skipped.append(self.waiting.popleft())
                    continue
                self._finish_cpu_load(req)
                new_groups, new_tokens = None, 0
            elif not req.hit_done:
                if not self._first_schedule(req, now):
                    if req.status == WAITING_FOR_REMOTE_KVS:
                        skipped.append(self.waiting.popleft())
                        continue
                    blocked = True
                    skipped.append(self.waiting.popleft())
                    continue
                new_groups, new_tokens = self._hit_groups, self._hit_tokens
            else:
                new_groups, new_tokens = None, 0
            base = req.num_computed + new_tokens
            n = min(len(req.all_token_ids) - base, budget)
            if not kv.allocate_slots(req, n, new_groups, new_tokens):
                if new_groups is not None:  # retry the lookup next step
                    req.hit_done = False
                    self.prefix_queries -= len(req.all_token_ids)
                    self.prefix_hits -= new_tokens
                blocked = True
                skipped.append(self.waiting.popleft())
                continue
            req.num_computed = base
            self.waiting.popleft()
            if req.lora_id:
                loras.add(req.lora_id)
            req.status = RUNNING
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n
            added += n
        for r in reversed(skipped):
            self.waiting.appendleft(r)
        return added

    def _victim(self) -> Request:
        """The running request to preempt: the last scheduled (fcfs), or the one with the
        largest (priority, arrival) (vLLM's priority policy)."""
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_s))
        return self.running[-1]

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed = 0
        req.hit_done = False
        req.status = WAITING
        if self.config.scheduling_policy == "priority":
            self._insert_by_priority(req)
        else:
            self.waiting.appendleft(req)

    def _observe_ttft(self, ttft_s: float) -> None:
        """One request's first token, as vLLM observes it once per request (a preempted
        request's resumption is not another)."""
        self.first_tokens += 1
        self.ttft_sum_s += ttft_s
        for i, bound in enumerate(TTFT_BUCKETS_S):
            if ttft_s <= bound:
                self.ttft_buckets[i] += 1

    def finish_step(self) -> StepOutput:
        assert self._inflight is not None
        start, end, scheduled = self._inflight
        self._inflight = None
        new_tokens: dict[str, int] = {}
        finished: list[Request] = []
        for req, n in scheduled:
            req.num_computed += n
            if req.num_computed < len(req.all_token_ids):
                continue  # chunked prefill not done yet
            tok = self._sample(req)
            req.all_token_ids.append(tok)
            req.num_output += 1
            new_tokens[req.request_id] = tok
            if req.first_token_s is None:
                req.first_token_s = end
                self._observe_ttft(end - req.arrival_s)
            too_long = len(req.all_token_ids) >= self.config.max_model_len
            if req.num_output >= req.max_tokens or too_long:
                req.status = FINISHED
                req.finish_s = end
                self.running.remove(req)
                self.kv.free(req)
                self.requests.pop(req.request_id, None)
                finished.append(req)
        events = self._pending_events + self.kv.pool.take_events()
        self._pending_events = []
        if self.cpu is not None:
            # Connector events follow the KV-manager events: this step's prepare_store
            # evictions, then the stores submitted by the previous step completing.
            self.cpu.end_step()
            events += self.cpu.take_events()
        return StepOutput(start, end, new_tokens, finished, events)

    def _sample(self, req: Request) -> int:
        """Deterministic 'generated' token: depends on request id and position only."""
        h = xxhash.xxh64_intdigest(f"{req.request_id}:{len(req.all_token_ids)}".encode())
        return 100 + h % max(1, self.config.vocab_size - 100)
