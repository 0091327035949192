"""One engine's exact index state as msgpack, for Redis snapshots.

A new router replica imports an engine's snapshot and replays only the sequence numbers after
it. Size is bounded by the engine's resident blocks (about 30 bytes per block). Exporting runs
in slices (:class:`EngineExport`): encoding is proportional to the engine's size, so the router
spreads it over its event loop while the engine's events keep being applied.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator, Iterator
from itertools import compress, repeat
from typing import Any

import msgspec

from indexer.engine_state import EngineState
from indexer.export_log import ExportLog
from indexer.residency import Residency
from indexer.staggered import HashMap, Table, new_table
from indexer.types import GroupSpec
from indexer.u64map import SEGMENTS
from indexer.wire import BlockHash

__all__ = [
    "EngineExport",
    "EngineSnapshot",
    "ExportAborted",
    "decode_snapshot",
    "encode_snapshot",
    "restore_snapshot",
]


class EngineSnapshot(msgspec.Struct, array_like=True, gc=False):
    model: str
    hashes: list[tuple[BlockHash, int, int]]  # (engine hash, content key, references)
    groups: list[tuple[int, str, int, int | None, int | None]]
    resident: list[tuple[int, str, list[int]]]  # (group, medium, content keys)
    dups: list[tuple[int, str, int, int]]  # (group, medium, content key, extra copies)


def encode_snapshot(residency: Residency, e: EngineState) -> bytes:
    """Engine ``e``'s state as msgpack, in one go."""
    return b"".join(EngineExport(residency, e, track=False))


class ExportAborted(RuntimeError):
    """The engine was reset (cleared, dropped, re-imported) while its export was under way."""


