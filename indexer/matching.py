"""Match a prompt against a set of engines: the GPU hit and CPU extension each would find.

:func:`match_engines` is the request path; :func:`match_engines_reference` states the same
composition of the rules plainly, and the tests hold the two to the same answers. The request
path differs in cost only:

* engines are grouped by group layout through :class:`Layouts`, which remembers each engine's
  layout and re-derives it only when the engine's groups change (comparing an engine's groups
  with what was seen is an identity check per spec, where deriving a layout hashes every spec);
* full attention is walked once per group for all engines in C (:func:`full_runs`,
  indexer/_match.c), which returns every engine's run by slot instead of one Python step per
  engine dropping out;
* the CPU extension and the other groups' rules run only when the layout has them, and the
  per-engine explanations are assembled in one pass with the order fixed per layout.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import msgspec

from indexer.eagle import eagle_drop, eagle_full_run, eagle_groups
from indexer.engine_state import EngineState
from indexer.fit_scan import fit_points
from indexer.hit_rules import alignment, cpu_extension, full_attention_run, hit_limit
from indexer.keys import _match
from indexer.staggered import EMPTY_TABLE, Table
from indexer.types import CPU, FULL, GPU, SLIDING, EngineId, GroupSpec
from indexer.u64map import U64Map

__all__ = [
    "GroupHit",
    "Layouts",
    "PrefixMatch",
    "full_runs",
    "match_engines",
    "match_engines_reference",
]


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


def match_engines_reference(
    tables: dict[tuple[int, str], Table],
    engines: Sequence[EngineState],
    keys: Sequence[int],
    n_tokens: int,
    unit: int,
    cpu_chunk_tokens: int,
) -> dict[EngineId, PrefixMatch]:
    """:func:`match_engines` spelt out plainly: the reference it must
    equal (the tests hold the two to the same answers)."""
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


# ---------------------------------------------------------------------------- request path

_c_full_runs = None if _match is None else _match.full_runs


def full_runs(
    res: Table, keys: Sequence[int], block_size: int, unit: int, limit: int, alive: int
) -> list[int]:
    """:func:`~indexer.hit_rules.full_attention_run` as a list indexed by slot (engines not in
    ``alive`` read 0), in C when it is built and ``keys`` is a list or a uint64 array."""
    step = block_size // unit
    if step == 0:  # blocks smaller than the unit are never indexed: every run is 0
        return [0] * alive.bit_length()
    if _c_full_runs is not None and type(res) is U64Map and _c_keys(keys):
        nblocks = limit // block_size
        scan = min(nblocks, len(keys) // step)
        try:
            return _c_full_runs(res, keys, step, scan, block_size, nblocks, alive)  # type: ignore[no-any-return]
        except TypeError:  # keys or masks that are not plain ints: the Python loop takes them
            pass
    out = [0] * alive.bit_length()
    for slot, hit in full_attention_run(res, keys, block_size, unit, limit, alive).items():
        out[slot] = hit
    return out


def _c_keys(keys: Sequence[int]) -> bool:
    t = type(keys)
    return t is list or t is tuple or (t is array and keys.typecode == "Q")  # type: ignore[attr-defined]


class Layout:
    """What matching needs of one group layout, derived once: the specs (EAGLE-adjusted), the
    alignment, the full-attention and other groups, and the explanation order."""

    __slots__ = (
        "align",
        "cpu_groups",
        "eagle",
        "explain",
        "full",
        "groups",
        "others",
        "raw",
        "simple",
        "sliding",
    )

    def __init__(self, raw: dict[int, GroupSpec], eagle: bool) -> None:
        self.raw = raw
        self.eagle = eagle
        self.groups = eagle_groups(raw) if eagle else raw
        self.align = alignment(self.groups.values()) if self.groups else 1
        self.full = [(g, s) for g, s in self.groups.items() if s.kind == FULL]
        self.others = [(g, s) for g, s in self.groups.items() if s.kind != FULL]
        self.sliding = bool(self.full) and any(s.kind == SLIDING for _g, s in self.others)
        # One full-attention group and nothing else: each hit is its run (already aligned).
        self.simple = len(self.full) == 1 and not self.others and not eagle
        # The CPU extension looks at the full-attention groups' chunks (else the others').
        self.cpu_groups = [g for g, _s in (self.full or self.others)]
        # Explanations list the groups by index: (is full attention, position in full/others).
        full_at = {g: i for i, (g, _s) in enumerate(self.full)}
        other_at = {g: i for i, (g, _s) in enumerate(self.others)}
        self.explain = [
            (True, full_at[g]) if g in full_at else (False, other_at[g]) for g in self.groups
        ]


class Layouts:
    """Engines grouped by layout, remembered between matches (one per index).

    Per slot: a copy of the groups of the engine last seen there, its EAGLE flag and their
    :class:`Layout`. An engine whose groups still equal the copy (the same spec objects: an
    identity check each, where deriving a layout hashes every spec) keeps that layout; a changed
    or new one is looked up again."""

    __slots__ = ("_layouts", "_seen")

    def __init__(self) -> None:
        self._seen: dict[int, tuple[dict[int, GroupSpec], bool, Layout]] = {}
        self._layouts: dict[tuple[tuple[tuple[int, GroupSpec], ...], bool], Layout] = {}

    def group(self, engines: Sequence[EngineState]) -> list[tuple[Layout, list[EngineState]]]:
        seen = self._seen
        members: dict[Layout, list[EngineState]] = {}
        for e in engines:
            known = seen.get(e.slot)
            if known is None or known[0] != e.groups or known[1] != e.eagle:
                groups = dict(e.groups)
                known = seen[e.slot] = (groups, e.eagle, self._layout(groups, e.eagle))
            same = members.get(known[2])
            if same is None:
                members[known[2]] = [e]
            else:
                same.append(e)
        return list(members.items())

    def _layout(self, groups: dict[int, GroupSpec], eagle: bool) -> Layout:
        key = (tuple(sorted(groups.items())), eagle)
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) > 4096:  # layouts are few; bound them all the same
                self._layouts.clear()
            layout = self._layouts[key] = Layout(dict(key[0]), eagle)
        return layout


def match_engines(
    tables: dict[tuple[int, str], Table],
    engines: Sequence[EngineState],
    keys: Sequence[int],
    n_tokens: int,
    unit: int,
    cpu_chunk_tokens: int,
    layouts: Layouts | None = None,
) -> dict[EngineId, PrefixMatch]:
    """Per engine, the hit of a prompt of ``n_tokens`` whose content keys are ``keys``
    (:func:`match_engines_reference`'s answers). ``layouts``: the index's memo of layouts."""
    out: dict[EngineId, PrefixMatch] = {}
    for layout, members in (layouts or Layouts()).group(engines):
        _match_group(tables, layout, members, keys, n_tokens, unit, cpu_chunk_tokens, out)
        if layout.eagle:
            eagle_drop(layout.raw, members, out)
    return out


def _match_group(
    tables: dict[tuple[int, str], Table],
    layout: Layout,
    members: list[EngineState],
    keys: Sequence[int],
    n_tokens: int,
    unit: int,
    cpu_chunk_tokens: int,
    out: dict[EngineId, PrefixMatch],
) -> None:
    if not layout.groups:
        for e in members:
            out[e.engine] = PrefixMatch(0, 0, [])
        return
    align = layout.align
    limit = hit_limit(n_tokens, len(keys), unit, align)
    alive = 0
    for e in members:
        alive |= e.bit
    if layout.simple:
        _match_simple(
            tables, layout, members, keys, n_tokens, unit, cpu_chunk_tokens, out, limit, alive
        )
        return
    slots = [e.slot for e in members]
    # Per full-attention group, every member's run (by slot), and the shortest of them.
    runs: list[list[int]] = []
    fa = [limit] * len(members)
    for g, spec in layout.full:
        res = tables.get((g, GPU)) or EMPTY_TABLE
        if spec.eagle:
            bs = spec.block_size
            run = full_runs(res, keys, bs, unit, hit_limit(n_tokens, len(keys), unit, bs), alive)
            run = [max(h - bs, 0) for h in run]
        else:
            run = full_runs(res, keys, spec.block_size, unit, limit, alive)
        runs.append(run)
        fa = [min(h, run[s]) for h, s in zip(fa, slots, strict=True)]
    points = [(h // align) * align for h in fa]
    if layout.others:
        other_groups = [(s, tables.get((g, GPU))) for g, s in layout.others]
        starts = [(e.bit, p) for e, p in zip(members, points, strict=True)]
        fits = fit_points(other_groups, starts, keys, align, unit)
        points = [f for f, _per_group in fits]
        explains = _explanations(layout, runs, slots, [per_group for _f, per_group in fits])
    else:
        explains = _explanations(layout, runs, slots, [])
    cpu = _cpu_tokens(tables, layout, members, keys, points, n_tokens, cpu_chunk_tokens, unit)
    for e, point, c, explain in zip(members, points, cpu, explains, strict=True):
        out[e.engine] = PrefixMatch(point, c, explain)


def _match_simple(
    tables: dict[tuple[int, str], Table],
    layout: Layout,
    members: list[EngineState],
    keys: Sequence[int],
    n_tokens: int,
    unit: int,
    chunk: int,
    out: dict[EngineId, PrefixMatch],
    limit: int,
    alive: int,
) -> None:
    """:func:`_match_group` for a layout of one full-attention group: the hit is the run."""
    ((g, spec),) = layout.full
    bs = spec.block_size
    run = full_runs(tables.get((g, GPU)) or EMPTY_TABLE, keys, bs, unit, limit, alive)
    if tables.get((g, CPU)) is None:
        for e in members:
            hit = run[e.slot]
            out[e.engine] = PrefixMatch(hit, 0, [GroupHit(g, FULL, bs, hit)])
        return
    points = [run[e.slot] for e in members]
    cpu = _cpu_tokens(tables, layout, members, keys, points, n_tokens, chunk, unit)
    for e, hit, c in zip(members, points, cpu, strict=True):
        out[e.engine] = PrefixMatch(hit, c, [GroupHit(g, FULL, bs, hit)])


def _explanations(
    layout: Layout, runs: list[list[int]], slots: list[int], per_group: list[list[int]]
) -> list[list[GroupHit]]:
    """Per member, one :class:`GroupHit` per group in index order: full attention from its
    run, the others from their own best point (``per_group``, in ``layout.others`` order)."""
    out = []
    for i, slot in enumerate(slots):
        explain = []
        for full, j in layout.explain:
            if full:
                g, s = layout.full[j]
                explain.append(GroupHit(g, FULL, s.block_size, runs[j][slot]))
            else:
                g, s = layout.others[j]
                hit = per_group[i][j]
                explain.append(GroupHit(g, s.kind, s.block_size, hit, s.sliding_window))
        out.append(explain)
    return out


def _cpu_tokens(
    tables: dict[tuple[int, str], Table],
    layout: Layout,
    members: list[EngineState],
    keys: Sequence[int],
    points: list[int],
    n_tokens: int,
    chunk: int,
    unit: int,
) -> list[int]:
    """Per member, :func:`~indexer.hit_rules.cpu_extension` from its GPU hit; members whose
    hit leaves less than a chunk to load, or whose layout has a group holding nothing on CPU,
    get 0 without a call (the function's own first answers)."""
    cpu_tables = [tables.get((g, CPU)) for g in layout.cpu_groups]
    if any(t is None for t in cpu_tables):
        return [0] * len(members)
    # Beside full attention, sliding-window groups need their window's chunks on CPU too.
    windows = [
        (tables.get((g, CPU)) or EMPTY_TABLE, -(-(s.sliding_window or 1) // chunk))
        for g, s in layout.others
        if layout.sliding and s.kind == SLIDING
    ]
    whole = n_tokens // chunk
    end = min(n_tokens - 1, whole * chunk) if windows else whole * chunk
    return [
        0
        if end - point < chunk
        else cpu_extension(cpu_tables, e.bit, keys, point, n_tokens, chunk, unit, windows)
        for e, point in zip(members, points, strict=True)
    ]
