"""How popular a prompt prefix is: the share of recent requests that began with it.

The kvrouter policy prices recomputing a prefix away from its holders by what the recompute
costs the fleet (``KvRouterPolicy.recompute_weight``). That is the whole story for a prefix one
session uses. A prefix that many sessions start with (a system prompt, an agent's preamble) is
different: all of its requests can only hit on its holders, so when it carries more than its
holders' share of the traffic, they queue while the rest of the fleet idles, and a copy on one
more engine is capacity every later request of that prefix uses. :meth:`PrefixPopularity.share`
is the measurement that pricing needs; the policy turns it into a credit
(``KvRouterPolicy.new_holder_credit``).

A prefix is named by one of its keys (the index's chained block keys, so a key names the whole
prefix up to it). Only every ``SAMPLE_STRIDE``-th key of a prompt is counted, so a prefix is
measured at the deepest sampled key it contains: ``SAMPLE_STRIDE`` keys of resolution, and a
prompt of ``n`` keys costs ``n / SAMPLE_STRIDE`` counter updates. Counts decay by ``e`` every
``window`` requests, like the policy's other averages over its decisions. At most
``max_prefixes`` keys are tracked, least recently seen forgotten first: a forgotten prefix
restarts from 0, which only delays its credit.

Shares are of a *pool*'s requests (``PromptKeys.pool``: the engines a request may go to, one
model's workers): a system prompt every request of a model uses is that model's whole traffic,
however much traffic other models bring. Keys need no pool of their own, since a prompt's keys
are rooted in its model's namespace and only ever counted in its pool; each pool keeps its own
request total (at most ``MAX_POOLS``, least recently seen forgotten first).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from router.speculative import SAMPLE_STRIDE

__all__ = ["MAX_POOLS", "MAX_PREFIXES", "PrefixPopularity", "PromptKeys"]

RESCALE_ABOVE = 1e150
"""Stored sums are rebased when the scale passes this (every ~345 windows of requests)."""

MAX_PREFIXES = 65536
"""Keys tracked (about 100 bytes each): far more than the distinct prefixes of a window of
requests that more than one request shares."""

MAX_POOLS = 256
"""Pools whose request totals are kept: one per model a router serves."""


@dataclass(frozen=True, slots=True)
class PromptKeys:
    """A prompt as the popularity count sees it."""

    keys: Sequence[int]
    """Its block keys, chained as the index chains them."""
    key_tokens: int
    """Tokens each key covers."""
    pool: str = ""
    """The engines the request may go to, by name (the serving workers' model namespace)."""


class PrefixPopularity:
    """Decayed counts of the requests whose prompt contained each sampled key."""

    def __init__(
        self, window: int, max_prefixes: int = MAX_PREFIXES, max_pools: int = MAX_POOLS
    ) -> None:
        if window < 1 or max_prefixes < 1 or max_pools < 1:
            raise ValueError("window, max_prefixes and max_pools must be >= 1")
        self._step = math.exp(1.0 / window)
        self._max = max_prefixes
        self._scale = 1.0
        """What a request counted now adds: ``e^((r - r0) / window)`` for the ``r``-th request
        counted (any pool); dividing a stored sum by it gives the decayed count, so counting
        needs no exponential per key."""
        self._seen: dict[int, float] = {}
        """Per sampled key, its requests' scales summed; least recently seen first."""
        self._pools: dict[str, float] = {}
        """Per pool, its requests' scales summed (the decayed request count); likewise."""
        self._max_pools = max_pools

    def __len__(self) -> int:
        return len(self._seen)

    def share(self, keys: Sequence[int], n_keys: int, pool: str = "") -> tuple[int, float]:
        """For the prefix of the first ``n_keys`` keys: how many keys long the sampled prefix
        inside it is (0 when it holds no sampled key) and the share of the pool's recent
        requests whose prompt began with that prefix, in [0, 1].

        The share is one standard error below the measured one (a count ``k`` is taken as
        ``k - sqrt(k)``, its Poisson lower bound): the first request of a prefix, or two
        siblings sent together, are no evidence that a share of the traffic uses it."""
        at = min(n_keys, len(keys)) // SAMPLE_STRIDE * SAMPLE_STRIDE
        total = self._pools.get(pool, 0.0) / self._scale
        if at == 0 or total <= 0.0:
            return 0, 0.0
        seen = self._seen.get(keys[at - 1])
        if seen is None:
            return at, 0.0
        count = seen / self._scale
        return at, min(max(count - math.sqrt(count), 0.0) / total, 1.0)

    def count(self, keys: Sequence[int], pool: str = "") -> int:
        """Count one request of ``pool`` whose prompt has these keys. Returns how many keys long
        the prefix of ``keys`` is that the prompts counted before it already began with, to
        ``SAMPLE_STRIDE`` keys: what one cache holding every recent prompt would hit."""
        self._scale *= self._step
        if self._scale > RESCALE_ABOVE:  # keep the stored sums finite: same counts, new origin
            self._seen = {k: v / self._scale for k, v in self._seen.items()}
            self._pools = {k: v / self._scale for k, v in self._pools.items()}
            self._scale = 1.0
        add = self._scale
        pools = self._pools
        pools[pool] = pools.pop(pool, 0.0) + add
        while len(pools) > self._max_pools:
            del pools[next(iter(pools))]
        seen = self._seen
        depth = 0
        known = True  # every sampled key so far was counted before (stored sums are > 0)
        for k in keys[SAMPLE_STRIDE - 1 :: SAMPLE_STRIDE]:
            before = seen.pop(k, 0.0)
            seen[k] = before + add
            if known and before > 0.0:
                depth += SAMPLE_STRIDE
            else:
                known = False
        while len(seen) > self._max:
            del seen[next(iter(seen))]
        return depth
