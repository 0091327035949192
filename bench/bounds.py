"""What no placement can beat on a workload, computed from its requests alone.

A request's prefix can be cached on the engine that serves it only if some request before it
computed that prefix, and every engine admits requests in the order the router sent them
(vLLM's scheduler is first come, first served; the simulator's one exception, a request whose
CPU load has finished passing a head that cannot get its blocks, computes only what follows its
own hit). So, with an unbounded cache and every earlier request on the same engine:

* ``hit_rate_upper``: each request hits at most the longest prefix (whole blocks) it shares
  with any earlier request's prompt; the share of prompt tokens that is. No router, and no
  cache size, does better. ``pooled_ideal``'s hit rate is not such a bound: one engine with
  the fleet's KV queues less than eight do, and a request that waits behind another sharing
  its prefix hits what that one computed in the meantime.
* ``ttft_mean_lower_s`` / ``ttft_p90_lower_s``: each request's TTFT is at least the time to
  prefill the rest of its prompt alone on one worker, in steps of at most the token budget,
  each costing the step overhead plus its tokens at the prefill rate (no decode riding along,
  no loading, no queue). The p90 of per-request lower bounds bounds the p90 too (sorting
  keeps the order between two lists that dominate each other entry by entry).

Requests a worker refuses are left out by the caller, as they are of every policy's figures.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["RESUME_SHARE", "earlier_shared_prefix_units", "resumes_earlier", "workload_bounds"]

RESUME_SHARE = 0.5
"""A prompt resumes an earlier one when it shares at least this share of its tokens with it."""


def earlier_shared_prefix_units(keys: Sequence[Sequence[int]]) -> list[int]:
    """Per prompt (content keys, one per unit of tokens, chained so a key names its whole
    prefix), how many of its leading keys some earlier prompt in the list also has."""
    lengths = np.fromiter((len(k) for k in keys), dtype=np.int64, count=len(keys))
    if not lengths.sum():
        return [0] * len(keys)
    flat = np.concatenate([np.asarray(k, dtype=np.uint64) for k in keys if len(k)])
    owner = np.repeat(np.arange(len(keys)), lengths)
    # np.unique's first index of each key is its earliest prompt (the list is in order).
    _, first, inverse = np.unique(flat, return_index=True, return_inverse=True)
    seen = owner[first][inverse] < owner
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    unseen = np.flatnonzero(~seen)
    at = np.searchsorted(unseen, starts)
    first_unseen = np.where(at < len(unseen), unseen[np.minimum(at, len(unseen) - 1)], flat.size)
    return np.minimum(first_unseen - starts, lengths).tolist()


def resumes_earlier(
    prompts: Sequence[tuple[int, Sequence[int]]], *, unit: int, share: float = RESUME_SHARE
) -> list[bool]:
    """Per prompt (``(prompt tokens, content keys)``, in the order they are routed), whether
    some earlier prompt shares at least ``share`` of its tokens as a prefix: a conversation's
    next turn, an agent's next step. Where such a request is cheap is fixed by where the
    earlier one ran, so its queueing is what locality costs; every other request may go to any
    engine at about the same price. The routing bench splits each policy's queueing by it."""
    shared = earlier_shared_prefix_units([k for _, k in prompts])
    return [units * unit >= share * n for (n, _), units in zip(prompts, shared, strict=True)]


def workload_bounds(
    prompts: Sequence[tuple[int, Sequence[int]]],
    *,
    unit: int,
    block_size: int,
    prefill_tokens_per_s: float,
    max_num_batched_tokens: int,
    step_overhead_s: float,
    percentile: Callable[[list[float], float], float],
) -> dict[str, float | str]:
    """``prompts``: ``(prompt tokens, content keys)`` per request the workers accept, in the
    order they are routed; keys one per ``unit`` tokens. Returns the bounds of the module
    docstring, the p90 by ``percentile`` (sorted values, percent), the policies' own."""
    if not prompts:
        return {}
    shared = earlier_shared_prefix_units([k for _, k in prompts])
    hits, lower = [], []
    for (n, _), units in zip(prompts, shared, strict=True):
        hit = min(units * unit // block_size * block_size, n)
        u = max(n - hit, 1)
        hits.append(hit)
        lower.append(
            u / prefill_tokens_per_s + math.ceil(u / max_num_batched_tokens) * step_overhead_s
        )
    lower.sort()
    return {
        "what": "every request served by an unbounded cache holding every earlier prompt, "
        "prefilled alone on one worker with nothing queued (no placement does better)",
        "hit_rate_upper": round(sum(hits) / sum(n for n, _ in prompts), 4),
        "ttft_mean_lower_s": round(statistics.fmean(lower), 4),
        "ttft_p90_lower_s": round(percentile(lower, 90), 4),
    }
