"""Which engines hold which block: bitmasks per (group, medium), with reference counts.

Data layout (why it is fast and small):

* Engines get a *slot*; an engine is one bit ``1 << slot``.
* ``tables[(group_idx, medium)]`` maps a content key to an int bitmask of the engines holding
  that block. Matching a prompt is then one lookup and one ``&`` per block boundary for the
  whole fleet at once, not per engine.
* That map is a *table*, a U64Map (indexer/u64map.py): uint64 key -> uint64 mask in 16 bytes,
  in segments of unequal shares that grow (re-insert their entries) at staggered moments, so
  the event loop never stops for the whole map; masks past 64 bits sit in its side dicts.
* Each engine keeps ``hashes``: engine hash -> content key (a U64Map, indexer/u64map.py),
  and ``extra_refs``: engine hash -> references beyond the first (rare: the same hash stored in
  several groups or media, or stored again). A hash's references count every (group, medium)
  residency of it on that engine, so the mapping lives exactly as long as the engine holds the
  block somewhere -- which is as long as vLLM can name it as a parent or resolve a sparse or
  placeholder event through it. The common case is then C-level ``map`` passes per event with
  plain 64-bit values.
* Duplicates (vLLM does not de-duplicate) are rare, so extra copies live in a side dict
  ``dups[(slot, group, medium, key)]`` instead of a counter on every entry.

:meth:`Residency.store_packed` and :meth:`Residency.remove_packed` do the same work in C
(indexer/_residency.c) for events whose hashes arrive packed (indexer/wire.py ``PackedEvents``);
they leave the rare cases (duplicates, hashes already mapped, exports in progress) to the Python
methods here, which are the reference.
"""

from __future__ import annotations

from array import array
from collections import deque
from operator import eq

from indexer.engine_state import EngineState, next_epoch
from indexer.keys import _native
from indexer.staggered import HashMap, Table, new_table
from indexer.wire import BlockHash

__all__ = ["NATIVE_INGEST", "Residency"]

_consume = deque(maxlen=0).extend

NATIVE_INGEST = _native is not None
"""Whether ``store_packed`` / ``remove_packed`` can run (the C extension is built)."""

STORE_BAIL = -1
STORE_REANNOUNCED = -2


