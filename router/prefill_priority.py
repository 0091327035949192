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
prefill is a fraction of a step, where order buys nothing. vLLM never ages a waiting request,
so the router does (:func:`prefill_priority`): once one of its requests on an engine has waited
``policy.prefill_priority_max_wait_s`` beyond its own prefill's time, later requests there get no
class below its own, so they queue behind it and nothing passes it any more. A request is then
passed over for at most that long, plus the prefills already queued ahead of it; the bound
covers the requests this router sent (another replica's later requests may still pass them).

Never written: a ``priority`` the client set (kept as sent), the rest of vLLM's API (passed
through untouched), and requests that may go to a worker whose self-check found it refusing
priorities (router/selfcheck.py). vLLM's V1 engine takes a priority without priority scheduling
and ignores it (checked against vLLM 0.32), so there the option does nothing and costs nothing;
its V0 engine answered it 400.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from router.policy import KvRouterPolicy

if TYPE_CHECKING:
    from indexer.index import EngineId
    from router.policy import Policy, PolicyParams
    from router.workers import Worker

__all__ = [
    "PRIORITY_UNIT_TOKENS",
    "Waiting",
    "engine_priority",
    "prefill_class",
    "prefill_priority",
    "with_prefill_priority",
]

PRIORITY_UNIT_TOKENS = 512
"""Uncached tokens of the shortest class above 0. The routing bench measured linear classes of
1,024 and 4,096 tokens and powers of two from 512 within 1 % of one another (docs/benchmarks.md);
powers of two keep the classes few (at most 20 up to 2^28 tokens) and the pass-over rule plain."""


def prefill_class(uncached_tokens: int) -> int:
    """The ``priority`` of a request leaving ``uncached_tokens`` to prefill: 0 below one unit,
    then ``k`` for ``[unit * 2^(k-1), unit * 2^k)``."""
    return (max(uncached_tokens, 0) // PRIORITY_UNIT_TOKENS).bit_length()


class Waiting(Protocol):
    """A request this router sent to an engine (``router.proxy.Ticket``)."""

    uncached: int
    sent_s: float

    @property
    def prefill_pending(self) -> bool:
        """No first token yet, as far as the router knows."""
        ...


def prefill_priority(
    uncached_tokens: int,
    waiting: Iterable[Waiting],
    now: float,
    *,
    max_wait_s: float,
    tokens_per_s: float,
) -> int:
    """The ``priority`` of a prefill of ``uncached_tokens`` sent to an engine where ``waiting``
    are this router's requests: its class, or the class of any of them that has waited more
    than ``max_wait_s`` beyond its own prefill (its uncached tokens at ``tokens_per_s``), if
    higher. A request of that class sent later queues behind it (arrival order within a class),
    so no later arrival passes it."""
    cls = prefill_class(uncached_tokens)
    for r in waiting:
        if r.prefill_pending and now - r.sent_s - r.uncached / tokens_per_s > max_wait_s:
            cls = max(cls, prefill_class(r.uncached))
    return cls


def engine_priority(
    uncached_tokens: int,
    engine: EngineId,
    worker: Worker,
    policy: Policy,
    params: PolicyParams,
    now: float,
) -> int:
    """:func:`prefill_priority` on ``engine`` of ``worker``: against this router's requests
    waiting there, their prefill timed at the engine's learned rate (else the configured
    ``prefill_tokens_per_s``), with ``params.prefill_priority_max_wait_s``. What the router
    writes, and what the routing bench has its workers run by."""
    learned = policy.prefill_rate(engine) if isinstance(policy, KvRouterPolicy) else None
    return prefill_priority(
        uncached_tokens,
        worker.prefilling.get(engine[1], ()),
        now,
        max_wait_s=params.prefill_priority_max_wait_s,
        tokens_per_s=learned or params.prefill_tokens_per_s,
    )


def with_prefill_priority(body: dict[str, Any], priority: int) -> dict[str, Any] | None:
    """``body`` with its ``priority`` set, or None when it is to go as it is: the client set a
    priority of its own."""
    if "priority" in body:
        return None
    return {**body, "priority": priority}
