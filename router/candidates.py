"""Candidate assembly: what the policy is told about each engine for one prompt.

A pure function of what the router knows at the moment of the decision, shared by the router
(``router.core.Router.route``) and the routing benchmark, so that both score the same inputs.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping, Sequence

from indexer.index import EngineId, PrefixIndex, PrefixMatch
from router.load import EngineLoad
from router.policy import Candidate
from router.speculative import SpeculativeCache, junction_tokens

__all__ = ["build_candidates", "record_sent", "speculative_hits"]

_NONE: frozenset[EngineId] = frozenset()


def build_candidates(
    loads: Iterable[tuple[EngineId, EngineLoad]],
    matches: Mapping[EngineId, PrefixMatch],
    *,
    block_size: int,
    speculative: Mapping[EngineId, int] | None = None,
    remote: Mapping[EngineId, EngineLoad] | None = None,
    load_only: Container[EngineId] = _NONE,
    unverified: Container[EngineId] = _NONE,
    adapter: Mapping[EngineId, float] | None = None,
    reach: Mapping[EngineId, int] | None = None,
) -> list[Candidate]:
    """One :class:`Candidate` per engine of ``loads``, in that order.

    * ``loads``: each engine with this router's live load record for it (copied, never kept);
    * ``matches``: the index's prefix match per engine (absent: no hit);
    * ``speculative``: tokens a speculative entry covers per engine, floored here to whole
      blocks of ``block_size`` (the worker caches whole blocks only);
    * ``remote``: other replicas' accounting per engine, added to this router's own;
    * ``load_only``: engines whose index is degraded: their index hit is not trusted, a
      speculative entry (this router's own recent decision) still is;
    * ``unverified``: engines whose predictions drifted: no prefix credit at all until
      re-verified;
    * ``adapter``: what the request's LoRA adapter costs per engine (router/lora.py);
    * ``reach``: for engines with sliding-window or Mamba groups, the prefix a speculative entry
      shows for their full-attention blocks (router/speculative.py): with the index's
      full-attention run, the candidate's ``junction_tokens``.
    """
    spec = speculative or {}
    extra = adapter or {}
    others = remote or {}
    out = []
    ahead = reach or {}
    for e, own in loads:
        m = None if e in load_only else matches.get(e)
        hit = spec.get(e, 0) // block_size * block_size
        junction = max(junction_tokens(m), ahead.get(e, 0) // block_size * block_size)
        if e in unverified:
            m, hit, junction = None, 0, 0
        out.append(
            Candidate(
                engine=e,
                gpu_hit_tokens=m.gpu_tokens if m else 0,
                cpu_hit_tokens=m.cpu_tokens if m else 0,
                load=own.plus(others.get(e)),
                speculative_tokens=hit,
                adapter_tokens=extra.get(e, 0.0),
                junction_tokens=junction,
            )
        )
    return out


def speculative_hits(
    spec: SpeculativeCache,
    index: PrefixIndex,
    engines: Iterable[EngineId],
    keys: Sequence[int],
    n_tokens: int,
    now: float,
) -> tuple[dict[EngineId, int], dict[EngineId, int]]:
    """What the speculative entries credit a prompt on each engine, and what they show of the
    full-attention blocks on engines with sparse groups (``build_candidates``' ``speculative``
    and ``reach``), read with each engine's groups as its events declared them."""
    reach: dict[EngineId, int] = {}
    hits = spec.prompt_hits(engines, keys, n_tokens, index.unit, now, index.group_specs, reach)
    return hits, reach


def record_sent(
    spec: SpeculativeCache,
    index: PrefixIndex,
    engine: EngineId,
    keys: Sequence[int],
    n_tokens: int,
    match: PrefixMatch | None,
    now: float,
) -> None:
    """The speculative entry for a prompt just sent to ``engine`` (``match``: the index's match
    there): its replay boundary, its junction there, the blocks the engine's groups keep."""
    spec.record(
        engine,
        keys,
        now,
        n_tokens=n_tokens,
        junction=junction_tokens(match),
        unit=index.unit,
        groups=index.group_specs(engine),
    )
