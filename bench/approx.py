"""An approximate prefix-aware router: routing history only, no KV events.

Modelled on SGLang's ``cache_aware`` policy (sgl-model-gateway ``policies/cache_aware.rs``) and
llm-d's ``approx-prefix-cache-producer``, the two published designs:

* per engine, the set of prefixes this router sent there, as chained content keys (one per
  ``unit`` tokens: a key names a whole prefix, so a radix tree and a key set answer the same
  longest-match question), each stamped with the time it was last routed;
* entries expire after ``ttl_s`` and each engine's set is LRU-bounded to ``capacity_keys``
  (a leaf is always older than its prefix, so LRU evicts leaves first, as the tree would);
* decision: if in-flight request counts are imbalanced (``max - min > balance_abs`` and
  ``max > balance_rel * min``) pick the least loaded; else if the longest remembered match
  covers more than ``cache_threshold`` of the prompt pick that engine; else the least loaded.
  The routed prompt is then recorded for the chosen engine.

It never learns of evictions, so it keeps sending prefixes to engines that dropped them, and it
measures load in requests, not in prefill tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from router.policy import Candidate, Decision, Engine, LeastLoadedPolicy, Policy

__all__ = ["ApproxPrefixPolicy"]


class ApproxPrefixPolicy(Policy):
    name = "approx_prefix"

    def __init__(
        self,
        unit: int,
        capacity_keys: int,
        ttl_s: float = 300.0,
        cache_threshold: float = 0.5,
        balance_abs: int = 64,
        balance_rel: float = 1.5,
        seed: int | None = None,
    ) -> None:
        self.unit = unit
        self.capacity_keys = capacity_keys
        self.ttl_s = ttl_s
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self._fallback = LeastLoadedPolicy(seed)
        self._trees: dict[Engine, OrderedDict[int, float]] = {}
        self.keys: Sequence[int] = ()
        """Content keys of the prompt being routed (set by the caller before ``choose``)."""

    def _match(self, tree: OrderedDict[int, float], keys: Sequence[int], now: float) -> int:
        if not keys:
            return 0
        horizon = now - self.ttl_s

        def live(i: int) -> bool:
            t = tree.get(keys[i])
            return t is not None and t > horizon

        if not live(0):
            return 0
        lo, hi = 0, len(keys) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if live(mid):
                lo = mid
            else:
                hi = mid - 1
        return (lo + 1) * self.unit

    def choose(self, candidates: Sequence[Candidate], prompt_tokens: int, now: float) -> Decision:
        keys = self.keys
        loads = [c.load.inflight_requests for c in candidates]
        imbalanced = max(loads) - min(loads) > self.balance_abs and max(
            loads
        ) > self.balance_rel * min(loads)
        best_i, best = -1, 0
        if not imbalanced:
            for i, c in enumerate(candidates):
                tree = self._trees.get(c.engine)
                if tree is not None:
                    m = self._match(tree, keys, now)
                    if m > best:
                        best_i, best = i, m
        if best_i >= 0 and best > self.cache_threshold * prompt_tokens:
            chosen = candidates[best_i]
            ranked = [chosen.engine] + [c.engine for c in candidates if c is not chosen]
            d = Decision(chosen.engine, ranked, [], f"remembered prefix of {best} tokens", best)
        else:
            d = self._fallback.choose(candidates, prompt_tokens, now)
            d.reason = "imbalanced: least loaded" if imbalanced else "no prefix: least loaded"
            d.predicted_hit_tokens = 0
        self._record(d.engine, keys, now)
        return d

    def _record(self, engine: Engine, keys: Sequence[int], now: float) -> None:
        tree = self._trees.setdefault(engine, OrderedDict())
        for k in reversed(keys):  # leaf first: a prefix is never older than its extensions,
            tree[k] = now  # so LRU eviction from the front drops leaves first
            tree.move_to_end(k)
        horizon = now - self.ttl_s
        while tree:
            k, t = next(iter(tree.items()))
            if len(tree) > self.capacity_keys or t <= horizon:
                tree.popitem(last=False)
            else:
                break
