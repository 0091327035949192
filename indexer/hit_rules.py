"""vLLM's prefix-cache hit rules, as pure functions over residency tables.

A *residency lookup* is a table (indexer/u64map.py): ``res.get(key, 0)`` is the bitmask of the
engines holding the block whose content key is ``key``; ``bit`` selects one engine. ``keys[i]``
is the content key at token ``(i + 1) * unit`` of the prompt, so the block ``b`` of a group
with blocks of ``bs`` tokens ends at key ``keys[(b + 1) * bs // unit - 1]``.

The rules (vLLM's ``HybridKVCacheCoordinator.find_longest_cache_hit`` and its managers):

* the hit is at most ``n - 1`` tokens (the last prompt token is always computed) and a multiple
  of the LCM of every group's block size;
* full attention needs the unbroken run of blocks from token 0;
* a sliding window of ``W`` tokens needs the ``cdiv(W - 1, bs)`` blocks ending at the point (or
  a shorter run from block 0);
* mamba needs the one state block ending at the point;
* chunked local attention needs the blocks from the start of the point's chunk (every block
  from 0 while the chunk is unknown);
* the hit is the largest point every group accepts.

CPU offload adds whole chunks beyond the GPU hit (:func:`cpu_extension`).

``group_accepts`` / ``best_point`` / ``fit_point`` state the non-full rules one engine and one
candidate point at a time; they are the reference that indexer/fit_scan.py's one-pass search
for a whole layout must equal (matching uses that one). ``full_attention_run`` hands its block
loop to ``run_scan`` (C when built, indexer/native.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from indexer.native import run_scan
from indexer.staggered import Table
from indexer.types import CHUNKED, MAMBA, SLIDING, GroupSpec

__all__ = [
    "alignment",
    "best_point",
    "cpu_extension",
    "fit_point",
    "full_attention_run",
    "group_accepts",
    "hit_limit",
]


def alignment(specs: Iterable[GroupSpec]) -> int:
    """Every hit is a multiple of this: the LCM of the groups' block sizes."""
    return math.lcm(*(s.block_size for s in specs))


