"""The index's big maps: uint64 -> uint64 in segments that grow at different moments.

The index keeps millions of entries in a few residency maps (content key -> mask of engines)
and one hash map per engine (engine block hash -> content key). Two things shape them:

* **Size.** A dict entry (hash, key and value pointers, index) plus an int object for its key
  and often one for its value costs several times the 16 bytes of the C type
  ``indexer._native.U64Map`` (indexer/_u64map.c), which keeps a uint64 key and a uint64 value in
  an open-addressing table (linear probing, deletion by backward shift: churn leaves no
  tombstones), at most 5/8 full. Entries that are not two uint64 -- bytes hashes from vLLM's
  sha256 modes, negative ints, key 0, masks of engines past slot 63 -- go to a side dict inside
  the map, so it answers exactly as a dict does for any key and value.
* **Growth stalls.** Growing an open-addressing table (or a dict) re-inserts every entry at once,
  and a map of millions would stop the event loop for the whole re-insertion; while the
  subscriber catches up with what queued meanwhile, the lag stays high for several times that.
  So a map is ``SEGMENTS`` segments, each growing on its own, and a key's segment is
  ``slot = key & SLOT_MASK`` (``hash(key) & SLOT_MASK`` for a key that is not an int) mapped to
  a segment that owns a share of the 1024 slots proportional to ``2 ** (i / 16)``: unequal
  shares reach their growth points at different moments (equal ones would all grow together,
  which splits the work but not the stall).

  Bound: one growth step re-inserts one segment, at most the largest share, 87/1024 (8.5 %) of
  the map's entries, plus the chance deviation of a segment's fill (keys are uniform hashes).
  Maps filled at the same rate (the hash maps of 16 engines under the same load) still grow
  their segment ``i`` at about the same moment; but that is 1/12 of their entries, where unsplit
  maps would all re-insert every entry within the same few milliseconds.
  The C map goes further: a growing segment of 1,024 places or more keeps its old table and
  moves 64 places of it (finishing the probe run it is in) per insertion or removal, lookups
  looking in both meanwhile, so no single operation re-inserts a segment (indexer/_u64map.c,
  ``MIGRATE_STEPS``); ``growth_moves()`` counts the entries moved so far.

:class:`PyU64Map` is the pure-Python reference with the same API and the same segments (one
dict each), used when the extension is not built; ``U64Map`` is whichever is in use. Both have
the dict API the index uses (get, ``in``, ``[]``, ``del``, len, iteration, keys / values /
items as iterators, pop, setdefault, clear), ``get_many(keys, default)`` (the lookups of a list
of keys, which C overlaps in memory), ``segment_of(key)``, ``segment_keys(i)`` and
``segment_sizes()`` (entries and bytes per segment). Keys are ints, bytes, str or tuples (a
float key equal to an int would not find the int's entry, as it would in a dict).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from itertools import chain, repeat
from typing import Any

from indexer.keys import _native

__all__ = ["NATIVE_MAP", "SEGMENTS", "SLOTS", "SLOT_MASK", "PyU64Map", "U64Map"]

SEGMENTS = 16
SLOTS = 1024
SLOT_MASK = SLOTS - 1


def _slot_segments() -> tuple[int, ...]:
    """Slot -> segment, segment ``i`` owning a share of slots proportional to ``2 ** (i / 16)``
    (indexer/_u64map.c holds the same counts)."""
    weights = [2 ** (i / SEGMENTS) for i in range(SEGMENTS)]
    total = sum(weights)
    counts = [int(SLOTS * w / total) for w in weights]
    for i in range(SLOTS - sum(counts)):
        counts[SEGMENTS - 1 - i % SEGMENTS] += 1
    return tuple(i for i, c in enumerate(counts) for _ in range(c))


_SLOT_SEGMENT = _slot_segments()


class PyU64Map:
    """The reference: one dict per segment, reached through a tuple of one reference per slot."""

    __slots__ = ("_segments", "_slots")

    def __init__(self, items: Iterable[tuple[Any, Any]] = ()) -> None:
        self._segments: list[dict[Any, Any]] = [{} for _ in range(SEGMENTS)]
        self._slots = tuple(self._segments[i] for i in _SLOT_SEGMENT)
        for k, v in items:
            self[k] = v

    def _dict(self, k: Any) -> dict[Any, Any]:
        return self._slots[(k if isinstance(k, int) else hash(k)) & SLOT_MASK]

    def get(self, k: Any, default: Any = None) -> Any:
        return self._dict(k).get(k, default)

    def get_many(self, keys: Iterable[Any], default: Any = None) -> list[Any]:
        return list(map(self.get, keys, repeat(default)))

    def __contains__(self, k: object) -> bool:
        return k in self._dict(k)

    def __getitem__(self, k: Any) -> Any:
        return self._dict(k)[k]

    def __setitem__(self, k: Any, v: Any) -> None:
        self._dict(k)[k] = v

    def __delitem__(self, k: Any) -> None:
        del self._dict(k)[k]

    def pop(self, k: Any, *default: Any) -> Any:
        return self._dict(k).pop(k, *default)

    def setdefault(self, k: Any, default: Any = None) -> Any:
        return self._dict(k).setdefault(k, default)

    def clear(self) -> None:
        for d in self._segments:
            d.clear()

    def __len__(self) -> int:
        return sum(map(len, self._segments))

    def __iter__(self) -> Iterator[Any]:
        return chain.from_iterable(self._segments)

    def keys(self) -> Iterator[Any]:
        return chain.from_iterable(self._segments)

    def values(self) -> Iterator[Any]:
        return chain.from_iterable(d.values() for d in self._segments)

    def items(self) -> Iterator[tuple[Any, Any]]:
        return chain.from_iterable(d.items() for d in self._segments)

    def segment_of(self, k: Any) -> int:
        return _SLOT_SEGMENT[(k if isinstance(k, int) else hash(k)) & SLOT_MASK]

    def segment_keys(self, i: int) -> list[Any]:
        return list(self._segments[i])

    def segment_sizes(self) -> list[tuple[int, int]]:
        return [(len(d), sys.getsizeof(d)) for d in self._segments]

    def __repr__(self) -> str:
        return f"<PyU64Map of {len(self)} entries>"


NATIVE_MAP = _native is not None
"""Whether ``U64Map`` is the C type."""

U64Map: type[PyU64Map] = _native.U64Map if _native is not None else PyU64Map  # type: ignore[assignment]
