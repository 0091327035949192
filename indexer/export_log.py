"""What an engine held when an export began, for the entries changed since.

A chunked export (indexer/snapshot.py) reads an engine a slice at a time while its events keep
being applied in between. Each change to the engine first records the entry's value as it was
at the export's cut (the first change of an entry wins), so that "the recorded value if any,
else the live one" is the cut's value at any time during the export: a copy-on-write of only
what changes, instead of a copy of the whole engine.
"""

from __future__ import annotations

from collections.abc import Iterable

from indexer.staggered import HashMap, Table
from indexer.u64map import SEGMENTS
from indexer.wire import BlockHash

__all__ = ["ExportLog"]


class ExportLog:
    """Pre-images of one engine's entries changed since an export's cut."""

    __slots__ = ("by_segment", "hashes", "resident")

    def __init__(self) -> None:
        self.hashes: dict[BlockHash, tuple[int | None, int]] = {}
        """Engine hash -> (content key or None when unmapped, extra references) at the cut."""
        self.by_segment: list[list[BlockHash]] = [[] for _ in range(SEGMENTS)]
        """The hashes of ``hashes`` that were mapped at the cut, by their segment of the map:
        an export reading one segment looks at its own share of the log, not all of it."""
        self.resident: dict[tuple[int, str], dict[int, bool]] = {}
        """(group, medium) -> content key -> whether the engine held it at the cut."""

    def before_hashes(
        self, hashes: Iterable[BlockHash], hmap: HashMap, extra: dict[BlockHash, int]
    ) -> None:
        """``hashes`` of the engine's map ``hmap`` (with ``extra`` references) may change."""
        log = self.hashes
        for h in hashes:
            if h not in log:
                key = hmap.get(h)
                log[h] = (key, extra.get(h, 0))
                if key is not None:
                    self.by_segment[hmap.segment_of(h)].append(h)

    def before_blocks(
        self, g: int, medium: str, res: Table, bit: int, keys: Iterable[int | None]
    ) -> None:
        """The engine's (``bit``) residency of ``keys`` in ``res`` = (g, medium) may change."""
        log = self.resident.setdefault((g, medium), {})
        for k in keys:
            if k is not None and k not in log:
                log[k] = bool(res.get(k, 0) & bit)
