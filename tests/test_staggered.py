"""Staggered maps (indexer/staggered.py): CPython grows a dict all at once, re-inserting every
entry while the event loop waits, so no growth step may re-insert more than a small share of
what the index holds, even when many maps fill at the same rate."""

from __future__ import annotations

import sys

from indexer.staggered import HashMap, new_table


def _worst_step(maps: list[HashMap | dict[int, int]], steps: int, per_step: int) -> float:
    """Fill every map with the same keys, ``per_step`` at a time, as 16 engines under the same
    load do; return the largest share of all entries re-inserted by growth within one step."""
    seen: dict[tuple[int, int], int] = {}
    worst = 0
    for step in range(steps):
        first = step * per_step
        # Spread evenly over the 1024 slots, the worst case for growing together.
        keys = [(i // 1024 + 1) * 1024 + i * 389 % 1024 for i in range(first, first + per_step)]
        moved = 0
        for m in maps:
            for k in keys:
                m[k] = k
            parts = m.segment_sizes() if isinstance(m, HashMap) else [(len(m), sys.getsizeof(m))]
            for i, (n, size) in enumerate(parts):
                if seen.get((id(m), i), size) != size:
                    moved += n
                seen[(id(m), i)] = size
        if first >= 1600:  # small maps grow cheaply anyway
            worst = max(worst, moved / (len(maps) * (first + per_step)))
    return worst


def test_maps_filled_together_never_grow_all_at_once():
    # 12,800 entries per map; each shard passes two or three growth points.
    split = [HashMap() for _ in range(16)]
    plain: list[dict[int, int]] = [{} for _ in range(16)]
    assert _worst_step(plain, 800, 16) > 0.6  # what the split is for: all re-inserted at once
    assert _worst_step(split, 800, 16) <= 0.13


def test_one_maps_shards_have_unequal_shares():
    """Within one map, shards hold about 1:2 smallest to largest, so they grow one at a time."""
    one = HashMap()
    for i in range(16_384):
        one[(i // 1024 + 1) * 1024 + i * 389 % 1024] = i
    sizes = sorted(n for n, _bytes in one.segment_sizes())
    assert 1.5 <= sizes[-1] / sizes[0] <= 2.6
    assert sizes[-1] <= 0.09 * sum(sizes)


def test_hash_map_behaves_as_a_dict() -> None:
    m = HashMap([(b"a" * 32, 1), (2**64 - 1, 2)])
    m[-5] = 3
    assert m.get(b"a" * 32) == 1 and m[2**64 - 1] == 2 and m.get(-5) == 3
    assert m.get(7) is None and 7 not in m and -5 in m
    del m[-5]
    assert len(m) == 2
    assert dict(m.items()) == {b"a" * 32: 1, 2**64 - 1: 2}
    assert sorted(m.values()) == [1, 2] and set(m) == {b"a" * 32, 2**64 - 1}


def test_every_slot_has_a_segment_and_there_are_sixteen() -> None:
    table = new_table()
    assert len(table) == 0 and len(table.segment_sizes()) == 16
    assert {table.segment_of(slot) for slot in range(1024)} == set(range(16))
