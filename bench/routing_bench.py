"""Routing-quality benchmark: replay a workload through simulated vLLM workers per policy.

    python bench/routing_bench.py --quick                 # < 2 min: trace prefix, the peers
    python bench/routing_bench.py                         # full Mooncake conversation trace
    python bench/routing_bench.py --workload chat|agentic # synthetic workloads
    python bench/routing_bench.py --trace PATH            # any Mooncake-format file
    python bench/routing_bench.py --trace-spread-s 3      # its rounded timestamps spread
    python bench/routing_bench.py --loads 0.5,0.6,...,1.2 # sweep offered load: goodput
    python bench/routing_bench.py --sweep-knobs           # kvrouter with each knob varied
    python bench/routing_bench.py --jobs 4                # policies in parallel processes
    python bench/routing_bench.py --replicas 3            # kvrouter as three router replicas

The last line printed is one JSON object (``workload``, ``workers``, ``config``, ``policies``
at ``--load``, ``sweep`` per policy and load, ``goodput`` per policy: the highest load keeping
p90 TTFT <= ``--slo-p90-s``, ``rejected`` per policy, ``bounds``: bench/bounds.py, ``targets``:
bench/peer_report.py); PNG charts of TTFT and hit rate by policy and of p90 TTFT by load are
written to ``bench/out/routing_<workload>.png`` and ``..._p90_by_load.png``. Requests a worker
refuses (prompt plus output length past ``max_model_len``, a prompt larger than the KV cache)
are counted in ``rejected`` and never routed.
Progress and a one-line summary per policy go to stderr (nothing with ``--json``).

Default fleet (cache-bound; see ``FleetSpec``): 8 workers, 16-token blocks, 50,000 blocks
(800k tokens) of KV per worker, prefill 20k tokens/s, 20 ms per decode step, 2,048-token
chunked-prefill budget, 256 sequences. The fleet's 6.4M tokens of KV hold a few minutes of the
conversation trace's unique tokens, one worker's 800k tokens well under a minute: hits depend
on sending each conversation back where its prefix lives.

Every policy sees identical inputs (same requests, token ids, arrival times, fleet). Workers are
``simulator.FastFleet`` engines on a simulated clock (vLLM 0.33 scheduler, prefix cache, exact
KV events). The router side is kvrouter's real code: ``indexer.wire.decode_payload`` and
``indexer.index.PrefixIndex`` fed with every event batch the workers publish,
``router.candidates`` (``speculative_hits``, ``build_candidates``, ``record_sent``) for what the
policy is told and what a decision records (as the router does),
``router.policy`` for the decision and the speculative cache, and ``router.proxy.Ticket`` /
``router.workers.Worker`` for the router's own load accounting (in-flight requests and queued
uncached prefill tokens per worker, released at first token), corrected by the workers'
``/metrics`` gauges (waiting, running, KV usage) polled every ``--poll-s`` simulated seconds as
``router.workers`` does. Policies:

* ``random``, ``round_robin``, ``least_loaded``: ``router.policy`` baselines;
* ``kvrouter``: KV events + index + ``KvRouterPolicy`` + ``SpeculativeCache``; with
  ``--prefill-priority`` every policy's workers run vLLM's priority scheduling and kvrouter
  writes each request's prefill class as its priority (``router.prefill_priority``);
* ``kvrouter_admission``: the same behind the router's admission queue (``router.admission``:
  ``headroom`` and the ``--admission-order`` queue, threshold ``--admission-tokens``), each
  request's TTFT counted from its arrival, the wait at the router included;
* ``dynamo``, ``llm_d``, ``sglang``, ``vllm_router_kv_aware``, ``aibrix``: the peer products,
  each with its own view of the caches and its own load signal (``bench/peers.py``);
* with ``--replicas N``, ``kvrouter`` runs as N router replicas sharing state as through Redis
  (``router.shared_state``): each request goes to a replica at random, as a Service spreads
  them; each replica keeps its own accounting (so its own prefill clock per engine), policy
  and speculative cache, polls the workers on its own phase, hears of each change of the
  others' in-flight load ``PUBLISH_LAG_S`` after it is made and of their speculative entries
  (sampled as published) at once; the index, built by every replica from the same events, is one;
* ``pooled_ideal``: not a policy: one engine with the whole fleet's KV blocks, CPU chunks,
  prefill rate, token budget and sequence slots: what one engine as large as the fleet does
  (not a bound: bench/bounds.py has those).

Offered load: arrival times are divided by a speed-up chosen so the offered request rate is
``--load`` (default 0.8) times the fleet's *round-robin capacity*, measured first by a
saturation run: the same requests replayed with round robin at ~2x an analytic no-cache
estimate of capacity (so the queue never drains); capacity = prompt tokens per second of the
requests whose first token falls between the 10th and 90th percentile first-token times,
divided by the workload's mean prompt for requests per second (see ``measure_capacity``).

Metrics per policy: ``hit_rate`` = (GPU cached + CPU loaded prompt tokens at each request's
first admission, as vLLM's ``num_cached_tokens``: a preempted request's re-admission would
otherwise count its own recomputed blocks) / prompt tokens; TTFT mean and percentiles (first
token time - arrival);
``ttft_floor_s`` = mean TTFT the policy would have with no queueing at all at the hits it got
(each request's own uncached prefill in full-budget chunks, each step carrying a decode, on the
engine that served it; ``prefill_steps_with_decode`` is the measured share of prefill steps that
did carry one); ``queueing_resumed_s`` / ``queueing_fresh_s`` = mean TTFT minus floor over the
requests that resume an earlier prompt (at least half of it shared with one:
``bench.bounds.resumes_earlier``; ``resumed_requests`` of them) and over the others: the wait
that locality costs against the wait of requests free to go anywhere; ``throughput_rps`` =
requests / (last finish - first arrival); ``imbalance`` = busiest worker's busy time (sum of
its step durations) / mean busy time; ``decision_ms_p50`` =
wall time of one routing decision (content keys + index match + speculative lookup + policy for
kvrouter; keys + policy for the peers; policy only for the baselines).
"""

from __future__ import annotations

import argparse
import heapq
import inspect
import itertools
import json
import math
import os
import random
import statistics
import sys
import time
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import peer_report, peers
from bench.bounds import resumes_earlier, workload_bounds
from bench.workloads import Req, TokenSource, TraceError, load_workload, spread_arrivals
from indexer.index import EngineId, PrefixIndex
from indexer.wire import DecodeError, decode_payload
from kvrouter.progress import Progress
from router.admission import FairQueue, ShortestFirstQueue, headroom, make_queue
from router.candidates import build_candidates, record_sent, speculative_hits
from router.config import AdmissionConfig, WorkerSpec
from router.load import EngineLoad
from router.policy import Policy, PolicyParams, SpeculativeCache, make_policy
from router.popularity import PromptKeys
from router.prefill_priority import engine_priority
from router.proxy import Ticket
from router.shared_local import SharedSpeculativeCache
from router.shared_redis import RedisSharedState, sampled_keys
from router.workers import Worker
from simulator.engine import EngineConfig, SimEngine
from simulator.fleet import FastFleet
from simulator.request import Request

