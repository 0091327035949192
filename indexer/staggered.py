"""The index's big maps by role: residency tables and engine hash maps, both U64Maps.

A U64Map (indexer/u64map.py: the C type when built, else its pure-Python reference) keeps a
uint64 key and value in 16 bytes and grows a segment at a time, at staggered moments, so that
no growth stops the event loop for the whole map; any other key or value goes to a side dict.
"""

from __future__ import annotations

from indexer.u64map import SLOT_MASK, SLOTS, PyU64Map, U64Map

__all__ = ["EMPTY_TABLE", "SLOTS", "SLOT_MASK", "HashMap", "Table", "new_table"]

Table = PyU64Map
"""A residency table: content key -> bitmask of the engines holding the block (``U64Map``;
annotated with the reference class, whose API the C type has)."""

HashMap = U64Map
"""An engine's hash map: engine block hash (int or bytes) -> content key."""

EMPTY_TABLE: Table = U64Map()  # never written


def new_table() -> Table:
    return U64Map()
