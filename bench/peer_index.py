"""What each peer router knows of the fleet's caches, built the way that product builds it.

The routing benchmark feeds every peer the same event batches the workers publish (or none, for
products that learn from their own routing history). What differs is what each product keeps:

* :class:`GroupFilteredIndex`: an exact index (``indexer.index.PrefixIndex``) fed only the
  events of the KV-cache groups the product reads. Products that ignore sliding-window groups
  see a hybrid model's full-attention run as the hit even when the window's blocks are gone.
* :class:`BlockHashSet`: vllm-router's ``KVBlockIndex``: per worker, a set of vLLM block hashes,
  every ``BlockStored`` adds and every ``BlockRemoved`` deletes regardless of medium or group
  (a CPU-tier removal, or a sliding-window group's removal, deletes the hash the GPU
  full-attention group still holds); speculative entries live in the same map with a TTL.
* :class:`HistoryTree`: SGLang's approximate radix tree: per worker, the prompts the router sent
  there, LRU-trimmed to a size budget by a periodic eviction pass; never told of evictions.
* :class:`PrefixHashTable`: AIBrix's global LRU table of prefix-block hashes, each naming the
  pods it was routed to, with an idle expiry.
* :class:`SpeculativePrefixes`: short-lived "just routed there" entries (llm-d).

Approximate structures key prompts by the benchmark's content keys (a key names a whole prefix,
so a set of keys answers the same longest-match question a radix tree does).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence

from indexer.index import PrefixIndex
from indexer.types import FULL, group_kind
from indexer.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event

__all__ = [
    "BlockHashSet",
    "GroupFilteredIndex",
    "HistoryTree",
    "PrefixHashTable",
    "SpeculativePrefixes",
    "first_group_only",
    "full_attention_only",
    "longest_live_prefix",
]

GroupFilter = Callable[[int, str | None], bool]
"""``(group_idx, kv_cache_spec_kind or None) -> keep the group's events``."""


def first_group_only(group: int, kind: str | None) -> bool:
    return group == 0


def full_attention_only(group: int, kind: str | None) -> bool:
    if kind is None:  # events without the spec kind: vLLM lists full attention first
        return group == 0
    return group_kind(kind) == FULL


def longest_live_prefix(live: Callable[[int], bool], n: int) -> int:
    """Largest ``i <= n`` with ``live(j)`` for every ``j < i``; ``live`` must be prefix-closed."""
    if n <= 0 or not live(0):
        return 0
    lo, hi = 0, n - 1  # invariant: live(lo)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if live(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo + 1


class GroupFilteredIndex:
    """An exact index holding only the groups ``keep`` accepts, both media (GPU and CPU)."""

    def __init__(
        self, workers: int, unit: int, cpu_chunk_tokens: int, model: str, keep: GroupFilter
    ) -> None:
        self.index = PrefixIndex(unit=unit, cpu_chunk_tokens=cpu_chunk_tokens)
        self.engines = [(f"peer://w{i}", 0) for i in range(workers)]
        for e in self.engines:
            self.index.add_engine(e, model)
        self.keep = keep
        self._kinds: list[dict[int, str | None]] = [{} for _ in range(workers)]

    def apply(self, worker: int, events: Sequence[Event]) -> None:
        kinds = self._kinds[worker]
        keep = self.keep
        kept: list[Event] = []
        for ev in events:
            if type(ev) is BlockStored:
                g = ev.group_idx or 0
                if ev.kv_cache_spec_kind is not None:
                    kinds[g] = ev.kv_cache_spec_kind
                if keep(g, kinds.get(g)):
                    kept.append(ev)
            elif type(ev) is BlockRemoved:
                g = ev.group_idx or 0
                if keep(g, kinds.get(g)):
                    kept.append(ev)
            else:
                kept.append(ev)
        if kept:
            self.index.apply(self.engines[worker], kept)

    def match(self, keys: Sequence[int], n_tokens: int) -> list[tuple[int, int]]:
        """Per worker: (GPU hit tokens, further CPU-loadable tokens) by the kept groups' rules."""
        found = self.index.match_keys(keys, n_tokens, self.engines)
        out = []
        for e in self.engines:
            m = found.get(e)
            out.append((m.gpu_tokens, m.cpu_tokens) if m else (0, 0))
        return out


