"""Peer routers, modelled as each product runs them with its shipped defaults.

Each peer is a :class:`PeerRouter`: it is told what that product is told and nothing else --
the workers' KV event batches (only if the product consumes them, and kept the way it keeps
them: bench/peer_index.py), its own load signal with the product's own update timing, and the
request's tokens. ``bench/routing_bench.py`` drives it on the same simulated fleet as kvrouter:

    peer = make(name, PeerEnv(fleet, ...))
    peer.advance(t)                    # before the fleet reaches t (metric scrapes run here)
    peer.on_events(worker, events)     # every decoded batch, if ``uses_events(name)``
    worker = peer.route(rid, tokens, keys, t)
    peer.finished(rid)                 # the request's last token

Block size ``B``, ``n = len(tokens) // B`` full blocks. Shared departures from the products:
hashing, tokenization and network time are not simulated (every router sees events and
completions at the instant the fleet publishes them), and approximate (routing-history)
structures match tokens, not characters.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from bench.peer_index import (
    BlockHashSet,
    GroupFilteredIndex,
    HistoryTree,
    PrefixHashTable,
    SpeculativePrefixes,
    first_group_only,
    full_attention_only,
    longest_live_prefix,
)
from indexer.wire import Event
from router.policy import Decision
from simulator.fleet import FastFleet
from simulator.hashing import RequestHasher

__all__ = [
    "NAMES",
    "AIBrix",
    "Dynamo",
    "LlmD",
    "PeerEnv",
    "PeerRouter",
    "SGLang",
    "VllmRouterKvAware",
    "decision",
    "make",
    "uses_events",
]


@dataclass
class PeerEnv:
    fleet: FastFleet
    block_size: int
    unit: int
    """Tokens per content key (the benchmark's ``KeyCache``)."""
    cpu_chunk_tokens: int
    model: str
    seed: int = 0

    @property
    def workers(self) -> int:
        return len(self.fleet.engines) // self.fleet.dp_size


class PeerRouter:
    name = "peer"
    uses_events = False

    def __init__(self, env: PeerEnv) -> None:
        self.env = env
        self.n = env.workers
        self.rng = random.Random(env.seed)
        self.where: dict[str, int] = {}
        """In-flight request id -> worker."""
        self.inflight = [0] * self.n
        """Router-side in-flight requests per worker (+1 at dispatch, -1 at the last token)."""

    def advance(self, t: float) -> None:
        """Called before the fleet runs to ``t``; periodic work that must see the fleet at its
        own instants (metric scrapes) runs the fleet there itself."""

    def on_events(self, worker: int, events: Sequence[Event]) -> None:
        pass

    def route(self, rid: str, tokens: Sequence[int], keys: Sequence[int], now: float) -> int:
        w = self.choose(rid, tokens, keys, now)
        self.where[rid] = w
        self.inflight[w] += 1
        return w

    def choose(self, rid: str, tokens: Sequence[int], keys: Sequence[int], now: float) -> int:
        raise NotImplementedError

    def finished(self, rid: str) -> None:
        w = self.where.pop(rid, None)
        if w is not None:
            self.inflight[w] -= 1

    def block_keys(self, keys: Sequence[int], n_tokens: int) -> Sequence[int]:
        step = self.env.block_size // self.env.unit
        return keys[step - 1 : (n_tokens // self.env.block_size) * step : step]

    def first_least_loaded(self, loads: Sequence[int]) -> int:
        """Rust ``min_by_key``: the first index among the minima."""
        return min(range(len(loads)), key=loads.__getitem__)


class Dynamo(PeerRouter):
    """NVIDIA Dynamo KV router, default selector (``lib/kv-router`` 2026: ``WorkerSelectionInput::
    row`` + ``DefaultWorkerScorer``, the "overlap credit" cost), frontend defaults.

    ``cost_w = prefill_load_scale * max(0, (P_w + L) / B - (credit * h_w + 0.75 * host_w))
    + D_w + (n - a_w)``, arg-min, exact ties uniformly at random (temperature 0). ``h_w``:
    device overlap blocks, ``host_w``: CPU-tier blocks beyond it (host_cache_hit_weight 0.75),
    from an index of KV events that keeps group 0 only (Dynamo's hybrid fallback: a sliding
    window's evictions are invisible to it). Router-local ledger (``ActiveSequences``): ``P_w``
    = uncached prompt tokens of its requests there that have no first token yet (added at
    dispatch, removed at first token), ``D_w`` = distinct prompt blocks of its in-flight
    requests there (released at finish), ``a_w`` = how much of this prompt those already hold.
    Defaults: overlap_score_credit 1, decay 0, prefill_load_scale 1,
    decode_active_request_weight 0, no busy thresholds, no router queue, no predicted-TTL side
    indexer (off by default), engine queue not used.
    Departure: output blocks are not tracked (``router_track_output_blocks`` is off by default).
    """

    name = "dynamo"
    uses_events = True
    overlap_score_credit = 1.0
    prefill_load_scale = 1.0
    host_cache_hit_weight = 0.75
    decode_active_request_weight = 0.0

    def __init__(self, env: PeerEnv) -> None:
        super().__init__(env)
        self.view = GroupFilteredIndex(
            self.n, env.unit, env.cpu_chunk_tokens, env.model, first_group_only
        )
        self.active: list[dict[int, int]] = [{} for _ in range(self.n)]
        """Per worker: prompt block key -> number of in-flight requests holding it."""
        self.prefill = [0] * self.n
        self.blocks_of: dict[str, Sequence[int]] = {}
        self.prefilling: dict[str, tuple[int, int]] = {}
        """rid -> (worker, prefill tokens charged), until its first token."""

    def on_events(self, worker: int, events: Sequence[Event]) -> None:
        self.view.apply(worker, events)

    def _release_first_tokens(self) -> None:
        engines = self.env.fleet.engines
        done = []
        for rid, (w, tok) in self.prefilling.items():
            r = engines[w].requests.get(rid)
            if r is None or r.first_token_s is not None:
                done.append(rid)
                self.prefill[w] -= tok
        for rid in done:
            del self.prefilling[rid]

    def choose(self, rid: str, tokens: Sequence[int], keys: Sequence[int], now: float) -> int:
        self._release_first_tokens()
        b = self.env.block_size
        n_tok = len(tokens)
        bkeys = self.block_keys(keys, n_tok)
        n = len(bkeys)
        hits = self.view.match(keys, n_tok)
        best_w, best_cost, ties = -1, 0.0, 0
        for w in range(self.n):
            gpu, cpu = hits[w]
            credit = self.overlap_score_credit * (gpu // b) + self.host_cache_hit_weight * (
                cpu // b
            )
            prefill = max(0.0, (self.prefill[w] + n_tok) / b - credit)
            act = self.active[w]
            held = longest_live_prefix(lambda i, a=act: bkeys[i] in a, n)
            cost = (
                self.prefill_load_scale * prefill
                + len(act)
                + (n - held)
                + self.decode_active_request_weight * self.inflight[w]
            )
            if best_w < 0 or cost < best_cost:
                best_w, best_cost, ties = w, cost, 1
            elif cost == best_cost:
                ties += 1
                if self.rng.randrange(ties) == 0:  # reservoir sampling: uniform among ties
                    best_w = w
        w = best_w
        act = self.active[w]
        for k in bkeys:
            act[k] = act.get(k, 0) + 1
        self.blocks_of[rid] = bkeys
        charged = n_tok - (hits[w][0] // b) * b
        self.prefill[w] += charged
        self.prefilling[rid] = (w, charged)
        return w

    def finished(self, rid: str) -> None:
        w = self.where.get(rid)
        super().finished(rid)
        if w is None:
            return
        p = self.prefilling.pop(rid, None)
        if p is not None:
            self.prefill[w] -= p[1]
        act = self.active[w]
        for k in self.blocks_of.pop(rid, ()):
            c = act[k] - 1
            if c:
                act[k] = c
            else:
                del act[k]


class LlmD(PeerRouter):
    """llm-d inference scheduler (EPP, llm-d-router v0.8 precise-prefix-cache-aware guide):
    ``total_w = 2 * min(1, m_w / n) + 1 * (1 - u_w) + 1 * minmax(q)_w``, max-score picker
    (shuffle + stable sort: uniform random among equal totals).

    ``m_w``: llm-d-kv-cache ``LongestPrefixScorer`` on an index of KV events that keeps only
    full-attention groups (llm-d ignores the others), GPU blocks weigh 1.0 and CPU blocks 0.8,
    normalised by the request's blocks (absolute normalisation, May 2026 on); speculative
    indexing on as the guide ships it: the chosen pod holds all the request's blocks for 2 s.
    ``u_w`` = ``vllm:kv_cache_usage_perc`` and ``q_w`` = ``vllm:num_requests_waiting`` from a
    metrics scrape every 50 ms (``--refresh-metrics-interval``), never updated at dispatch;
    queue scorer: ``(q_max - q_w) / (q_max - q_min)``, 1 for all when equal.
    Departure: the CPU run is the extension vLLM's offloading connector would load (whole
    chunks after the GPU run), not every CPU-held block after it.
    """

    name = "llm_d"
    uses_events = True
    prefix_weight = 2.0
    kv_weight = 1.0
    queue_weight = 1.0
    cpu_tier_weight = 0.8
    scrape_s = 0.05
    speculative_ttl_s = 2.0

    def __init__(self, env: PeerEnv) -> None:
        super().__init__(env)
        self.view = GroupFilteredIndex(
            self.n, env.unit, env.cpu_chunk_tokens, env.model, full_attention_only
        )
        self.spec = SpeculativePrefixes(self.n, self.speculative_ttl_s)
        self.waiting = [0] * self.n
        self.kv_usage = [0.0] * self.n
        self._next_scrape = 0.0

    def advance(self, t: float) -> None:
        fleet = self.env.fleet
        while self._next_scrape <= t:
            fleet.run_until(self._next_scrape)
            for w in range(self.n):
                ld = fleet.load(w)
                self.waiting[w] = ld.waiting
                self.kv_usage[w] = ld.kv_usage
            self._next_scrape += self.scrape_s

    def on_events(self, worker: int, events: Sequence[Event]) -> None:
        self.view.apply(worker, events)

    def choose(self, rid: str, tokens: Sequence[int], keys: Sequence[int], now: float) -> int:
        b = self.env.block_size
        n_tok = len(tokens)
        bkeys = self.block_keys(keys, n_tok)
        n = len(bkeys)
        hits = self.view.match(keys, n_tok)
        q_lo, q_hi = min(self.waiting), max(self.waiting)
        totals = []
        for w in range(self.n):
            gpu, cpu = hits[w]
            m = gpu // b + self.cpu_tier_weight * (cpu // b)
            m = max(m, self.spec.hit(w, bkeys, now))
            prefix = min(1.0, int(m) / n) if n else 0.0
            queue = 1.0 if q_hi == q_lo else (q_hi - self.waiting[w]) / (q_hi - q_lo)
            kv = min(max(1.0 - self.kv_usage[w], 0.0), 1.0)
            totals.append(
                self.prefix_weight * prefix + self.kv_weight * kv + self.queue_weight * queue
            )
        top = max(totals)
        w = self.rng.choice([i for i, s in enumerate(totals) if s == top])
        self.spec.record(w, bkeys, now)
        return w


class SGLang(PeerRouter):
    """SGLang router ``cache_aware`` (sgl-model-gateway, classic rule with PR #14650's
    least-loaded miss), CLI defaults: cache_threshold 0.3, balance_abs_threshold 64,
    balance_rel_threshold 1.5, eviction every 120 s to max_tree_size 2**26 characters.

    Loads are the router's in-flight counts. If ``max - min > 64`` and ``max > 1.5 * min``: the
    least loaded; else the longest match in the approximate tree, if it covers more than 30 %
    of the prompt, goes to the worker holding it (among workers sharing the deepest match, the
    one that last used it: the node's cached tenant), else the least loaded; arg-min ties go
    to the first worker. The prompt is then inserted for the chosen worker: in-flight prompts
    count at once and the tree never learns of evictions. The same rule with the same launcher
    defaults is vllm-router's ``cache_aware``.
    Departures: the tree matches tokens in 64-token steps, not characters; the size budget is
    2**26 characters at 4 characters per token.
    """

    name = "sglang"
    cache_threshold = 0.3
    balance_abs = 64
    balance_rel = 1.5
    eviction_interval_s = 120.0
    max_tree_chars = 2**26
    chars_per_token = 4
    keys_per_step = 4  # content keys per tree step (64 tokens with 16-token keys)

    def __init__(self, env: PeerEnv) -> None:
        super().__init__(env)
        step_tokens = env.unit * self.keys_per_step
        self.tree = HistoryTree(
            self.n,
            step_tokens,
            self.max_tree_chars // self.chars_per_token,
            self.eviction_interval_s,
        )
        self.step_tokens = step_tokens

    def choose(self, rid: str, tokens: Sequence[int], keys: Sequence[int], now: float) -> int:
        skeys = keys[self.keys_per_step - 1 :: self.keys_per_step]
        loads = self.inflight
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            w = self.first_least_loaded(loads)
        else:
            matched = self.tree.match(skeys)
            best = max(matched)
            if best and best * self.step_tokens / max(len(tokens), 1) > self.cache_threshold:
                deepest = skeys[best - 1]
                w = max(
                    (i for i in range(self.n) if matched[i] == best),
                    key=lambda i: self.tree.last_use(i, deepest),
                )
            else:
                w = self.first_least_loaded(loads)
        self.tree.insert(w, skeys, now)
        return w


class VllmRouterKvAware(PeerRouter):
    """vllm-router ``kv_aware`` (vllm-project/router ``src/policies/kv_aware.rs`` and
    ``src/kv_index``), defaults block_size 16, speculative on, TTL 2 s.

    vLLM block hashes of the prompt (recomputed by the router) are looked up in a
    ``KVBlockIndex`` that adds every ``BlockStored`` hash and deletes every ``BlockRemoved``
    hash whatever its medium or group; the longest contiguous run from block 0 per worker
    scores it. The highest score wins (Rust ``max_by_key``: the last worker among equals);
    if no worker holds block 0, the fewest in-flight requests (first among equals). Load plays
    no other part. The uncached blocks are then inserted speculatively for the chosen worker.
    """

    name = "vllm_router_kv_aware"
    uses_events = True
    speculative_ttl_s = 2.0

    def __init__(self, env: PeerEnv) -> None:
        super().__init__(env)
        self.index = BlockHashSet(self.n)

    def on_events(self, worker: int, events: Sequence[Event]) -> None:
        self.index.apply(worker, events)

    def choose(self, rid: str, tokens: Sequence[int], keys: Sequence[int], now: float) -> int:
        hasher = RequestHasher(self.env.block_size)
        hasher.extend(tokens)
        hashes = hasher.event_hashes
        if not hashes:
            return self.first_least_loaded(self.inflight)
        scores = self.index.match(hashes, now)
        best_w = max(range(self.n), key=lambda i: (scores[i], i))
        best = scores[best_w]
        w = best_w if best else self.first_least_loaded(self.inflight)
        if best < len(hashes):
            self.index.speculative_insert(w, hashes[best:], now + self.speculative_ttl_s)
        return w


class AIBrix(PeerRouter):
    """AIBrix gateway ``prefix-cache`` policy (vllm-project/aibrix ``prefix_cache.go``,
    ``prefixcacheindexer/hash.go``), env defaults: imbalance 8 running requests, standard
    deviation factor 1, 4-character blocks, 200,000-block LRU table, 20-minute idle expiry,
    KV-event sync off.

    ``R_w``: the gateway's running-request counter. If ``max R - min R > 8`` prefix matching
    is restricted to the pods at ``min R``. Matched pods (at least one block) are shuffled,
    then ordered by match percent (desc) and ``R`` (asc); the first with
    ``R_w <= mean(R) + 1 * sample_std(R)`` wins; otherwise a uniformly random pod at ``min R``.
    All the prompt's block hashes are then recorded for the chosen pod: the table learns from
    routing only. Departure: blocks are the benchmark's 16-token keys; the table holds 200,000
    4-character blocks, about 200,000 tokens of prompt, so it holds 200,000 / 16 keys here.
    """

    name = "aibrix"
    imbalance_abs = 8
    std_factor = 1.0
    table_blocks = 200_000
    tokens_per_block = 1  # 4 characters
    idle_s = 20 * 60.0

    def __init__(self, env: PeerEnv) -> None:
        super().__init__(env)
        capacity = max(1, self.table_blocks * self.tokens_per_block // env.unit)
        self.table = PrefixHashTable(capacity, self.idle_s)

    def choose(self, rid: str, tokens: Sequence[int], keys: Sequence[int], now: float) -> int:
        r = self.inflight
        lo = min(r)
        ready = set(range(self.n))
        cands = {i for i in ready if r[i] == lo} if max(r) - lo > self.imbalance_abs else ready
        pct = self.table.match(keys, cands, now)
        target = -1
        if pct:
            mu = statistics.fmean(r)
            sd = statistics.stdev(r) if self.n > 1 else 0.0
            order = list(pct)
            self.rng.shuffle(order)
            order.sort(key=lambda i: (-pct[i], r[i]))
            target = next((i for i in order if r[i] <= mu + self.std_factor * sd), -1)
        if target < 0:
            target = self.rng.choice([i for i in ready if r[i] == lo])
        self.table.insert(keys, target, now)
        return target


_PEERS: dict[str, type[PeerRouter]] = {
    p.name: p for p in (Dynamo, LlmD, SGLang, VllmRouterKvAware, AIBrix)
}
NAMES: tuple[str, ...] = tuple(_PEERS)


def uses_events(name: str) -> bool:
    cls = _PEERS.get(name)
    return cls is not None and cls.uses_events


def make(name: str, env: PeerEnv) -> PeerRouter:
    return _PEERS[name](env)


def decision(engines: Sequence[object], worker: int, name: str) -> Decision:
    """The benchmark's record of a peer's choice (a router ``Decision`` with no costs)."""
    return Decision(engines[worker], [engines[worker]], [], name)
