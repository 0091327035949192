"""Big int-keyed maps split into dicts that grow at different moments.

CPython grows a dict in one step that re-inserts every entry, so a map of millions of entries
stops the event loop for the whole re-insertion when it grows, and while the subscriber catches
up with what queued meanwhile the lag stays high for several times that. The index keeps
millions of entries in a few residency maps and one hash map per engine, so:

* Every map is a *table*: a tuple of ``SLOTS`` references to ``SHARDS`` dicts: one subscript
  more per lookup. Residency tables are indexed by ``key & SLOT_MASK`` (content keys are uniform
  64-bit ints); engine hash maps by ``hash(h) & SLOT_MASK`` (vLLM hashes may be bytes). Each
  growth step is then 1/16 of the map.
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

from collections.abc import Iterable, Iterator
from itertools import chain
from typing import Any

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


class HashMap:
    """Engine block hash (int or bytes) -> content key, as a staggered table.

    The dict API the index needs, plus ``table`` for its C-level batch paths. Hashes are spread
    by ``hash(h)``, which is fixed within a process (bytes hashes are salted per process, and
    this map is never persisted as a table: snapshots list its items).
    """

    __slots__ = ("table",)

    def __init__(self, items: Iterable[tuple[Any, int]] = ()) -> None:
        self.table = new_table()
        table = self.table
        for h, key in items:
            table[hash(h) & SLOT_MASK][h] = key

    def get(self, h: Any, default: int | None = None) -> int | None:
        return self.table[hash(h) & SLOT_MASK].get(h, default)

    def __contains__(self, h: object) -> bool:
        return h in self.table[hash(h) & SLOT_MASK]

    def __getitem__(self, h: Any) -> int:
        return self.table[hash(h) & SLOT_MASK][h]

    def __setitem__(self, h: Any, key: int) -> None:
        self.table[hash(h) & SLOT_MASK][h] = key

    def __delitem__(self, h: Any) -> None:
        del self.table[hash(h) & SLOT_MASK][h]

    def __len__(self) -> int:
        return sum(map(len, shards(self.table)))

    def __iter__(self) -> Iterator[Any]:
        return chain.from_iterable(shards(self.table))

    def values(self) -> Iterator[int]:
        return chain.from_iterable(d.values() for d in shards(self.table))

    def items(self) -> Iterator[tuple[Any, int]]:
        return chain.from_iterable(d.items() for d in shards(self.table))