class BlockHashSet:
    """vllm-router's ``KVBlockIndex`` (per worker: block hash -> expiry; ``inf`` when real)."""

    REAL = math.inf

    def __init__(self, workers: int) -> None:
        self.held: list[dict[int, float]] = [{} for _ in range(workers)]
        self._spec_since_purge = 0

    def apply(self, worker: int, events: Sequence[Event]) -> None:
        held = self.held[worker]
        real = self.REAL
        for ev in events:
            kind = type(ev)
            if kind is BlockStored:
                for h in ev.block_hashes:
                    held[h] = real
            elif kind is BlockRemoved:
                for h in ev.block_hashes:
                    held.pop(h, None)
            elif kind is AllBlocksCleared:
                held.clear()

    def match(self, hashes: Sequence[int], now: float) -> list[int]:
        """Per worker, the contiguous run of ``hashes`` it holds from block 0 (``PrefixScorer``:
        a walk, not a bisection: with removals of any group or medium the set is not
        prefix-closed)."""
        out = []
        for held in self.held:
            get = held.get
            i = 0
            for h in hashes:
                if get(h, -1.0) > now:
                    i += 1
                else:
                    break
            out.append(i)
        return out

    def speculative_insert(self, worker: int, hashes: Sequence[int], until: float) -> None:
        held = self.held[worker]
        real = self.REAL
        for h in hashes:
            if held.get(h) != real:
                held[h] = until
        self._spec_since_purge += len(hashes)
        if self._spec_since_purge > 200_000:  # expired entries are invisible; drop them
            self._spec_since_purge = 0
            for d in self.held:
                stale = [h for h, t in d.items() if t != real and t < until - 60.0]
                for h in stale:
                    del d[h]


class HistoryTree:
    """Per worker, the prompts routed there (content keys -> last use), LRU by a size budget.

    Keys are inserted leaf first, so a prefix is never older than its extensions and LRU
    eviction from the front drops leaves first, as the radix tree's leaf eviction does.
    """

    def __init__(
        self, workers: int, tokens_per_key: int, max_tokens: int, eviction_interval_s: float
    ) -> None:
        self.trees: list[OrderedDict[int, float]] = [OrderedDict() for _ in range(workers)]
        self.tokens_per_key = tokens_per_key
        self.max_keys = max(1, max_tokens // tokens_per_key)
        self.eviction_interval_s = eviction_interval_s
        self._next_eviction = eviction_interval_s

    def match(self, keys: Sequence[int]) -> list[int]:
        """Per worker, matched keys of the prompt (prefix run)."""
        return [longest_live_prefix(lambda i, t=t: keys[i] in t, len(keys)) for t in self.trees]

    def last_use(self, worker: int, key: int) -> float:
        return self.trees[worker].get(key, -math.inf)

    def insert(self, worker: int, keys: Sequence[int], now: float) -> None:
        tree = self.trees[worker]
        for k in reversed(keys):
            tree[k] = now
            tree.move_to_end(k)
        if now >= self._next_eviction:
            self._next_eviction = now + self.eviction_interval_s
            for t in self.trees:
                while len(t) > self.max_keys:
                    t.popitem(last=False)


class PrefixHashTable:
    """AIBrix's ``PrefixHashTable``: one LRU store of prefix-block hashes for the whole fleet,
    each entry naming the pods it was routed to; entries idle longer than ``idle_s`` expire.
    ``Get`` (matching) and ``Put`` (recording) both refresh an entry."""

    def __init__(self, capacity: int, idle_s: float) -> None:
        self.capacity = capacity
        self.idle_s = idle_s
        self.store: OrderedDict[int, tuple[float, dict[int, float]]] = OrderedDict()

    def _expire(self, now: float) -> None:
        store = self.store
        horizon = now - self.idle_s
        while store:
            _, (t, _) = next(iter(store.items()))
            if t >= horizon:
                break
            store.popitem(last=False)

    def match(self, keys: Sequence[int], ready: set[int], now: float) -> dict[int, int]:
        """``seqSearchPrefix``: pod -> integer percent of the prompt's blocks matched, for pods
        still matching when their run ended; a pod drops out at its first missing block."""
        self._expire(now)
        store = self.store
        ready = set(ready)
        pct: dict[int, int] = {}
        n = len(keys)
        for i, k in enumerate(keys):
            entry = store.get(k)
            if entry is None:
                break
            pods = entry[1]
            store[k] = (now, pods)
            store.move_to_end(k)
            hit = ready & pods.keys()
            if not hit:
                break
            p = (i + 1) * 100 // n
            for w in hit:
                pct[w] = p
            ready = hit
        return pct

    def insert(self, keys: Sequence[int], pod: int, now: float) -> None:
        store = self.store
        for k in keys:
            entry = store.get(k)
            pods = entry[1] if entry is not None else {}
            pods[pod] = now
            store[k] = (now, pods)
            store.move_to_end(k)
        while len(store) > self.capacity:
            store.popitem(last=False)


class SpeculativePrefixes:
    """Per worker, keys of prompts just routed there, each alive until its expiry."""

    def __init__(self, workers: int, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.entries: list[dict[int, float]] = [{} for _ in range(workers)]
        self._next_purge = 0.0

    def hit(self, worker: int, keys: Sequence[int], now: float) -> int:
        d = self.entries[worker]
        if not d:
            return 0
        return longest_live_prefix(lambda i: d.get(keys[i], -1.0) > now, len(keys))

    def record(self, worker: int, keys: Sequence[int], now: float) -> None:
        if self.ttl_s <= 0:
            return
        until = now + self.ttl_s
        d = self.entries[worker]
        for k in keys:
            d[k] = until
        if now >= self._next_purge:
            self._next_purge = now + 10 * self.ttl_s
            for e in self.entries:
                for k in [k for k, t in e.items() if t <= now]:
                    del e[k]