class EngineExport:
    """Engine ``e``'s snapshot as of this object's creation (the *cut*), encoded a slice at a
    time so that exporting a large engine never holds the event loop for long.

    Iterating yields pieces of the msgpack bytes (most of them empty: work done, nothing to emit
    yet), each after at most :data:`SLICE` entries of work; their concatenation is what
    :func:`encode_snapshot` would have returned at the cut. The engine's events may be applied
    between pieces: each change records the cut's value first (indexer/export_log.py). Raises
    :class:`ExportAborted` if the engine is reset meanwhile. ``close()`` (or exhausting the
    iterator) stops the recording; ``track=False`` records nothing, for an export that runs to
    the end with no event applied in between.
    """

    def __init__(self, residency: Residency, e: EngineState, track: bool = True) -> None:
        self._e = e
        self._hmap = e.hashes
        self._extra = e.extra_refs
        self._model = e.model
        self._groups = [
            (g, s.kind, s.block_size, s.sliding_window, s.attention_chunk)
            for g, s in e.groups.items()
        ]
        self._dups = [
            (g, m, k, n) for (slot, g, m, k), n in residency.dups.items() if slot == e.slot
        ]
        self._tables = list(residency.tables.items())
        self._log = ExportLog()
        self._tracked = track
        if track:
            e.exports.append(self._log)

    def close(self) -> None:
        """Stop recording the engine's changes (idempotent)."""
        if self._tracked:
            self._tracked = False
            self._e.exports.remove(self._log)

    def __iter__(self) -> Iterator[bytes]:
        try:
            # The content keys the engine names, each once: a U64Map, not a set, so that they
            # cost 16 bytes each, the collector never traverses them, and they grow at staggered
            # moments (indexer/u64map.py).
            held = new_table()
            hashes: list[bytes] = []
            n_hashes = 0
            for segment in range(SEGMENTS):
                for part, keys in self._segment_hashes(segment):
                    if part:
                        hashes.append(part)
                    n_hashes += len(keys)
                    _consume(map(held.__setitem__, keys, repeat(0)))
                    yield b""
            resident: list[list[bytes]] = []
            for (g, medium), res in self._tables:
                entry = yield from self._resident(g, medium, res, held)
                if entry:
                    resident.append(entry)
            yield b"\x95" + _enc(self._model) + _array_header(n_hashes)
            yield from hashes
            yield _enc(self._groups) + _array_header(len(resident))
            for entry in resident:
                yield from entry
            held.clear()  # a few blocks to free, no object per entry
            yield _enc(self._dups)
        finally:
            self.close()

    def _check(self) -> None:
        if self._e.hashes is not self._hmap or self._e.extra_refs is not self._extra:
            raise ExportAborted(f"engine {self._e.engine} was reset during its export")

    def _segment_hashes(self, segment: int) -> Iterator[tuple[bytes, list[int]]]:
        """One segment of the hash map as it was at the cut: (encoded triples, their keys) per
        slice."""
        self._check()
        log = self._log.hashes
        hmap = self._hmap
        # The segment now, and (in the same step) what it held at the cut but lost since: only
        # the log still knows those, and it lists them by segment.
        todo = hmap.segment_keys(segment)
        todo.extend(h for h in self._log.by_segment[segment] if h not in hmap)
        yield b"", []
        extra = self._extra
        for i in range(0, len(todo), SLICE):
            self._check()
            hs = todo[i : i + SLICE]
            keys = list(map(hmap.get, hs))
            refs = list(map(_ONE.__add__, map(extra.get, hs, repeat(0))))
            if log:
                # Hashes changed since the cut take their logged values (C-level passes
                # find the few; a removed one is no longer in the map).
                changed = list(compress(range(len(hs)), map(log.__contains__, hs)))
                for j in changed:
                    key, x = log[hs[j]]
                    keys[j] = key
                    refs[j] = 1 + x
                if any(keys[j] is None for j in changed):  # stored after the cut
                    kept = [k is not None for k in keys]
                    hs = list(compress(hs, kept))
                    refs = list(compress(refs, kept))
                    keys = list(compress(keys, kept))
            triples = list(map(_Held, hs, keys, refs))
            yield _items(triples), keys

    def _resident(
        self, g: int, medium: str, res: Table, keys: Table
    ) -> Generator[bytes, None, list[bytes]]:
        """Which of ``keys`` the engine held in (g, medium) at the cut: the encoded
        ``(g, medium, keys)`` entry in pieces (none if it held none), one slice per yield."""
        bit = self._e.bit
        parts: list[bytes] = []
        n = 0
        for ks in _slices(keys):
            self._check()
            masks = res.get_many(ks, 0)
            flags = list(map(bit.__and__, masks))
            log = self._log.resident.get((g, medium))
            if log:  # keys changed since the cut take their logged values
                for i in compress(range(len(ks)), map(log.__contains__, ks)):
                    flags[i] = log[ks[i]]
            members = list(compress(ks, flags))
            if members:
                parts.append(_items(members))
                n += len(members)
            yield b""
        if not n:
            return []
        return [b"\x93" + _enc(g) + _enc(medium) + _array_header(n), *parts]


class _Held(msgspec.Struct, array_like=True, gc=False):
    """One ``EngineSnapshot.hashes`` entry, encoded alike. Not a tuple: a million tuples made
    in a few seconds would set off full garbage collections, each a pause of the loop."""

    h: BlockHash
    key: int
    refs: int


SLICE = 2048
"""Entries read or encoded per piece of an export."""

_consume = deque(maxlen=0).extend


def _slices(table: Table) -> Iterator[list[int]]:
    """The keys of ``table`` (not changed meanwhile), at most :data:`SLICE` at a time."""
    for segment in range(SEGMENTS):
        keys = table.segment_keys(segment)
        for i in range(0, len(keys), SLICE):
            yield keys[i : i + SLICE]


_ONE = 1
_enc = msgspec.msgpack.Encoder().encode


def _array_header(n: int) -> bytes:
    """msgpack's header of an array of ``n`` items (the shortest form, as msgspec writes it)."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def _items(values: list[Any]) -> bytes:
    """The msgpack encoding of the items of ``values`` without the array's header."""
    return _enc(values)[len(_array_header(len(values))) :]


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
            res[k] = res.get(k, 0) | bit
        e.resident[(g, medium)] = e.resident.get((g, medium), 0) + len(keys)
        residency.total += len(keys)
    for g, medium, k, n in state.dups:
        residency.dups[(e.slot, g, medium, k)] = n