MODEL = "sim-model"
ADMISSION_POLICY = "kvrouter_admission"
POLICIES = ("random", "round_robin", "least_loaded", "kvrouter", ADMISSION_POLICY, "pooled_ideal")
# The trace is not part of the repository; by default it is read from beside the checkout. A
# checkout without it runs the synthetic chat workload by default (``default_workload``).
DEFAULT_TRACE = str(
    Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
)
CAPACITY_REQUESTS = 2000
ADMISSION_TOKENS = 2048
"""``kvrouter_admission``'s ``admission.queued_prefill_tokens_threshold`` by default: an engine
with less than one step's prefill budget queued takes the next request (``--admission-tokens``)."""
STALL_S = 600.0
"""Simulated seconds without a finished request, work left, after the last arrival: a stalled
fleet, reported instead of stepping empty forever (the longest prompt takes seconds)."""
QUICK_POLICIES = ("round_robin", "kvrouter", ADMISSION_POLICY, *peers.NAMES, "pooled_ideal")
OUT_DIR = Path(__file__).resolve().parent / "out"
PROGRESS = Progress()
"""Phases and each policy run's progress on stderr (main() makes it quiet with --json)."""


@dataclass
class FleetSpec:
    workers: int = 8
    block_size: int = 16
    gpu_blocks: int = 50_000  # per worker: 800k tokens (see --gpu-blocks)
    groups: str = "full"
    cpu_chunks: int = 0
    cpu_chunk_tokens: int = 256
    prefill_tokens_per_s: float = 20_000.0
    decode_s_per_token: float = 0.02
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 131_072
    scheduling_policy: str = "fcfs"
    """vLLM's ``--scheduling-policy`` on every worker (``--prefill-priority``: priority)."""

    def engine(self, pooled: bool = False, events: bool = True) -> EngineConfig:
        k = self.workers if pooled else 1
        return EngineConfig(
            model=MODEL,
            block_size=self.block_size,
            num_gpu_blocks=self.gpu_blocks * k,
            groups=self.groups,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens * k,
            max_num_seqs=self.max_num_seqs * k,
            max_waiting=1_000_000,
            prefill_tokens_per_s=self.prefill_tokens_per_s * k,
            decode_s_per_token=self.decode_s_per_token,
            cpu_chunks=self.cpu_chunks * k,
            cpu_chunk_tokens=self.cpu_chunk_tokens,
            enable_events=events,
            scheduling_policy=self.scheduling_policy,
        )

    def capacity_tokens_per_s(self) -> float:
        """Analytic fleet prefill throughput with full chunks and decodes riding along."""
        b = self.max_num_batched_tokens
        step = b / self.prefill_tokens_per_s + self.decode_s_per_token + 0.0005
        return self.workers * b / step


@dataclass
class RouterSpec:
    poll_s: float = 1.0
    speculative_ttl_s: float = 2.0
    params: PolicyParams = field(default_factory=PolicyParams)
    admission: AdmissionConfig = field(
        default_factory=lambda: AdmissionConfig(
            queued_prefill_tokens_threshold=ADMISSION_TOKENS, order="shortest_prompt"
        )
    )
    """The router's admission queue, for ``kvrouter_admission`` (the other policies route
    every request at arrival, as the router does with admission off)."""
    buffered: bool = False
    """Clients ask for whole answers (``stream: false``): the router sees no first token, and
    each poll's first-token count releases their prefill (``Worker.observe_first_tokens``)."""
    replicas: int = 1
    """Router replicas ``kvrouter`` runs as (``--replicas``), sharing load and speculative
    entries as through Redis (:class:`Replica`); the other policies run as one."""


@dataclass
class RunResult:
    name: str
    hit_rate: float
    ttft: list[float]
    throughput_rps: float
    imbalance: float
    decision_ms: list[float]
    completed: int
    preemptions: int = 0
    ttft_floor: list[float] = field(default_factory=list)
    """Each request's TTFT with no queueing at the hit it got (:func:`_prefill_floor`)."""
    prefill_steps: int = 0
    prefill_steps_with_decode: int = 0
    rejected: int = 0
    """Requests the workers refuse (:func:`rejects`)."""
    refused: int = 0
    """Requests the router's admission queue refuses (429: full, or past its deadline)."""
    ids: list[str] = field(default_factory=list)
    """Per served request, in ``ttft`` order: its id."""
    resuming: frozenset[str] | None = None
    """The ids of the requests that resume an earlier prompt (:func:`bench.bounds.
    resumes_earlier`), for the summary's split of queueing; None: no split."""

    def summary(self) -> dict[str, float | None]:
        t = sorted(self.ttft)
        d = sorted(self.decision_ms)
        resumed: list[float] = []
        fresh: list[float] = []
        if self.resuming is not None:
            for ttft, floor, rid in zip(self.ttft, self.ttft_floor, self.ids, strict=True):
                (resumed if rid in self.resuming else fresh).append(ttft - floor)
        return {
            "hit_rate": round(self.hit_rate, 4),
            "ttft_mean_s": round(statistics.fmean(t), 4) if t else math.nan,
            "ttft_p50_s": round(pct(t, 50), 4),
            "ttft_p90_s": round(pct(t, 90), 4),
            "ttft_p99_s": round(pct(t, 99), 4),
            "throughput_rps": round(self.throughput_rps, 4),
            "imbalance": round(self.imbalance, 4),
            "decision_ms_p50": round(pct(d, 50), 4),
            "completed": self.completed,
            "preemptions": self.preemptions,
            "ttft_floor_s": round(statistics.fmean(self.ttft_floor), 4)
            if self.ttft_floor
            else math.nan,
            "prefill_steps_with_decode": round(
                self.prefill_steps_with_decode / max(self.prefill_steps, 1), 4
            ),
            "rejected": self.rejected,
            "admission_refused": self.refused,
            "resumed_requests": len(resumed),
            # null, not NaN, where a workload has no such request: strict JSON readers refuse NaN
            "queueing_resumed_s": round(statistics.fmean(resumed), 4) if resumed else None,
            "queueing_fresh_s": round(statistics.fmean(fresh), 4) if fresh else None,
        }


