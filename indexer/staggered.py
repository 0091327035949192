"""Big int-keyed maps split into dicts that grow at different moments.

CPython grows a dict in one step that re-inserts every entry, so a map of millions of entries
stops the event loop for the whole re-insertion when it grows, and while the subscriber catches
up with what queued meanwhile the lag stays high for several times that. The index keeps
millions of entries in a few residency maps and one hash map per engine, so:

* Every residency map is a *table*: a tuple of ``SLOTS`` references to ``SHARDS`` dicts: one
  subscript more per lookup, indexed by ``key & SLOT_MASK`` (content keys are uniform 64-bit
  ints). Each growth step is then 1/16 of the map. Engine hash maps are
  :class:`indexer.u64map.U64Map`, split the same way.
* The shards get unequal shares -- shard ``i`` about ``2 ** (i / 16)`` -- so they reach their
  growth points at different moments instead of all at once (equal shards would all grow
  together, which splits the work but not the stall).
* Maps filled at the same rate (the hash maps of 16 engines under the same load) still grow
  their shard ``i`` at about the same moment; but that is 1/16 of their entries, where unsplit
  maps would all re-insert every entry within the same few milliseconds. (Giving each map its
  own shares would need far more slots to tell 256 growth points apart, and the 16-way split
  already keeps each stall short.)

Batches stay C-level: ``map`` over ``table.__getitem__`` and ``dict.get`` / ``dict.__setitem__``.
"""

from __future__ import annotations

from typing import Any

from indexer.u64map import U64Map

__all__ = ["EMPTY_TABLE", "SLOTS", "SLOT_MASK", "HashMap", "Table", "new_table", "shards"]

SHARDS = 16
SLOTS = 1024
SLOT_MASK = SLOTS - 1

Table = tuple[dict[Any, int], ...]
"""``table[slot]`` is the dict that holds the keys of that slot (see above for the slot)."""

EMPTY_TABLE: Table = ({},) * SLOTS  # one shared dict, never written


def _slot_shards() -> tuple[int, ...]:
    """Slot -> shard, shard ``i`` owning a share of slots proportional to ``2 ** (i / 16)``."""
    weights = [2 ** (i / SHARDS) for i in range(SHARDS)]
    total = sum(weights)
    counts = [int(SLOTS * w / total) for w in weights]
    for i in range(SLOTS - sum(counts)):
        counts[SHARDS - 1 - i % SHARDS] += 1
    return tuple(i for i, c in enumerate(counts) for _ in range(c))


_SLOT_SHARD = _slot_shards()
_SHARD_FIRST_SLOT = tuple(_SLOT_SHARD.index(i) for i in range(SHARDS))


def new_table() -> Table:
    shard_dicts: list[dict[Any, int]] = [{} for _ in range(SHARDS)]
    return tuple(shard_dicts[i] for i in _SLOT_SHARD)


def shards(table: Table) -> list[dict[Any, int]]:
    """The distinct dicts of a table, each once."""
    return [table[i] for i in _SHARD_FIRST_SLOT]


HashMap = U64Map
"""An engine's hash map: engine block hash (int or bytes) -> content key (indexer/u64map.py)."""
