"""One engine's exact index state as msgpack, for Redis snapshots.

A new router replica imports an engine's snapshot and replays only the sequence numbers after
it. Size is bounded by the engine's resident blocks (about 30 bytes per block).
"""

from __future__ import annotations

import msgspec

from indexer.engine_state import EngineState
from indexer.residency import Residency
from indexer.staggered import SLOT_MASK, HashMap
from indexer.types import GroupSpec
from indexer.wire import BlockHash

__all__ = ["EngineSnapshot", "decode_snapshot", "encode_snapshot", "restore_snapshot"]


class EngineSnapshot(msgspec.Struct, array_like=True, gc=False):
    model: str
    hashes: list[tuple[BlockHash, int, int]]  # (engine hash, content key, references)
    groups: list[tuple[int, str, int, int | None, int | None]]
    resident: list[tuple[int, str, list[int]]]  # (group, medium, content keys)
    dups: list[tuple[int, str, int, int]]  # (group, medium, content key, extra copies)


def encode_snapshot(residency: Residency, e: EngineState) -> bytes:
    """Engine ``e``'s state as msgpack."""
    resident: list[tuple[int, str, list[int]]] = []
    bit = e.bit
    held = set(e.hashes.values())
    for (g, medium), res in residency.tables.items():
        keys = [k for k in held if res[k & SLOT_MASK].get(k, 0) & bit]
        if keys:
            resident.append((g, medium, keys))
    dups = [(g, m, k, n) for (slot, g, m, k), n in residency.dups.items() if slot == e.slot]
    state = EngineSnapshot(
        model=e.model,
        hashes=[(h, k, 1 + e.extra_refs.get(h, 0)) for h, k in e.hashes.items()],
        groups=[
            (g, s.kind, s.block_size, s.sliding_window, s.attention_chunk)
            for g, s in e.groups.items()
        ],
        resident=resident,
        dups=dups,
    )
    return msgspec.msgpack.encode(state)


def decode_snapshot(data: bytes) -> EngineSnapshot:
    """The snapshot in ``data``; ``ValueError`` when it is malformed."""
    try:
        return msgspec.msgpack.decode(data, type=EngineSnapshot)
    except msgspec.MsgspecError as exc:
        raise ValueError(f"bad index snapshot: {exc}") from None


def restore_snapshot(residency: Residency, e: EngineState, state: EngineSnapshot) -> None:
    """Replace engine ``e``'s state with ``state`` (the cap is the caller's to enforce)."""
    residency.drop(e)
    e.model = state.model
    e.hashes = HashMap((h, key) for h, key, _refs in state.hashes)
    e.extra_refs = {h: refs - 1 for h, _key, refs in state.hashes if refs > 1}
    e.groups = {
        g: GroupSpec(kind, bs, window, chunk) for g, kind, bs, window, chunk in state.groups
    }
    e.group_facts.clear()
    bit = e.bit
    for g, medium, keys in state.resident:
        res = residency.table(g, medium)
        for k in keys:
            d = res[k & SLOT_MASK]
            d[k] = d.get(k, 0) | bit
        e.resident[(g, medium)] = e.resident.get((g, medium), 0) + len(keys)
        residency.total += len(keys)
    for g, medium, k, n in state.dups:
        residency.dups[(e.slot, g, medium, k)] = n