def pct(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return math.nan
    i = min(len(sorted_vals) - 1, max(0, math.ceil(q / 100 * len(sorted_vals)) - 1))
    return sorted_vals[i]


class KeyCache:
    """Content keys of each request's prompt, computed once (identical for every policy)."""

    def __init__(self, unit: int) -> None:
        self.index = PrefixIndex(unit=unit)
        self.root = self.index.root(MODEL)
        self._keys: dict[str, array] = {}
        self._cost: dict[str, float] = {}

    def get(self, req: Req, tokens: list[int]) -> tuple[array, float]:
        """(keys, seconds it took to compute them: charged to every decision that uses them)."""
        k = self._keys.get(req.rid)
        if k is None:
            t0 = time.perf_counter()
            k = array("Q", self.index.prompt_keys(tokens, self.root))
            self._cost[req.rid] = time.perf_counter() - t0
            self._keys[req.rid] = k
        return k, self._cost[req.rid]


MAX_SPEC_KEYS: int = inspect.signature(RedisSharedState).parameters["max_spec_keys"].default
"""Keys of a speculative entry another replica hears of (before sampling), as the product."""
PUBLISH_LAG_S = 0.001
"""When the other replicas hear of a change of one replica's load: one round trip through
Redis after it (``RedisSharedState`` pushes and publishes each change at once; in a burst, at
most every ``push_min_interval_s``). Requests that arrive at one instant through different
replicas therefore do not see one another, as in the product."""


@dataclass
class Replica:
    """One router replica of several: its own accounting per worker (and so its own prefill
    clock per engine), policy and speculative cache; ``heard``: its load per engine as the
    other replicas know it (each change ``PUBLISH_LAG_S`` after it is made, through the
    product's own notification, ``Worker.on_load_change``). The index, which every replica
    builds from the same events, is one."""

    workers: list[Worker]
    loads: list[tuple[EngineId, EngineLoad]]
    """Per engine, its live load record at this replica (the candidates' own load)."""
    policy: Policy | None
    spec: SpeculativeCache
    heard: list[EngineLoad] = field(default_factory=list)
    next_poll: float = 0.0


def run_policy(
    name: str,
    reqs: list[Req],
    speed: float,
    fs: FleetSpec,
    rs: RouterSpec,
    src: TokenSource,
    keys: KeyCache,
    seed: int = 0,
    resuming: frozenset[str] | None = None,
) -> RunResult:
    """One policy's replay of ``reqs``. ``resuming``: the ids of the requests that resume an
    earlier prompt (:func:`bench.bounds.resumes_earlier`), for the summary's split of queueing;
    None leaves it out."""
    pooled = name == "pooled_ideal"
    streams = not rs.buffered  # the router sees first tokens only in streamed answers
    kv = name in ("kvrouter", ADMISSION_POLICY)  # kvrouter's index, candidates and policy
    use_events = kv or peers.uses_events(name)
    n = 1 if pooled else fs.workers
    fleet = FastFleet(n, fs.engine(pooled=pooled, events=use_events))
    busy = [0.0] * n
    preempted = [0]
    first_hit: dict[str, tuple[int, int]] = {}  # request id -> hit of its first admission
    mixed = [0, 0]  # steps with prefill, of which also carrying a decode
    for w, e in enumerate(fleet.engines):
        e.schedule = _timed_schedule(e, busy, w, mixed)  # busy time = sum of step durations
        e._preempt = _counted(e._preempt, preempted, first_hit)
    unit = keys.index.unit
    index = PrefixIndex(unit=unit, cpu_chunk_tokens=fs.cpu_chunk_tokens)
    engines = [(f"sim://w{i}", 0) for i in range(n)]
    for e in engines:
        index.add_engine(e, MODEL)
    by_engine = {e: i for i, e in enumerate(engines)}
    peer = None
    if name in peers.NAMES:
        env = peers.PeerEnv(fleet, fs.block_size, unit, fs.cpu_chunk_tokens, MODEL, seed)
        peer = peers.make(name, env)
    n_rep = rs.replicas if name == "kvrouter" else 1
    clock = [0.0]  # the time of what is being recorded: a decision, a first token, an end
    reps: list[Replica] = []
    for r in range(n_rep):
        pol: Policy | None = None  # a peer decides with its own model (bench/peers.py)
        if pooled:
            pol = make_policy("round_robin")
        elif peer is None:  # replica 0 draws the single router's tie-breaks
            pol = make_policy("kvrouter" if kv else name, rs.params, seed=seed + 7919 * r)
        if n_rep == 1:
            cache: SpeculativeCache = SpeculativeCache(rs.speculative_ttl_s)
        else:
            cache = SharedSpeculativeCache(
                rs.speculative_ttl_s, publish=lambda e, k, r=r: publish(r, e, k)
            )
        ws = [Worker(spec=WorkerSpec(url=url), client=None) for url, _ in engines]
        if n_rep > 1:
            for i, w in enumerate(ws):
                w.on_load_change = lambda r=r, i=i: changed(r, i)
        loads = [(e, w.load(0)) for e, w in zip(engines, ws, strict=True)]
        heard = [EngineLoad() for _ in range(n)]
        reps.append(Replica(ws, loads, pol, cache, heard, next_poll=rs.poll_s * (1 + r / n_rep)))
    news: list[tuple[float, int, int, int, EngineLoad]] = []  # heap: (heard at, #, replica, ...)
    order = itertools.count()

    def changed(origin: int, i: int) -> None:
        # RedisSharedState's push: the record as it is now, heard by the others a lag later
        ld = reps[origin].workers[i].load(0)
        add = EngineLoad(ld.inflight_requests, ld.prefilling_requests, ld.queued_prefill_tokens)
        heapq.heappush(news, (clock[0] + PUBLISH_LAG_S, next(order), origin, i, add))

    def remote_of(me: int, t: float) -> dict[EngineId, EngineLoad]:
        # RedisSharedState.remote_loads: the others' records as heard by t, summed
        while news and news[0][0] <= t:
            _, _, origin, i, ld = heapq.heappop(news)
            reps[origin].heard[i] = ld
        remote: dict[EngineId, EngineLoad] = {}
        for o, rep in enumerate(reps):
            for e, ld in zip(engines, rep.heard, strict=True):
                if o != me and not ld.is_idle():
                    remote[e] = ld if e not in remote else remote[e].plus(ld)
        return remote

    def publish(origin: int, engine: EngineId, k: Sequence[int]) -> None:
        # RedisSharedState's pub/sub: the entry, its keys sampled, at every other replica
        for other in reps[:origin] + reps[origin + 1 :]:
            assert isinstance(other.spec, SharedSpeculativeCache)
            other.spec.record_remote(engine, sampled_keys(k, MAX_SPEC_KEYS), clock[0])

    tickets: dict[str, Ticket] = {}
    prefilling: list[dict[str, tuple[object, Ticket]]] = [{} for _ in range(n)]
    decisions: list[float] = []
    rejected = 0
    refused = 0  # by the admission queue (429): full, or waited past its deadline
    queue: FairQueue[Req] | ShortestFirstQueue[Req] | None = None
    if name == ADMISSION_POLICY:
        queue = make_queue(rs.admission)
    arrived: dict[str, float] = {}  # a queued request's arrival (its TTFT counts the wait)
    pick_replica = random.Random(seed)  # a Service spreads requests over replicas at random
    n_done = 0
    hit_tokens = prompt_tokens = 0
    ttfts: list[float] = []
    floors: list[float] = []
    ids: list[str] = []
    ecfg = fleet.config
    last_finish = 0.0

    def release_first_tokens() -> None:
        # The proxy releases a request's queued prefill tokens at its first streamed token, as
        # it comes: in time order across engines, and before any answer that has since ended.
        done = [
            (r.first_token_s, w, rid)
            for w in range(n)
            for rid, (r, _) in prefilling[w].items()
            if r.first_token_s is not None
        ]
        for at, w, rid in sorted(done):
            clock[0] = at
            prefilling[w].pop(rid)[1].first_token(at, prefilled=True)

    def ingest() -> None:
        nonlocal n_done, hit_tokens, prompt_tokens, last_finish
        for w, rank, _seq, payload in fleet.drain_events():
            try:
                batch = decode_payload(payload)
            except DecodeError:
                continue
            if kv:  # the other policies never read kvrouter's index
                index.apply((engines[w][0], rank), batch.events)
            if peer is not None:
                peer.on_events(w, batch.events)
        if streams:
            release_first_tokens()
        for c in fleet.completed():
            n_done += 1
            gpu_hit, cpu_hit = first_hit.pop(c.request_id, (c.cached_tokens, c.cpu_loaded_tokens))
            hit_tokens += gpu_hit + cpu_hit
            prompt_tokens += c.prompt_tokens
            ttfts.append(c.first_token_s - arrived.pop(c.request_id, c.arrival_s))
            ids.append(c.request_id)
            floors.append(_prefill_floor(c.prompt_tokens, gpu_hit, cpu_hit, ecfg))
            last_finish = max(last_finish, c.finish_s)
            if peer is not None:
                peer.finished(c.request_id)
            t = tickets.pop(c.request_id, None)
            if t is not None:
                clock[0] = c.finish_s
                t.finish(c.finish_s)

    def poll(rep: Replica, t: float) -> None:
        # router.workers.WorkerRegistry._check: the gauges of vLLM's /metrics.
        clock[0] = t
        for w in range(n):
            ld = fleet.load(w)
            rep.workers[w].load(0).set_gauges(ld.waiting, ld.running, ld.kv_usage)
            # vllm:time_to_first_token_seconds _count and _sum: release buffered requests'
            # prefill, each at its send plus the poll interval's mean time to first token
            e = fleet.engines[w]
            rep.workers[w].observe_first_tokens(0, e.first_tokens, ld.waiting, t, e.ttft_sum_s)

    def advance(t: float) -> None:
        if peer is not None:
            peer.advance(t)
        while True:  # every replica's polls, each on its own phase, in time order
            rep = min(reps, key=lambda x: x.next_poll)
            if rep.next_poll > t:
                break
            fleet.run_until(rep.next_poll)
            ingest()
            poll(rep, rep.next_poll)
            rep.next_poll += rs.poll_s
        fleet.run_until(t)
        ingest()

    def send(req: Req, t: float) -> None:
        toks = src.tokens(req)
        n_tok = len(toks)
        me = pick_replica.randrange(n_rep) if n_rep > 1 else 0
        rep = reps[me]
        policy, spec, workers, loads = rep.policy, rep.spec, rep.workers, rep.loads
        remote = remote_of(me, t) if n_rep > 1 else None
        clock[0] = t
        if peer is not None:
            kk, kcost = keys.get(req, toks)
            t0 = time.perf_counter()
            d = peers.decision(engines, peer.route(req.rid, toks, kk, t), name)
            decisions.append((time.perf_counter() - t0 + kcost) * 1000)
            uncached = n_tok
        elif kv:
            assert policy is not None
            kk, kcost = keys.get(req, toks)
            t0 = time.perf_counter()
            matches = index.match_keys(kk, n_tok, engines)
            sp, reach = speculative_hits(spec, index, engines, kk, n_tok, t)
            cands = build_candidates(
                loads,
                matches,
                block_size=fs.block_size,
                speculative=sp,
                reach=reach,
                remote=remote,
            )
            d = policy.choose(cands, n_tok, t, prompt=PromptKeys(kk, index.unit))
            record_sent(spec, index, d.engine, kk, n_tok, matches.get(d.engine), t)
            decisions.append((time.perf_counter() - t0 + kcost) * 1000)
            cost = next(c for c in d.costs if c.engine == d.engine)
            uncached = cost.uncached_tokens
        else:
            assert policy is not None
            cands = build_candidates(loads, {}, block_size=fs.block_size)
            t0 = time.perf_counter()
            d = policy.choose(cands, n_tok, t)
            decisions.append((time.perf_counter() - t0) * 1000)
            uncached = n_tok  # no index consulted: the proxy charges the whole prompt
        w = by_engine[d.engine]
        priority = 0
        if kv and rs.params.prefill_priority:  # as Router.prioritized writes vLLM's priority
            priority = engine_priority(uncached, d.engine, workers[w], policy, rs.params, t)
        ticket = Ticket(workers[w], 0, uncached, buffered=not streams, now=t)
        tickets[req.rid] = ticket
        fleet.submit(w, req.rid, toks, req.max_tokens, t, priority=priority)
        if streams:
            prefilling[w][req.rid] = (fleet.engines[w].requests[req.rid], ticket)

    def admit(t: float) -> None:
        # router.admission: route the queue's next request while the engines have room.
        nonlocal refused
        workers = reps[0].workers  # the admission queue runs with one replica
        queued = [w.load(0).queued_prefill_tokens for w in workers]
        threshold = rs.admission.queued_prefill_tokens_threshold or 1
        while queue and headroom(queued, threshold) > 0:
            req = queue.pop_first(now=t)
            assert req is not None
            if t - arrived[req.rid] > rs.admission.max_wait_s:
                arrived.pop(req.rid)
                refused += 1  # the router answers 429 (deadline)
                continue
            send(req, t)
            queued = [w.load(0).queued_prefill_tokens for w in workers]

    def wait_for_room(until: float) -> None:
        # First tokens come at step ends: admit at each one before the next arrival.
        while queue:
            nxt = fleet.next_event_time()
            if nxt >= until:
                return
            advance(nxt)
            admit(nxt)

    for rep in reps:  # the registry checks every worker before the router serves
        poll(rep, 0.0)
    for req in PROGRESS.iterate(reqs, name, len(reqs)):
        t = req.arrival_s / speed
        wait_for_room(t)
        advance(t)
        if rejects(fleet, req):
            rejected += 1  # vLLM answers HTTP 400 before scheduling: no worker state changes
            continue
        if queue is None:
            send(req, t)
            continue
        if len(queue) >= rs.admission.max_queue:
            refused += 1  # the router answers 429 (queue_full)
            continue
        arrived[req.rid] = t
        # The router orders by the request body's bytes; a prompt's grow with its tokens.
        queue.push(0, None, req, req.n_tokens, t)
        admit(t)
    wait_for_room(math.inf)
    # drain: keep the poll loop going so the state stays consistent until everything finished
    t = reqs[-1].arrival_s / speed if reqs else 0.0
    done_at, progress_t = n_done, t
    while n_done < len(reqs):
        nxt = fleet.next_event_time()
        if nxt == math.inf:
            break
        t = max(t + 10.0, nxt)
        advance(t)
        if n_done > done_at:
            done_at, progress_t = n_done, t
        elif t - progress_t > STALL_S:
            raise _stalled(name, fleet, len(reqs) - n_done)
    first = reqs[0].arrival_s / speed if reqs else 0.0
    span = max(last_finish - first, 1e-9)
    mean_busy = statistics.fmean(busy) if busy else 0.0
    return RunResult(
        name=name,
        hit_rate=hit_tokens / prompt_tokens if prompt_tokens else 0.0,
        ttft=ttfts,
        throughput_rps=n_done / span,
        imbalance=max(busy) / mean_busy if mean_busy > 0 else 1.0,
        decision_ms=decisions,
        completed=n_done,
        preemptions=preempted[0],
        ttft_floor=floors,
        prefill_steps=mixed[0],
        prefill_steps_with_decode=mixed[1],
        rejected=rejected,
        refused=refused,
        ids=ids,
        resuming=resuming,
    )


def rejects(fleet: FastFleet, req: Req) -> bool:
    """Whether a worker refuses the request outright, as vLLM's OpenAI server does (HTTP 400):
    an empty prompt, a prompt and ``max_tokens`` (the trace's output length) past
    ``max_model_len``, or a prompt of more blocks than the KV cache."""
    cfg = fleet.config
    n = req.n_tokens
    return (
        n == 0
        or n + req.max_tokens > cfg.max_model_len
        or fleet.engines[0].kv.blocks_for_tokens(n) > cfg.num_gpu_blocks - 1
    )


def _prefill_floor(prompt: int, gpu_hit: int, cpu_hit: int, cfg: EngineConfig) -> float:
    """The TTFT this request would have had with no queueing at all: its own uncached tokens in
    full-budget chunks on the engine that served it, each chunk's step also carrying a decode
    (``prefill_steps_with_decode`` shows that nearly every prefill step does at these loads),
    plus loading its CPU hits: what a policy's TTFT would be at its hits on a fleet with no
    queue, the part of its TTFT placement cannot remove. A step with no decode is shorter, so
    this is a measure, not a bound (bench/bounds.py has those)."""
    u = max(prompt - gpu_hit - cpu_hit, 1)
    chunks = math.ceil(u / cfg.max_num_batched_tokens)
    step = cfg.step_overhead_s + cfg.decode_s_per_token
    return u / cfg.prefill_tokens_per_s + chunks * step + cpu_hit / cfg.cpu_load_tokens_per_s


def _counted(orig, counter: list[int], first_hit: dict[str, tuple[int, int]]):
    def preempt(req: Request) -> None:
        counter[0] += 1
        # A preempted request is re-admitted and finds its own just-freed blocks cached; vLLM's
        # num_cached_tokens keeps the first admission's hit, and so does the hit rate here.
        first_hit.setdefault(req.request_id, (req.cached_tokens, req.cpu_loaded_tokens))
        orig(req)

    return preempt


def _timed_schedule(engine: SimEngine, busy: list[float], w: int, mixed: list[int]):
    orig = engine.schedule

    def schedule(now: float) -> float:
        end = orig(now)
        busy[w] += end - now
        batch = engine._inflight[2] if engine._inflight else []
        if any(r.num_computed < r.num_prompt for r, _ in batch):
            mixed[0] += 1
            mixed[1] += any(r.num_computed >= r.num_prompt for r, _ in batch)
        return end

    return schedule


def measure_capacity(
    reqs: list[Req],
    fs: FleetSpec,
    rs: RouterSpec,
    src: TokenSource,
    keys: KeyCache,
    mean_prompt: float,
) -> dict[str, float]:
    """Round-robin capacity of the fleet on this workload, by a saturation run.

    Uses the first ``CAPACITY_REQUESTS`` requests: a saturated fleet's throughput settles within
    a few hundred requests, and replaying the whole trace at 2x capacity would cost as much as
    another policy run. Capacity is measured in prompt tokens per second (what a prefill-bound
    fleet serves) and converted to requests per second with the whole workload's mean prompt,
    so a subset with longer prompts than the rest does not skew the offered load
    (``mean_prompt``: that of the requests the workers accept; the refused are never served,
    so they do not set the offered load).
    """
    sub = reqs[:CAPACITY_REQUESTS]
    sub_rate = len(sub) / max(sub[-1].arrival_s - sub[0].arrival_s, 1e-9)
    sub_prompt = statistics.fmean(min(r.n_tokens, fs.max_model_len) for r in sub)
    est_rps = fs.capacity_tokens_per_s() / sub_prompt
    speed = 2.0 * est_rps / sub_rate
    firsts = sorted(_first_token_times(sub, speed, fs, src))
    lo, hi = pct([t for t, _ in firsts], 10), pct([t for t, _ in firsts], 90)
    tokens = sum(n for t, n in firsts if lo <= t <= hi)
    cap_tps = tokens / max(hi - lo, 1e-9)
    return {
        "method": f"saturation run on the first {len(sub)} requests: round robin offered 2x the "
        "no-cache analytic capacity; capacity = prompt tokens of the requests whose first token "
        "falls between the 10th and 90th percentile first-token times / that interval; "
        "requests/s = that / the workload's mean prompt",
        "analytic_no_cache_tokens_per_s": round(fs.capacity_tokens_per_s(), 1),
        "round_robin_capacity_tokens_per_s": round(cap_tps, 1),
        "round_robin_capacity_rps": round(cap_tps / mean_prompt, 4),
        "trace_rate_rps": round(len(reqs) / max(reqs[-1].arrival_s - reqs[0].arrival_s, 1e-9), 4),
    }


def _first_token_times(
    reqs: list[Req], speed: float, fs: FleetSpec, src: TokenSource
) -> list[tuple[float, int]]:
    fleet = FastFleet(fs.workers, fs.engine(events=False))
    out: list[tuple[float, int]] = []
    for i, req in enumerate(reqs):
        t = req.arrival_s / speed
        fleet.run_until(t)
        out.extend((c.first_token_s, c.prompt_tokens) for c in fleet.completed())
        if not rejects(fleet, req):
            fleet.submit(i % fs.workers, req.rid, src.tokens(req), req.max_tokens, t)
    progress_t = fleet.now
    while len(out) < len(reqs):
        nxt = fleet.next_event_time()
        if nxt == math.inf:
            break
        fleet.run_until(nxt + 10.0)
        done = fleet.completed()
        out.extend((c.first_token_s, c.prompt_tokens) for c in done)
        if done:
            progress_t = fleet.now
        elif fleet.now - progress_t > STALL_S:
            raise _stalled("round_robin (capacity run)", fleet, len(reqs) - len(out))
    return out


def _stalled(name: str, fleet: FastFleet, unfinished: int) -> RuntimeError:
    stuck = [e for e, eng in enumerate(fleet.engines) if eng.has_work()]
    return RuntimeError(
        f"{name}: no request finished in {STALL_S:.0f} simulated seconds, {unfinished} "
        f"unfinished on engines {stuck}: the simulated engines stopped making progress"
    )


def run_all(
    reqs: list[Req],
    speed: float,
    fs: FleetSpec,
    rs: RouterSpec,
    src: TokenSource,
    keys: KeyCache,
    policies: list[str],
    seed: int,
    log: bool = True,
    jobs: int = 1,
    resuming: frozenset[str] | None = None,
) -> dict[str, dict[str, float]]:
    """Every policy on identical inputs; ``jobs`` > 1 runs them in forked processes."""
    global _SHARED
    out: dict[str, dict[str, float]] = {}
    if jobs > 1 and len(policies) > 1:
        import multiprocessing as mp

        _SHARED = (reqs, speed, fs, rs, src, keys, seed, resuming)
        with mp.get_context("fork").Pool(min(jobs, len(policies))) as pool:
            for name, s, dt in pool.imap_unordered(_run_one, policies):
                out[name] = s
                if log:
                    _log(name, s, dt)
        _SHARED = None
        return {name: out[name] for name in policies}
    for name in policies:
        t0 = time.perf_counter()
        out[name] = run_policy(name, reqs, speed, fs, rs, src, keys, seed, resuming).summary()
        if log:
            _log(name, out[name], time.perf_counter() - t0)
    return out


_SHARED: tuple | None = None  # inputs inherited by forked workers (copy-on-write)


def _run_one(name: str) -> tuple[str, dict[str, float], float]:
    assert _SHARED is not None
    reqs, speed, fs, rs, src, keys, seed, resuming = _SHARED
    t0 = time.perf_counter()
    s = run_policy(name, reqs, speed, fs, rs, src, keys, seed, resuming).summary()
    return name, s, time.perf_counter() - t0


def _log(name: str, s: dict[str, float], dt: float) -> None:
    PROGRESS.phase(
        f"  {name:14s} hit {s['hit_rate']:.3f}  ttft mean {s['ttft_mean_s']:8.3f}s "
        f"p50 {s['ttft_p50_s']:7.3f} p90 {s['ttft_p90_s']:7.3f} "
        f"p99 {s['ttft_p99_s']:8.3f} floor {s['ttft_floor_s']:.3f}  rps {s['throughput_rps']:.3f}  "
        f"imb {s['imbalance']:.2f} pre {s['preemptions']} "
        f"dec {s['decision_ms_p50']:.3f}ms  ({dt:.1f}s)"
    )


KNOB_GRID: dict[str, list[float]] = {
    "speculative_ttl_s": [0.0, 0.5, 2.0, 10.0],
    "near_tie_tokens": [0, 64, 512, 4096],
    "cpu_transfer_discount": [0.0, 0.25, 0.5, 1.0],
    "running_request_tokens": [0.0, 16.0, 128.0],
    "kv_pressure_tokens": [0.0, 2048.0, 16384.0],
    "recompute_weight": [1.0, 2.0, 4.0, 8.0],
    "follow_on_weight": [0.0, 0.25, 0.5, 1.0],
    "new_holder_weight": [0.0, 0.5, 1.0],
}


def sweep_knobs(
    reqs: list[Req],
    speed: float,
    fs: FleetSpec,
    rs: RouterSpec,
    src: TokenSource,
    keys: KeyCache,
    seed: int,
    only: list[str] | None = None,
) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = {}
    for knob, values in KNOB_GRID.items():
        if only and knob not in only:
            continue
        if knob == "cpu_transfer_discount" and fs.cpu_chunks == 0:
            continue  # no CPU tier: the knob cannot matter
        if knob != "speculative_ttl_s" and not hasattr(rs.params, knob):
            continue
        out[knob] = {}
        for v in values:
            if knob == "speculative_ttl_s":
                rs2 = replace(rs, speculative_ttl_s=v)
            else:
                value = type(getattr(rs.params, knob))(v)
                rs2 = replace(rs, params=msgspec.structs.replace(rs.params, **{knob: value}))
            res = run_policy("kvrouter", reqs, speed, fs, rs2, src, keys, seed).summary()
            out[knob][str(v)] = {
                k: res[k]
                for k in ("hit_rate", "ttft_mean_s", "ttft_p90_s", "ttft_p99_s", "imbalance")
            }
            PROGRESS.phase(f"  knob {knob}={v}: {out[knob][str(v)]}")
    return out


def chart(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = result.get("by_load") or {str(result["config"]["load"]): result["policies"]}
    names = list(result["policies"])
    fig, axes = plt.subplots(1, 3 if len(loads) > 1 else 2, figsize=(15, 4.8))
    pol = result["policies"]
    x = range(len(names))
    ax = axes[0]
    w = 0.27
    for j, (key, label) in enumerate(
        [("ttft_mean_s", "mean"), ("ttft_p90_s", "p90"), ("ttft_p99_s", "p99")]
    ):
        ax.bar(
            [i + (j - 1) * w for i in x], [max(pol[n][key], 1e-3) for n in names], w, label=label
        )
    ax.set_yscale("log")
    ax.set_xticks(list(x), names, rotation=25, ha="right")
    ax.set_ylabel("TTFT (s, log)")
    ax.set_title(f"TTFT at load {result['config']['load']}")
    ax.legend()
    ax = axes[1]
    ax.bar(list(x), [pol[n]["hit_rate"] for n in names], color="tab:green")
    ax.set_xticks(list(x), names, rotation=25, ha="right")
    ax.set_ylabel("prefix-cache hit rate")
    ax.set_title("hit rate (cached / prompt tokens)")
    for i, n in enumerate(names):
        ax.text(i, pol[n]["hit_rate"], f"{pol[n]['hit_rate']:.2f}", ha="center", va="bottom")
    if len(loads) > 1:
        ax = axes[2]
        ls = sorted(loads, key=float)
        for n in names:
            ax.plot(
                [float(v) for v in ls],
                [max(loads[v][n]["ttft_mean_s"], 1e-3) for v in ls],
                marker="o",
                label=n,
            )
        ax.set_yscale("log")
        ax.set_xlabel("offered load (x round-robin capacity)")
        ax.set_ylabel("mean TTFT (s, log)")
        ax.set_title("mean TTFT by load")
        ax.legend(fontsize=8)
    fig.suptitle(f"kvrouter routing benchmark: {result['workload']}, {result['workers']} workers")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def default_workload() -> str:
    """The conversation trace when it is where ``DEFAULT_TRACE`` says, else ``chat``: a clean
    checkout runs without files from outside the repository."""
    if Path(DEFAULT_TRACE).is_file():
        return "mooncake"
    print(
        f"routing_bench: no trace at {DEFAULT_TRACE}: running --workload chat "
        "(--trace PATH replays a Mooncake-format file)",
        file=sys.stderr,
    )
    return "chat"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--workload",
        choices=("mooncake", "chat", "agentic"),
        default=None,
        help="default: mooncake if the conversation trace is beside the checkout, else chat",
    )
    ap.add_argument("--trace", default=None, help="Mooncake-format JSONL (implies mooncake)")
    ap.add_argument(
        "--trace-block-tokens",
        type=int,
        default=None,
        help="tokens per hash_ids entry (default: inferred from the lines; Mooncake 512, "
        "Qwen Bailian 16)",
    )
    ap.add_argument(
        "--trace-time-unit",
        choices=("ms", "s"),
        default=None,
        help="timestamp unit (default: s for lines with chat_id, the Bailian schema; else ms)",
    )
    ap.add_argument(
        "--trace-spread-s",
        type=float,
        default=0.0,
        help="move each arrival later by a uniform draw from [0, S) (seeded): a trace whose "
        "timestamps are rounded, e.g. 3 for the Mooncake conversation trace's 3 s steps",
    )
    ap.add_argument("--quick", action="store_true", help="trace prefix; < 2 min")
    ap.add_argument("--limit", type=int, default=None, help="first N requests only")
    ap.add_argument("--scale", type=float, default=1.0, help="synthetic workload size factor")
    ap.add_argument("--load", type=float, default=0.8, help="x round-robin capacity")
    ap.add_argument("--loads", default=None, help="comma list: sweep offered load")
    ap.add_argument(
        "--speed", type=float, default=None, help="fixed arrival speed-up (skips the capacity run)"
    )
    ap.add_argument("--policies", default=None, help="comma list (default: all; --quick: peers)")
    ap.add_argument("--slo-p90-s", type=float, default=2.0, help="goodput SLO on p90 TTFT")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--gpu-blocks", type=int, default=None, help="KV blocks per worker")
    ap.add_argument("--groups", default="full", help='e.g. "full,swa:1024" (hybrid)')
    ap.add_argument("--cpu-chunks", type=int, default=0, help="CPU tier chunks per worker")
    ap.add_argument("--cpu-chunk-tokens", type=int, default=256)
    ap.add_argument("--prefill-tps", type=float, default=20_000.0)
    ap.add_argument("--decode-s", type=float, default=0.02)
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--max-model-len", type=int, default=FleetSpec.max_model_len)
    ap.add_argument("--poll-s", type=float, default=1.0)
    ap.add_argument("--spec-ttl", type=float, default=2.0)
    ap.add_argument(
        "--buffered",
        action="store_true",
        help="clients ask for whole answers (stream: false); default: streamed answers",
    )
    ap.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="router replicas kvrouter runs as, sharing load and speculative entries as "
        "through Redis (the other policies run as one)",
    )
    ap.add_argument(
        "--admission-tokens",
        type=int,
        default=ADMISSION_TOKENS,
        help="kvrouter_admission: admission.queued_prefill_tokens_threshold",
    )
    ap.add_argument(
        "--admission-order",
        choices=("shortest_prompt", "fair"),
        default="shortest_prompt",
        help="kvrouter_admission: admission.order",
    )
    ap.add_argument(
        "--prefill-priority",
        action="store_true",
        help="workers run vLLM's --scheduling-policy priority and kvrouter writes each "
        "request's prefill class as its priority (policy.prefill_priority)",
    )
    ap.add_argument("--near-tie", type=int, default=None)
    ap.add_argument("--cpu-discount", type=float, default=None)
    ap.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set any router.policy.PolicyParams field (repeatable)",
    )
    ap.add_argument(
        "--sweep-knobs",
        nargs="?",
        const="all",
        default=None,
        help="vary each PolicyParams knob (or a comma list of knobs) for kvrouter",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--seeds",
        default=None,
        help="comma list: the whole run once per seed; targets met on how many (overrides --seed)",
    )
    ap.add_argument("--jobs", type=int, default=1, help="policies run in parallel processes")
    ap.add_argument("--out", default=None, help="chart path (PNG)")
    ap.add_argument("--json", action="store_true", help="no progress on stderr, only the JSON")
    args = ap.parse_args(argv)
    if args.seeds is None:
        return _run(args)
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--seeds: a comma list of integers, not {args.seeds!r}") from None
    if not seeds:
        raise SystemExit("--seeds: no seed given")
    per_seed = {
        str(s): _run(argparse.Namespace(**{**vars(args), "seed": s}), emit=False) for s in seeds
    }
    result = {
        "seeds": per_seed,
        "targets_over_seeds": peer_report.over_seeds(
            {s: r["targets"] for s, r in per_seed.items()}
        ),
    }
    print(json.dumps(result, separators=(",", ":")))
    return result


