"""Match a prompt against a set of engines: the GPU hit and CPU extension each would find."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from indexer.eagle import eagle_drop, eagle_full_run, eagle_groups
from indexer.engine_state import EngineState
from indexer.fit_scan import fit_points
from indexer.hit_rules import alignment, cpu_extension, full_attention_run, hit_limit
from indexer.staggered import EMPTY_TABLE, Table
from indexer.types import CPU, FULL, GPU, SLIDING, EngineId, GroupSpec

__all__ = ["GroupHit", "PrefixMatch", "match_engines"]


class GroupHit(msgspec.Struct, gc=False):
    """Per-group explanation of a match, for /debug."""

    group_idx: int
    kind: str
    block_size: int
    hit_tokens: int
    """Longest point this group alone allows (<= the full-attention run)."""
    sliding_window: int | None = None


class PrefixMatch(msgspec.Struct, gc=False):
    gpu_tokens: int
    """Tokens vLLM's scheduler will find computed in the GPU prefix cache."""
    cpu_tokens: int
    """Further tokens loadable from CPU-offloaded chunks (a transfer, not a prefill)."""
    groups: list[GroupHit]


def match_engines(
    tables: dict[tuple[int, str], Table],
    engines: Sequence[EngineState],
    keys: Sequence[int],
    n_tokens: int,
    unit: int,
    cpu_chunk_tokens: int,
) -> dict[EngineId, PrefixMatch]:
    """Per engine, the hit of a prompt of ``n_tokens`` whose content keys are ``keys``."""
    # Engines with the same group layout are matched together, one pass over the prompt.
    layouts: dict[tuple[tuple[tuple[int, GroupSpec], ...], bool], list[EngineState]] = {}
    for e in engines:
        layout = tuple(sorted(e.groups.items()))
        layouts.setdefault((layout, e.eagle), []).append(e)
    out: dict[EngineId, PrefixMatch] = {}
    for (layout, eagle), members in layouts.items():
        groups = eagle_groups(dict(layout)) if eagle else dict(layout)
        _match_layout(tables, groups, members, keys, n_tokens, unit, cpu_chunk_tokens, out)
        if eagle:
            eagle_drop(dict(layout), members, out)
    return out


def _match_layout(
    tables: dict[tuple[int, str], Table],
    groups: dict[int, GroupSpec],
    members: list[EngineState],
    keys: Sequence[int],
    n_tokens: int,
    unit: int,
    cpu_chunk_tokens: int,
    out: dict[EngineId, PrefixMatch],
) -> None:
    if not groups:
        for e in members:
            out[e.engine] = PrefixMatch(0, 0, [])
        return
    align = alignment(groups.values())
    limit = hit_limit(n_tokens, len(keys), unit, align)
    full = [g for g, s in groups.items() if s.kind == FULL]
    others = [g for g, s in groups.items() if s.kind != FULL]
    # Full attention: the unbroken run of resident blocks from token 0, for all members at
    # once (bitmask).
    alive = 0
    for e in members:
        alive |= e.bit
    fa_hit = {e.slot: limit for e in members}
    fa_per_group: dict[int, dict[int, int]] = {}
    for g in full:
        res = tables.get((g, GPU)) or EMPTY_TABLE
        hits = full_attention_run(res, keys, groups[g].block_size, unit, limit, alive)
        if groups[g].eagle:
            hits = eagle_full_run(res, keys, groups[g], unit, n_tokens, alive)
        fa_per_group[g] = hits
        for slot, h in hits.items():
            if h < fa_hit[slot]:
                fa_hit[slot] = h
    other_groups = [(groups[g], tables.get((g, GPU))) for g in others]
    cpu_tables = [tables.get((g, CPU)) for g in (full or others)]
    # Beside full attention, sliding-window groups need their window's chunks on CPU too.
    windows = [
        (
            tables.get((g, CPU)) or EMPTY_TABLE,
            -(-(groups[g].sliding_window or 1) // cpu_chunk_tokens),
        )
        for g in others
        if full and groups[g].kind == SLIDING
    ]
    # The other groups' rules: one right-to-left pass per group for all members at once.
    starts = [(e.bit, (fa_hit[e.slot] // align) * align) for e in members]
    fits = fit_points(other_groups, starts, keys, align, unit)
    for e, (point, per_group) in zip(members, fits, strict=True):
        explain = [GroupHit(g, FULL, groups[g].block_size, fa_per_group[g][e.slot]) for g in full]
        if others:
            explain.extend(
                GroupHit(g, spec.kind, spec.block_size, hit, spec.sliding_window)
                for g, (spec, _res), hit in zip(others, other_groups, per_group, strict=True)
            )
        explain.sort(key=lambda x: x.group_idx)
        cpu = cpu_extension(
            cpu_tables, e.bit, keys, point, n_tokens, cpu_chunk_tokens, unit, windows
        )
        out[e.engine] = PrefixMatch(point, cpu, explain)
