"""EAGLE / MTP speculative decoding in vLLM's hit rule (``use_eagle`` in
``v1/core/single_type_kv_cache_manager.py`` and ``kv_cache_coordinator.py``).

The drafter needs the hidden state of the last matched block, so vLLM recomputes it: full
attention drops its last matched block (then aligns down), a sliding-window group needs one more
contiguous block than the window asks for and drops the last one. Matching runs the ordinary
rules on the adjusted specs (:func:`eagle_groups`), then :func:`eagle_drop` removes the sliding
group's block from the final point.

Modelled for full attention alone and for vLLM's "simple hybrid" (one full-attention spec plus
one sliding-window spec, one pass; exact when the sliding block size is the LCM). Not modelled:
mamba and chunked-local groups under EAGLE, the repeated drops vLLM applies in hybrids of three
or more specs, and the CPU extension of a hybrid (computed from the point before the sliding
group's drop).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from indexer.engine_state import EngineState
from indexer.hit_rules import full_attention_run, hit_limit
from indexer.staggered import Table
from indexer.types import FULL, SLIDING, EngineId, GroupSpec

__all__ = ["eagle_drop", "eagle_full_run", "eagle_groups"]


def eagle_groups(groups: dict[int, GroupSpec]) -> dict[int, GroupSpec]:
    """The specs EAGLE matching runs on: full attention marked to drop its last block, sliding
    windows one block longer (``cdiv(W - 1, bs) + 1`` blocks)."""
    out = {}
    for g, s in groups.items():
        if s.kind == FULL:
            out[g] = GroupSpec(s.kind, s.block_size, s.sliding_window, s.attention_chunk, True)
        elif s.kind == SLIDING:
            window = (s.sliding_window or s.block_size) + s.block_size
            out[g] = GroupSpec(s.kind, s.block_size, window, s.attention_chunk, True)
        else:
            out[g] = s
    return out


def eagle_full_run(
    res: Table, keys: Sequence[int], spec: GroupSpec, unit: int, n_tokens: int, alive: int
) -> dict[int, int]:
    """Full attention under EAGLE, per engine slot: the run of blocks up to ``n - 1`` tokens
    (aligned to this group's block only: vLLM aligns to the LCM after the drop), minus one."""
    bs = spec.block_size
    limit = hit_limit(n_tokens, len(keys), unit, bs)
    hits = full_attention_run(res, keys, bs, unit, limit, alive)
    return {slot: max(h - bs, 0) for slot, h in hits.items()}


def eagle_drop(
    groups: dict[int, GroupSpec], members: Sequence[EngineState], out: dict[EngineId, Any]
) -> None:
    """Drop the sliding-window group's last matched block from each member's GPU hit (and
    align the point down again: the hit stays a multiple of every block size)."""
    sliding = [s.block_size for s in groups.values() if s.kind == SLIDING]
    if not sliding:
        return
    align = math.lcm(*(s.block_size for s in groups.values()))
    for e in members:
        m = out.get(e.engine)
        if m is None or m.gpu_tokens == 0:
            continue
        point = max(m.gpu_tokens - max(sliding), 0)
        m.gpu_tokens = point // align * align