class Residency:
    """The residency tables of every engine, the duplicate copies and the entry count."""

    __slots__ = ("dups", "tables", "total")

    def __init__(self) -> None:
        self.tables: dict[tuple[int, str], Table] = {}
        self.dups: dict[tuple[int, int, str, int], int] = {}
        self.total = 0
        """Resident (engine, group, medium, block) entries over all engines."""

    def table(self, g: int, medium: str) -> Table:
        """The table of (group, medium), created empty on first use."""
        res = self.tables.get((g, medium))
        if res is None:
            res = self.tables[(g, medium)] = new_table()
        return res

    def add_many(
        self,
        e: EngineState,
        g: int,
        medium: str,
        res: Table,
        hashes: list[BlockHash],
        keys: list[int],
    ) -> None:
        """Engine ``e`` holds the blocks ``keys`` (named ``hashes`` by it) in table ``res``."""
        bit = e.bit
        hmap = e.hashes
        known = any(map(hmap.__contains__, hashes))
        if known:
            keys = _mapped_keys(e, hmap, hashes, keys)
        for log in e.exports:  # an export is reading this engine: keep the cut's values
            log.before_hashes(hashes, hmap, e.extra_refs)
            log.before_blocks(g, medium, res, bit, keys)
        # The whole event in C-level passes (map/update) rather than a Python loop per block:
        # this is what makes ingest fast. Duplicates (a block already resident on this engine,
        # group and medium) are rare and take the slow loop.
        before = res.get_many(keys, 0)
        after = list(map(bit.__or__, before))
        if any(map(eq, after, before)):
            added = 0
            dups = self.dups
            for key, m, m_new in zip(keys, before, after, strict=True):
                if m_new == m:
                    dk = (e.slot, g, medium, key)
                    dups[dk] = dups.get(dk, 0) + 1
                    e.counters["duplicates"] += 1
                else:
                    res[key] = m_new
                    added += 1
        else:
            _consume(map(res.__setitem__, keys, after))
            added = len(keys)
        # One more reference per hash; a hash already mapped keeps its key (first store wins).
        if not known:
            _consume(map(hmap.__setitem__, hashes, keys))
        else:
            extra = e.extra_refs
            for h, key in zip(hashes, keys, strict=False):
                if h in hmap:
                    extra[h] = extra.get(h, 0) + 1
                else:
                    hmap[h] = key
        if added:
            gm = (g, medium)
            e.resident[gm] = e.resident.get(gm, 0) + added
            self.total += added
        e.counters["blocks_stored"] += len(keys)

    def add(self, e: EngineState, g: int, medium: str, h: BlockHash, key: int) -> None:
        """Engine ``e`` holds one block ``key``, named ``h`` by it."""
        self.add_many(e, g, medium, self.table(g, medium), [h], [key])

    def remove(
        self,
        e: EngineState,
        block_hashes: list[BlockHash],
        g: int,
        medium: str,
        unknown_sink: set[BlockHash] | None,
    ) -> None:
        """Engine ``e`` no longer holds the blocks it names ``block_hashes`` in (g, medium).

        Hashes it does not hold there are counted in ``unknown_removes`` and added to
        ``unknown_sink`` when one is given (events waiting for a parent must not bring them back).
        """
        # Hot path: vLLM's GPU pool sends one BlockRemoved per evicted block, so per-event
        # overhead matters as much as per-block work. Counters are summed locally, and the
        # duplicate and extra-reference tables are consulted only when non-empty (both rare).
        res = self.tables.get((g, medium))
        bit = e.bit
        for log in e.exports:  # an export is reading this engine: keep the cut's values
            log.before_hashes(block_hashes, e.hashes, e.extra_refs)
            if res is not None:
                log.before_blocks(g, medium, res, bit, map(e.hashes.get, block_hashes))
        others = ~bit
        extra_refs = e.extra_refs
        dups = self.dups
        removed = unknown = cleared = 0
        hmap = e.hashes
        for h in block_hashes:
            key = hmap.get(h)
            if key is None or res is None:
                unknown += 1
                if unknown_sink is not None:
                    unknown_sink.add(h)
                continue
            m = res.get(key, 0)
            if not m & bit:
                unknown += 1
                if unknown_sink is not None:
                    unknown_sink.add(h)
                continue
            extra = dups.get((e.slot, g, medium, key)) if dups else None
            if extra:
                dk = (e.slot, g, medium, key)
                if extra == 1:
                    del dups[dk]
                else:
                    dups[dk] = extra - 1
            else:
                m &= others
                if m:
                    res[key] = m
                else:
                    del res[key]
                cleared += 1
            refs = extra_refs.get(h) if extra_refs else None
            if refs is None:
                del hmap[h]
            elif refs == 1:
                del extra_refs[h]
            else:
                extra_refs[h] = refs - 1
            removed += 1
        if cleared:
            e.resident[(g, medium)] -= cleared
            self.total -= cleared
        counters = e.counters
        if removed:
            counters["blocks_removed"] += removed
        if unknown:
            counters["unknown_removes"] += unknown

    def store_packed(
        self,
        e: EngineState,
        g: int,
        medium: str,
        seed: int | None,
        parent: int | None,
        hashes: bytes,
        tokens: bytes,
        unit: int,
        block_size: int,
        decided: dict[int, bool] | None,
    ) -> int:
        """A dense full-attention store of packed ``hashes`` over packed ``tokens``, in C.

        Content keys chain from ``seed``, or from the key ``parent`` is mapped to. ``decided``:
        the batch's re-announce verdicts, when the store is from token 0 on a GPU that holds
        blocks (ingest.py ``_is_reannounce``). Returns the blocks stored, ``STORE_REANNOUNCED``,
        or ``STORE_BAIL`` -- nothing changed, the Python path must apply the event: an unknown
        parent, a duplicate, a hash already mapped, a re-announce to judge in full, an export
        in progress, or a table not created yet.
        """
        res = self.tables.get((g, medium))
        if res is None or e.exports:
            return STORE_BAIL
        code: int = _native.store_dense(  # type: ignore[union-attr]
            res, e.hashes, e.bit, seed, parent, hashes, tokens, unit, block_size, decided
        )
        if code > 0:
            self.stored(e, g, medium, code)
        return code

    def store_run(
        self,
        e: EngineState,
        res: Table,
        records: list[tuple[object, ...]],
        start: int,
        model_seed: int,
        unit: int,
        block_size: int,
        g: int,
        kind: str | None,
        window: int | None,
        decided: dict[int, bool],
    ) -> tuple[int, int, int]:
        """:meth:`store_packed` over the packed stored records from ``start`` on, in one C call,
        for an engine with the one full-attention group ``g`` of ``block_size`` (``kind`` and
        ``window``: its learned facts at that size, None: none). It stops at the first record
        that is not such a store from a parent or from ``model_seed`` (the model's root), or
        that :meth:`store_packed` would leave to Python; (that record's index, blocks stored,
        re-announces). The caller counts them (:meth:`stored`); no export may be in progress.
        """
        return _native.store_run(  # type: ignore[no-any-return, union-attr]
            res,
            e.hashes,
            e.bit,
            records,
            start,
            model_seed,
            unit,
            block_size,
            g,
            kind,
            window,
            e.resident,
            decided,
        )

    def stored(self, e: EngineState, g: int, medium: str, added: int) -> None:
        """Count ``added`` blocks newly held by ``e`` in (g, medium)."""
        gm = (g, medium)
        e.resident[gm] = e.resident.get(gm, 0) + added
        self.total += added
        e.counters["blocks_stored"] += added

    def remove_packed(
        self,
        e: EngineState,
        hashes: bytes,
        g: int,
        medium: str,
        unknown_sink: set[BlockHash] | None,
    ) -> None:
        """:meth:`remove` for packed uint64 ``hashes``, in C unless an export is reading ``e``."""
        if e.exports:
            a = array("Q")
            a.frombytes(hashes)
            self.remove(e, a.tolist(), g, medium, unknown_sink)
            return
        removed, unknown, cleared = _native.remove_hashes(  # type: ignore[union-attr]
            self.tables.get((g, medium)),
            e.hashes,
            e.bit,
            hashes,
            self.dups,
            e.extra_refs,
            (e.slot, g, medium),
            unknown_sink,
        )
        if cleared:
            e.resident[(g, medium)] -= cleared
            self.total -= cleared
        if removed:
            e.counters["blocks_removed"] += removed
        if unknown:
            e.counters["unknown_removes"] += unknown

    def drop(self, e: EngineState) -> None:
        """Forget everything engine ``e`` holds, on every group and medium.

        Its stores waiting for a parent go too: they chain from hashes dropped here.
        """
        bit = e.bit
        keep = ~bit
        keys = set(e.hashes.values())
        for res in self.tables.values():
            for key in keys:
                m = res.get(key)
                if m is not None and m & bit:
                    m &= keep
                    if m:
                        res[key] = m
                    else:
                        del res[key]
        if self.dups:
            for dk in [dk for dk in self.dups if dk[0] == e.slot]:
                del self.dups[dk]
        self.total -= sum(e.resident.values())
        e.resident.clear()
        e.epoch = next_epoch()
        e.hashes = HashMap()
        e.extra_refs = {}
        e.pending.clear()
        e.pending_removed.clear()

    def holds(self, e: EngineState, g: int, medium: str, key: int) -> bool:
        """Whether engine ``e`` holds the block ``key`` in (g, medium)."""
        res = self.tables.get((g, medium))
        return bool(res is not None and res.get(key, 0) & e.bit)


def _mapped_keys(
    e: EngineState, hmap: HashMap, hashes: list[BlockHash], keys: list[int]
) -> list[int]:
    """``keys`` with every hash the engine already names replaced by the key it is mapped to.

    The engine hash is the block's identity: a key recomputed from a later event may differ
    (a CPU chunk of a salted or multimodal prompt carries no extra keys, so its first chunk
    chains from the unsalted, extra-less root). Writing residency under that key would predict
    hits in the wrong namespace and leave an entry no BlockRemoved or reset can find, as both
    go through the hash map. Differences are counted in ``key_mismatch``.
    """
    out = list(keys)
    mismatch = 0
    for i, h in enumerate(hashes):
        mapped = hmap.get(h)
        if mapped is not None and mapped != out[i]:
            out[i] = mapped
            mismatch += 1
    if mismatch:
        e.counters["key_mismatch"] += mismatch
    return out