def hit_limit(n_tokens: int, n_keys: int, unit: int, align: int) -> int:
    """The longest hit a prompt of ``n_tokens`` allows: ``n - 1`` tokens, within the ``n_keys``
    keys given, aligned down to ``align``."""
    max_hit = max(n_tokens - 1, 0)
    # Callers may pass keys for fewer tokens than n_tokens; never read past them.
    max_hit = min(max_hit, n_keys * unit)
    return (max_hit // align) * align


def full_attention_run(
    res: Table, keys: Sequence[int], block_size: int, unit: int, limit: int, alive: int
) -> dict[int, int]:
    """For every engine bit set in ``alive``: tokens of its unbroken run of resident blocks from
    token 0, at most ``limit``. Keyed by slot (bit position).

    All engines at once (bitmask), stopping as soon as none is still running.
    """
    step = block_size // unit
    if step == 0:  # blocks smaller than the unit are never indexed (unaligned_blocks)
        return dict.fromkeys(mask_slots(alive), 0)
    hits: dict[int, int] = {}
    nblocks = limit // block_size
    # One lookup per block (keyed by its last unit): an 8k-token prompt is 512 lookups, most
    # of them cache misses in a large index. run_scan (C when built) runs them until some
    # engine drops out, so this loop turns once per distinct drop point, not once per block.
    # Blocks without a key (keys for fewer than limit tokens) are not scanned, and engines
    # still alive after the last scanned block get nblocks * block_size.
    scan = min(nblocks, len(keys) // step)
    b = 0
    while alive:
        b, now = run_scan(res, keys, b, step, scan, alive)
        if b == scan:
            break
        dropped = alive & ~now
        while dropped:
            low = dropped & -dropped
            hits[low.bit_length() - 1] = b * block_size
            dropped ^= low
        alive = now
        b += 1
    while alive:
        low = alive & -alive
        hits[low.bit_length() - 1] = nblocks * block_size
        alive ^= low
    return hits


def mask_slots(mask: int) -> list[int]:
    """The engine slots whose bits are set in ``mask``, lowest first."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def group_accepts(
    spec: GroupSpec, res: Table | None, bit: int, keys: Sequence[int], point: int, unit: int
) -> bool:
    """Whether a group accepts a hit ending at ``point`` for the engine ``bit``.

    ``res`` is the group's GPU table (None: the group holds nothing). Full attention needs every
    block from 0 (matching uses the faster fleet-wide :func:`full_attention_run` for it)."""
    if point == 0:
        return True
    if res is None:
        return False
    bs = spec.block_size
    step = bs // unit
    end_block = point // bs  # blocks [0, end_block) end at or before point
    if spec.kind == SLIDING:
        window = spec.sliding_window or bs
        need = -(-(window - 1) // bs)  # cdiv(W - 1, block_size)
        first = max(end_block - need, 0)  # a shorter run from block 0 also counts
    elif spec.kind == MAMBA:
        first = end_block - 1  # only the state block ending exactly at the point
    elif spec.kind == CHUNKED and spec.attention_chunk:
        chunk = spec.attention_chunk
        first = ((point // chunk) * chunk) // bs
        if first >= end_block:
            return True
    else:
        first = 0
    return all(
        res.get(k, 0) & bit for k in (keys[(b + 1) * step - 1] for b in range(first, end_block))
    )


def best_point(
    spec: GroupSpec,
    res: Table | None,
    bit: int,
    keys: Sequence[int],
    start: int,
    align: int,
    unit: int,
) -> int:
    """Largest multiple of ``align`` at most ``start`` that the group accepts (0 at worst)."""
    point = (max(start, 0) // align) * align
    while point > 0 and not group_accepts(spec, res, bit, keys, point, unit):
        point -= align
    return max(point, 0)


def fit_point(
    groups: Sequence[tuple[GroupSpec, Table | None]],
    bit: int,
    keys: Sequence[int],
    start: int,
    align: int,
    unit: int,
) -> tuple[int, list[int]]:
    """Largest aligned point <= start that every one of ``groups`` accepts (vLLM's fixed point),
    and each group's own best point from ``start``, in the order given.

    ``groups`` are the non-full-attention groups with their GPU tables; ``start`` is the
    full-attention run, aligned. Full attention is downward-closed, so any point below its run
    is fine for it; each other group's rule is checked at candidate points from right to left.
    O(points x window) per engine: the request path uses
    :func:`indexer.fit_scan.fit_points`, which gives the same answers in one pass per group.
    """
    if not groups:
        return start, []
    per_group = [best_point(spec, res, bit, keys, start, align, unit) for spec, res in groups]
    point = min(per_group)
    while point > 0 and not all(
        group_accepts(spec, res, bit, keys, point, unit) for spec, res in groups
    ):
        point = min(
            best_point(spec, res, bit, keys, point - align, align, unit) for spec, res in groups
        )
    return point, per_group


def cpu_extension(
    tables: Sequence[Table | None],
    bit: int,
    keys: Sequence[int],
    gpu_hit: int,
    n_tokens: int,
    chunk: int,
    unit: int,
    windows: Sequence[tuple[Table, int]] = (),
) -> int:
    """Tokens loadable from CPU chunks beyond the GPU hit, as vLLM's OffloadingConnector
    counts them (``OffloadingConnectorScheduler._lookup_complete_chunks``):

    * the lookup covers the request's whole chunks (``n // chunk``) and starts at chunk
      ``gpu_hit // chunk``; present chunks must be contiguous from there;
    * a chunk is present when its tail key (the offload key is the chunk's last block hash)
      is resident on CPU in every one of ``tables`` (None: that group holds nothing on CPU);
    * ``windows``: each sliding-window group's CPU table with the chunks its window needs;
      the load ends where every such group still has that many contiguous chunks before it
      (or a shorter run from the start), and with any such group the lookup ends at ``n - 1``;
    * the loaded part must be at least one whole chunk, else nothing is loaded;
    * a load reaching the prompt's end counts in full: vLLM reports the tokens it loaded as
      cached at admission and recomputes the last one only later.
    """
    if any(t is None for t in tables):
        return 0
    whole = n_tokens // chunk
    end = min(n_tokens - 1, whole * chunk) if windows else whole * chunk
    if end - gpu_hit < chunk:
        return 0
    step = chunk // unit

    def present(table: Table, c: int) -> bool:
        key = keys[(c + 1) * step - 1] if (c + 1) * step <= len(keys) else None
        return key is not None and bool(table.get(key, 0) & bit)

    start = k = gpu_hit // chunk
    while k < whole and all(present(t, k) for t in tables):  # type: ignore[arg-type]
        k += 1
    moved = bool(windows)
    while moved and k > start:
        moved = False
        for table, need in windows:
            run, last = 0, start
            for c in range(k - 1, start - 1, -1):
                run = run + 1 if present(table, c) else 0
                if run == need:
                    last = c + need
                    break
            else:
                last = start + run
            if last < k:
                k, moved = last, True
    loaded = min(k * chunk, end) - gpu_hit
    return loaded if loaded >= chunk else 0
