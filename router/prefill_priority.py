"""Shortest prefill first on every engine, through vLLM's own request ``priority``.

A vLLM engine admits waiting requests first come, first served: a short prompt queued behind a
long one waits for all of that prefill, and on a fleet whose prompts run from a few hundred to
a hundred thousand tokens that wait is most of the short requests' TTFT. Started with
``--scheduling-policy priority``, vLLM admits them by ``(priority, arrival)`` instead, lowest
first. With ``policy.prefill_priority`` the router writes each request's ``priority``: the size
class of the prefill it leaves on the engine it is sent to (:func:`prefill_class`, from the
same uncached-token figure the policy ranked it by), so each engine runs shorter prefills first.

Classes are powers of two of ``PRIORITY_UNIT_TOKENS``: a request is passed over only by prefills
less than half its size's class, and in arrival order within its class. Below one unit a
prefill is a fraction of a step, where order buys nothing. vLLM never ages a waiting request:
under sustained overload a long prompt waits while shorter ones keep arriving, up to the
router's ``server.first_byte_timeout_s``.

Never written: a ``priority`` the client set (kept as sent), the rest of vLLM's API (passed
through untouched), and requests that may go to a worker whose self-check found it refusing
priorities (router/selfcheck.py). vLLM's V1 engine takes a priority without priority scheduling
and ignores it (checked against vLLM 0.32), so there the option does nothing and costs nothing;
its V0 engine answered it 400.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRIORITY_UNIT_TOKENS", "prefill_class", "with_prefill_priority"]

PRIORITY_UNIT_TOKENS = 512
"""Uncached tokens of the shortest class above 0. The routing bench measured linear classes of
1,024 and 4,096 tokens and powers of two from 512 within 1 % of one another (docs/benchmarks.md);
powers of two keep the classes few (at most 20 up to 2^28 tokens) and the pass-over rule plain."""


def prefill_class(uncached_tokens: int) -> int:
    """The ``priority`` of a request leaving ``uncached_tokens`` to prefill: 0 below one unit,
    then ``k`` for ``[unit * 2^(k-1), unit * 2^k)``."""
    return (max(uncached_tokens, 0) // PRIORITY_UNIT_TOKENS).bit_length()


def with_prefill_priority(body: dict[str, Any], uncached_tokens: int) -> dict[str, Any] | None:
    """``body`` with its ``priority`` set to the prefill's class, or None when it is to go as
    it is: the client set a priority of its own."""
    if "priority" in body:
        return None
    return {**body, "priority": prefill_class(uncached_tokens)}
