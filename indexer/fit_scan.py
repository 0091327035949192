"""The hit point of every engine of one group layout, in one right-to-left pass per group.

:func:`indexer.hit_rules.fit_point` spells vLLM's rules out for one engine, one candidate point
at a time; that is O(points x window) per engine, and an engine that holds the full-attention
prefix but not the window's tail walks every point of a long prompt. Here, as vLLM's
``SlidingWindowManager.find_longest_cache_hit`` does, the blocks are scanned once from the right,
but for every engine at once: a block's residency is one bitmask, so "every block of the window
ending at this point is resident" is the AND of the window's masks, and the window ANDs of all
points come from two ``itertools.accumulate`` passes (van Herk / Gil-Werman: per segment of
``window`` blocks, suffix ANDs and prefix ANDs; a window is one suffix AND one prefix). The
points are taken in batches that double in size (up to a bound), so an engine resolved near the
top costs one window.

The result is exactly :func:`~indexer.hit_rules.fit_point`'s, per engine (tests check it against
that reference over random residency tables).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate, compress, islice
from operator import and_, or_

from indexer.hit_rules import fit_point, mask_slots
from indexer.staggered import Table
from indexer.types import CHUNKED, MAMBA, SLIDING, GroupSpec

__all__ = ["fit_points"]

_FIRST_BATCH = 16
"""Points in the first batch; each next batch is twice as many, up to ``_MAX_BATCH``."""

_MAX_BATCH = 1024
"""Bounds the blocks looked up past the answer (the last batch's overshoot)."""

_ALL = -1
"""The mask of every engine (``-1 & m == m``)."""


def fit_points(
    groups: Sequence[tuple[GroupSpec, Table | None]],
    starts: Sequence[tuple[int, int]],
    keys: Sequence[int],
    align: int,
    unit: int,
) -> list[tuple[int, list[int]]]:
    """For each ``(bit, start)`` of ``starts``: ``fit_point(groups, bit, keys, start, align,
    unit)``, i.e. the largest aligned point <= start every group accepts and each group's own
    best point, in the order given. Each bit is one engine's (a single, distinct bit)."""
    if not groups:
        return [(s, []) for _bit, s in starts]
    if any(align % spec.block_size for spec, _res in groups):
        # Points between block ends: not a layout's alignment; the reference handles them.
        return [fit_point(groups, bit, keys, s, align, unit) for bit, s in starts]
    n_groups = len(groups)
    aligned = [(max(s, 0) // align) * align for _bit, s in starts]
    fit = [0] * len(starts)
    best = [[0] * n_groups for _ in starts]
    live = [i for i, (_spec, res) in enumerate(groups) if res is not None]
    if live and aligned and max(aligned) > 0:
        _scan(groups, live, starts, aligned, keys, align, unit, fit, best)
    return [(f, b) for f, b in zip(fit, best, strict=True)]


def _scan(
    groups: Sequence[tuple[GroupSpec, Table | None]],
    live: list[int],
    starts: Sequence[tuple[int, int]],
    aligned: list[int],
    keys: Sequence[int],
    align: int,
    unit: int,
    fit: list[int],
    best: list[list[int]],
) -> None:
    """Fill ``fit`` and ``best`` walking the aligned points down from the highest start: an
    engine is *pending* once the walk is at or below its start; at each point, the pending
    engines a group accepts get it as that group's best, those every group accepts as their fit
    (none when a group has no table: it accepts no point above 0)."""
    fit_possible = len(live) == len(groups)
    index = {bit.bit_length() - 1: i for i, (bit, _s) in enumerate(starts)}
    order = sorted(range(len(starts)), key=aligned.__getitem__, reverse=True)
    bits = [starts[i][0] for i in order]
    tops = [aligned[i] for i in order]
    pending = dict.fromkeys(live, 0)
    pending_fit = 0
    joined_by = [0, *accumulate(bits, or_)]  # joined_by[k]: the first k engines of order
    joined = 0  # engines of ``order`` already pending
    ahead = 0  # engines of ``order`` whose start is at or above the batch
    p_hi = tops[0]
    batch = _FIRST_BATCH
    while p_hi > 0:
        if not pending_fit and not any(pending.values()):
            if joined == len(order):
                return
            p_hi = min(p_hi, tops[joined])  # nothing pending: skip to the next start
            if p_hi <= 0:
                return
        p_lo = max(p_hi - (batch - 1) * align, align)
        points = range(p_hi, p_lo - align, -align)
        batch = min(batch * 2, _MAX_BATCH)
        while ahead < len(order) and tops[ahead] >= p_lo:
            ahead += 1
        # Engines pending now or joining within the batch (bits are distinct: a difference).
        maybe = pending_fit | (joined_by[ahead] & ~joined_by[joined])
        for m in pending.values():
            maybe |= m
        accepted: dict[int, list[int]] = {}
        skip = len(points)  # the batch's top points no group accepts for a relevant engine
        for g in live:
            accepted[g], dead = _accepted(*groups[g], points, keys, unit, maybe)
            skip = min(skip, dead)
        masks = [islice(m, skip, None) for m in accepted.values()]
        anyone = masks[0] if len(masks) == 1 else map(_or_all, *masks)
        every = accepted[live[0]] if len(live) == 1 else [0] * skip
        if len(live) > 1:
            every.extend(map(_and_all, *(islice(m, skip, None) for m in accepted.values())))
        for i in compress(range(skip, len(points)), map(maybe.__and__, anyone)):
            p = points[i]
            while joined < len(order) and tops[joined] >= p:
                b = bits[joined]
                for g in live:
                    pending[g] |= b
                if fit_possible:
                    pending_fit |= b
                joined += 1
            for g in live:
                m = accepted[g][i] & pending[g]
                if m:
                    pending[g] ^= m
                    for slot in mask_slots(m):
                        best[index[slot]][g] = p
            if fit_possible:
                m = every[i] & pending_fit
                if m:
                    pending_fit ^= m
                    for slot in mask_slots(m):
                        fit[index[slot]] = p
            if not pending_fit and not any(pending.values()):
                p_hi = p - align  # nobody is pending until the next start: go there
                break
        else:
            p_hi = p_lo - align


def _or_all(*masks: int) -> int:
    out = 0
    for m in masks:
        out |= m
    return out


def _and_all(*masks: int) -> int:
    out = _ALL
    for m in masks:
        out &= m
    return out


def _accepted(
    spec: GroupSpec, res: Table, points: range, keys: Sequence[int], unit: int, relevant: int
) -> tuple[list[int], int]:
    """Per point of ``points`` (descending, > 0), the mask of the engines the group accepts
    there (the rules of :func:`indexer.hit_rules.group_accepts`), and how many of the first
    points accept no engine of ``relevant`` (engines outside it may be left out of the masks)."""
    bs = spec.block_size
    step = bs // unit
    if spec.kind == CHUNKED and spec.attention_chunk:
        return _accepted_chunked(spec, res, points, keys, step, spec.attention_chunk), 0
    if spec.kind == SLIDING:
        window = spec.sliding_window or bs
        width: int | None = -(-(window - 1) // bs)  # cdiv(W - 1, block_size)
    elif spec.kind == MAMBA:
        width = 1  # the state block ending at the point
    else:
        width = None  # every block from 0 (a chunked group whose chunk is unknown too)
    if width is not None and width <= 0:
        return [_ALL] * len(points), 0  # no block before the point is needed
    # Block ends of the points, descending by ``stride`` blocks (align is a multiple of bs).
    stride = -points.step // bs
    top = points[0] // bs
    n_full = 0 if width is None else max(0, min(len(points), (top - width) // stride + 1))
    out: list[int] = []
    n_dead = 0
    if n_full:
        # Blocks [e - width, e) for every end e: window ANDs over the blocks they span.
        first = top - (n_full - 1) * stride - width
        # Every window holds exactly one of the blocks first, first + width, ...: windows
        # above the highest of those a relevant engine holds are held by none of them (a tail
        # nobody holds costs a width-th of the lookups).
        probes = _block_masks(res, keys, step, first, top, width)
        held = [j for j, m in enumerate(map(relevant.__and__, probes)) if m]
        limit = first + held[-1] * width + width if held else first
        n_dead = min(n_full, max(0, -(-(top - limit) // stride)))
        out = [0] * n_dead
        if n_dead < n_full:
            end = top - n_dead * stride
            windows = _window_ands(_block_masks(res, keys, step, first, end), width)
            out.extend(windows[end - width - first :: -stride])
    if n_full < len(points):
        # Ends before a whole window: the run from block 0.
        end = top - n_full * stride
        prefix = list(accumulate(_block_masks(res, keys, step, 0, end), and_))
        out.extend(prefix[end - 1 :: -stride][: len(points) - n_full])
    return out, n_dead


def _accepted_chunked(
    spec: GroupSpec, res: Table, points: range, keys: Sequence[int], step: int, chunk: int
) -> list[int]:
    """Chunked local attention: the blocks from the start of the point's chunk."""
    bs = spec.block_size
    prefix: dict[int, list[int]] = {}
    out = []
    for p in points:
        end = p // bs
        first = ((p // chunk) * chunk) // bs
        if first >= end:
            out.append(_ALL)
            continue
        run = prefix.get(first)
        if run is None or len(run) < end - first:
            run = prefix[first] = list(accumulate(_block_masks(res, keys, step, first, end), and_))
        out.append(run[end - first - 1])
    return out


def _block_masks(
    res: Table, keys: Sequence[int], step: int, first: int, end: int, every: int = 1
) -> list[int]:
    """Residency masks of every ``every``-th block of [first, end): block ``b`` ends at
    ``keys[(b + 1) * step - 1]``."""
    n = -(-(end - first) // every)
    if n <= 0:
        return []
    # Blocks smaller than the unit (step 0): the rule's index is -1.
    ks = keys[(first + 1) * step - 1 : end * step : step * every] if step else [keys[-1]] * n
    return res.get_many(ks, 0)


def _window_ands(masks: list[int], width: int) -> list[int]:
    """``[AND of masks[i : i + width] for i in range(len(masks) - width + 1)]`` in O(len)."""
    if width == 1:
        return masks
    suffix: list[int] = []
    prefix: list[int] = []
    for s in range(0, len(masks), width):
        seg = masks[s : s + width]
        prefix.extend(accumulate(seg, and_))
        back = list(accumulate(reversed(seg), and_))
        back.reverse()
        suffix.extend(back)
    return list(map(and_, suffix, prefix[width - 1 :]))