def _run(args: argparse.Namespace, emit: bool = True) -> dict:
    """One run at ``args.seed``; prints its JSON when ``emit``."""
    if args.trace:
        args.workload = "mooncake"
    if args.trace_block_tokens is not None and args.trace_block_tokens < 1:
        raise SystemExit(f"--trace-block-tokens must be >= 1, got {args.trace_block_tokens}")
    trace = args.trace or DEFAULT_TRACE
    if args.workload is None:
        args.workload = default_workload()
    limit = args.limit
    if args.quick and limit is None:
        limit = 500 if args.workload == "mooncake" else None
    if args.quick and args.jobs == 1:
        args.jobs = min(2, os.cpu_count() or 1)
    global PROGRESS
    PROGRESS = Progress(quiet=args.json, bar=args.jobs == 1)  # processes share a terminal
    scale = args.scale * (0.4 if args.quick and args.workload != "mooncake" else 1.0)
    try:
        reqs, trace_format = load_workload(
            args.workload,
            trace,
            limit,
            args.seed,
            scale,
            args.trace_block_tokens,
            args.trace_time_unit,
        )
    except TraceError as exc:
        raise SystemExit(str(exc)) from None
    except OSError as exc:
        raise SystemExit(
            f"cannot read the trace: {exc} (--trace PATH, or --workload chat|agentic)"
        ) from None
    if args.trace_spread_s < 0:
        raise SystemExit("--trace-spread-s: must be >= 0")
    reqs = spread_arrivals(reqs, args.trace_spread_s, args.seed)
    if not reqs:
        raise SystemExit("empty workload")
    gpu_blocks = args.gpu_blocks or FleetSpec.gpu_blocks
    fs = FleetSpec(
        workers=args.workers,
        block_size=args.block_size,
        gpu_blocks=gpu_blocks,
        groups=args.groups,
        cpu_chunks=args.cpu_chunks,
        cpu_chunk_tokens=args.cpu_chunk_tokens,
        prefill_tokens_per_s=args.prefill_tps,
        decode_s_per_token=args.decode_s,
        max_num_batched_tokens=args.budget,
        max_model_len=args.max_model_len,
        scheduling_policy="priority" if args.prefill_priority else "fcfs",
    )
    params = PolicyParams(prefill_priority=args.prefill_priority)
    if args.near_tie is not None:
        params.near_tie_tokens = args.near_tie
    if args.cpu_discount is not None:
        params.cpu_transfer_discount = args.cpu_discount
    for item in args.param:
        pname, _, val = item.partition("=")
        if not hasattr(params, pname):
            raise SystemExit(f"PolicyParams has no field {pname!r}")
        setattr(params, pname, type(getattr(params, pname))(float(val)))
    if args.admission_tokens < 1:
        raise SystemExit("--admission-tokens: must be >= 1")
    if args.replicas < 1:
        raise SystemExit("--replicas: must be >= 1")
    admission = AdmissionConfig(
        queued_prefill_tokens_threshold=args.admission_tokens, order=args.admission_order
    )
    rs = RouterSpec(
        poll_s=args.poll_s,
        speculative_ttl_s=args.spec_ttl,
        params=params,
        admission=admission,
        buffered=args.buffered,
        replicas=args.replicas,
    )
    src = TokenSource()
    unit = math.gcd(16, fs.block_size)
    keys = KeyCache(unit)
    probe = FastFleet(1, fs.engine(events=False))
    accepted = [r for r in reqs if not rejects(probe, r)]
    if not accepted:
        shortest = min(reqs, key=lambda r: r.n_tokens + r.max_tokens)
        raise SystemExit(
            "every request is refused by the workers (the shortest: a prompt of "
            f"{shortest.n_tokens} tokens and {shortest.max_tokens} to generate; max_model_len "
            f"{fs.max_model_len}, KV cache {fs.gpu_blocks * fs.block_size} tokens): nothing "
            "to replay (--max-model-len, --gpu-blocks)"
        )
    engine_cfg = probe.config
    prompts = [(r.n_tokens, keys.get(r, src.tokens(r))[0]) for r in accepted]
    resuming = frozenset(
        r.rid for r, yes in zip(accepted, resumes_earlier(prompts, unit=unit), strict=True) if yes
    )
    bounds = workload_bounds(
        prompts,
        unit=unit,
        block_size=fs.block_size,
        prefill_tokens_per_s=engine_cfg.prefill_tokens_per_s,
        max_num_batched_tokens=engine_cfg.max_num_batched_tokens,
        step_overhead_s=engine_cfg.step_overhead_s,
        percentile=pct,
    )
    if args.policies is None:
        args.policies = ",".join(QUICK_POLICIES if args.quick else POLICIES + peers.NAMES)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        if p not in POLICIES and p not in peers.NAMES:
            raise SystemExit(f"unknown policy {p!r}")
    t_start = time.perf_counter()
    base_rate = len(reqs) / max(reqs[-1].arrival_s - reqs[0].arrival_s, 1e-9)
    if args.speed is not None:
        cap = {
            "method": "fixed --speed",
            "trace_rate_rps": round(base_rate, 4),
            "round_robin_capacity_rps": None,
        }
        speeds = {str(args.load): args.speed}
    else:
        PROGRESS.phase(f"measuring round-robin capacity on {len(reqs)} requests...")
        mean_prompt = statistics.fmean(r.n_tokens for r in accepted)
        cap = measure_capacity(reqs, fs, rs, src, keys, mean_prompt)
        PROGRESS.phase(f"  {cap}")
        loads = [float(x) for x in args.loads.split(",")] if args.loads else [args.load]
        speeds = {str(ld): ld * cap["round_robin_capacity_rps"] / base_rate for ld in loads}
    by_load: dict[str, dict[str, dict[str, float]]] = {}
    for ld, speed in speeds.items():
        PROGRESS.phase(f"load {ld}: speed-up {speed:.3f}x, offered {base_rate * speed:.3f} req/s")
        by_load[ld] = run_all(
            reqs, speed, fs, rs, src, keys, policies, args.seed, jobs=args.jobs, resuming=resuming
        )
    main_load = str(args.load) if str(args.load) in by_load else next(iter(by_load))
    result: dict = {
        "workload": args.workload if not args.trace else f"mooncake:{Path(trace).name}",
        "workers": fs.workers,
        "config": {
            "requests": len(reqs),
            "prompt_tokens_mean": round(statistics.fmean(r.n_tokens for r in reqs), 1),
            "trace_format": asdict(trace_format) if trace_format else None,
            "trace_spread_s": args.trace_spread_s,
            "load": float(main_load),
            # unrounded: ``--speed`` with this value replays the same arrival times (a peer
            # scraping every 50 ms decides differently on arrivals 1e-5 s apart)
            "speed_up": speeds[main_load],
            "offered_rps": round(base_rate * speeds[main_load], 4),
            "capacity": cap,
            "fleet": asdict(fs) | {"kv_tokens_per_worker": fs.gpu_blocks * fs.block_size},
            "router": {
                "poll_s": rs.poll_s,
                "speculative_ttl_s": rs.speculative_ttl_s,
                "params": msgspec.structs.asdict(rs.params),
                "admission": msgspec.structs.asdict(rs.admission),
                "buffered": rs.buffered,
                "replicas": rs.replicas,
            },
            "quick": args.quick,
            "seed": args.seed,
        },
        "policies": by_load[main_load],
    }
    if len(by_load) > 1:
        result["by_load"] = by_load
    result["sweep"] = peer_report.sweep(by_load)
    result["goodput"] = peer_report.goodput(result["sweep"], args.slo_p90_s)
    result["rejected"] = {n: s["rejected"] for n, s in result["policies"].items()}
    result["config"]["slo_p90_s"] = args.slo_p90_s
    conversation = Path(trace).name == Path(DEFAULT_TRACE).name and args.workload == "mooncake"
    result["bounds"] = bounds
    result["targets"] = peer_report.targets(
        by_load, result["goodput"], peers.NAMES, conversation, bounds
    )
    if args.sweep_knobs:
        only = None if args.sweep_knobs == "all" else args.sweep_knobs.split(",")
        result["knob_sweep"] = sweep_knobs(
            reqs, speeds[main_load], fs, rs, src, keys, args.seed, only
        )
    result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    name = result["workload"].replace(":", "_").replace(".jsonl", "")
    out = Path(args.out) if args.out else OUT_DIR / f"routing_{name}.png"
    if args.seeds is not None:  # one chart per seed
        out = out.with_name(f"{out.stem}_seed{args.seed}{out.suffix}")
    if os.environ.get("ROUTING_BENCH_NO_CHART") != "1":
        chart(result, out)
        result["chart"] = str(out)
        p90 = out.with_name(out.stem + "_p90_by_load.png")
        peer_report.chart_p90(result["sweep"], args.slo_p90_s, p90, f"p90 TTFT: {name}")
        result["chart_p90"] = str(p90)
    if emit:
        print(json.dumps(result, separators=(",", ":")))
    return result


if __name__ == "__main__":
    main()
