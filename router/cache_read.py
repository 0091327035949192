"""Whether vLLM reads its prefix cache for a request at all.

vLLM skips the lookup (``KVCacheManager.get_computed_blocks`` returns nothing and the
OffloadingConnector loads nothing) when ``Request.skip_reading_prefix_cache`` is set, which
``SamplingParams`` derives from ``prompt_logprobs is not None``: cached tokens never went through
the model, so they have no logprobs to give. The OpenAI front end sets ``prompt_logprobs`` from
the request's own field, or, with ``echo``, from ``logprobs`` (completions) or ``top_logprobs``
(chat, default 0). Such a request is served with ``cached_tokens`` 0 whatever the cache holds:
the router predicts no hit, routes it by load, and leaves it out of verification.

A request with ``n`` > 1 (parallel sampling) reads the cache, but its ``cached_tokens`` is not
one lookup's: vLLM runs a child request per choice and answers with the usage of the child that
ended last, and a child after the first finds the prompt blocks the first one allocated in the
same step (checked against vLLM 0.32: a new 200-token prompt with ``n=2`` reports 192 cached
tokens with 32-token blocks). The router predicts and routes it as one prompt, and leaves it out
of verification.

A completion whose ``prompt`` is a list of prompts (strings or token-id lists) is a batch: vLLM
runs each prompt as its own request (``n`` children each), sums their ``prompt_tokens`` and
reports the last prompt's ``cached_tokens``. The router routes it by the first prompt, counts
every child in the engine's load, and leaves it out of verification too.
"""

from __future__ import annotations

from typing import Any

__all__ = ["reads_prefix_cache", "sequences"]


def reads_prefix_cache(body: dict[str, Any], chat: bool) -> bool:
    """False when vLLM will serve ``body`` without looking up its prefix cache."""
    prompt_logprobs = body.get("prompt_logprobs")
    if prompt_logprobs is None and body.get("echo"):
        prompt_logprobs = body.get("top_logprobs", 0) if chat else body.get("logprobs")
    return prompt_logprobs is None


def sequences(body: dict[str, Any]) -> int:
    """The requests vLLM's engine runs for ``body``: ``n`` (1 unless a valid n > 1) for each of
    its prompts (one, or each of a completion's batch)."""
    n = body.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
    p = body.get("prompt")
    batch = len(p) if isinstance(p, list) and p and isinstance(p[0], str | list) else 1
    return n * batch
