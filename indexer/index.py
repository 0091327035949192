"""The prefix index: which engine holds which prefix, per KV-cache group and medium.

A pure data structure (no I/O, no clocks): ``apply(engine, events)`` and ``match(...)``.
See design.md; the decisions that make it exact are written next to the code that makes them.

Data layout (why it is fast and small in pure Python):

* Engines get a *slot*; an engine is one bit ``1 << slot``.
* ``_residency[(group_idx, medium)]`` maps a content key to an int bitmask of the engines holding
  that block. Matching a prompt is then one dict lookup and one ``&`` per block boundary for the
  whole fleet at once, not per engine.
* That map is a *table* (indexer/staggered.py): a tuple of 1024 references to 16 dicts of
  unequal shares, indexed by ``key & SLOT_MASK``, so that CPython's all-at-once dict growth
  stops the event loop for 1/16 of the map at a time, at staggered moments.
* Each engine keeps ``hashes``: engine hash -> content key (a :class:`HashMap`, a table too),
  and ``extra_refs``: engine hash -> references beyond the first (rare: the same hash stored in
  several groups or media, or stored again). A hash's references count every (group, medium)
  residency of it on that engine, so the mapping lives exactly as long as the engine holds the
  block somewhere -- which is as long as vLLM can name it as a parent or resolve a sparse or
  placeholder event through it. The common case is then C-level ``map`` passes per event with
  plain 64-bit values.
* Duplicates (vLLM does not de-duplicate) are rare, so extra copies live in a side dict
  ``_dups[(slot, group, medium, key)]`` instead of a counter on every entry.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import eq
from typing import Any

import msgspec

from indexer.keys import DEFAULT_UNIT, chain_keys, mix_extra, namespace_root, tokens_to_bytes
from indexer.native import run_scan
from indexer.staggered import EMPTY_TABLE, SLOT_MASK, HashMap, Table, new_table
from indexer.vllm_hash import VllmHashLocator
from indexer.wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event

__all__ = [
    "EngineId",
    "EngineStats",
    "GroupHit",
    "GroupSpec",
    "PrefixIndex",
    "PrefixMatch",
    "group_kind",
]

EngineId = tuple[str, int]
"""(worker id, data-parallel rank): one vLLM scheduler with its own cache and sequence numbers."""

GPU = "GPU"
CPU = "CPU"

_consume = deque(maxlen=0).extend

FULL = "full_attention"
SLIDING = "sliding_window"
MAMBA = "mamba"
CHUNKED = "chunked_local_attention"


def group_kind(spec_kind: str | None) -> str:
    """Map vLLM's ``kv_cache_spec_kind`` onto the hit rule it follows.

    MLA, sink-full and cross attention follow the full-attention rule (a prefix run).
    """
    if not spec_kind:
        return FULL
    kind = spec_kind.lower()
    if "sliding" in kind:
        return SLIDING
    if "mamba" in kind or "ssm" in kind or "linear" in kind:
        return MAMBA
    if "chunk" in kind:
        return CHUNKED
    return FULL


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """What the hit rule needs to know of one KV-cache group."""

    kind: str
    block_size: int
    sliding_window: int | None = None  # tokens, sliding-window groups
    attention_chunk: int | None = None  # tokens, chunked local attention groups


class GroupHit(msgspec.Struct, gc=False):
    """Per-group explanation of a match, for /debug."""

    group_idx: int
    kind: str
    block_size: int
    hit_tokens: int
    """Longest point this group alone allows (<= the full-attention run)."""
    sliding_window: int | None = None


class PrefixMatch(msgspec.Struct, gc=False):
    gpu_tokens: int
    """Tokens vLLM's scheduler will find computed in the GPU prefix cache."""
    cpu_tokens: int
    """Further tokens loadable from CPU-offloaded chunks (a transfer, not a prefill)."""
    groups: list[GroupHit]


class EngineStats(msgspec.Struct):
    engine: EngineId
    model: str
    groups: dict[int, dict[str, Any]]
    resident: dict[str, int]
    """Resident blocks per "group_idx/medium"."""
    hashes: int
    counters: dict[str, int]


@dataclass(slots=True)
class _Engine:
    engine: EngineId
    slot: int
    model: str
    hashes: HashMap = field(default_factory=HashMap)
    extra_refs: dict[BlockHash, int] = field(default_factory=dict)
    groups: dict[int, GroupSpec] = field(default_factory=dict)
    configured_groups: dict[int, GroupSpec] = field(default_factory=dict)
    group_facts: dict[int, tuple[str | None, int, int | None]] = field(default_factory=dict)
    resident: dict[tuple[int, str], int] = field(default_factory=dict)
    pending: list[tuple[BlockStored, int]] = field(default_factory=list)
    pending_removed: set[BlockHash] = field(default_factory=set)
    locator: VllmHashLocator | None = None
    bit: int = 0
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_COUNTERS, 0))


_COUNTERS = (
    "batches",
    "blocks_stored",
    "blocks_removed",
    "cleared",
    "duplicates",
    "reannounced",
    "unknown_parent",
    "pending_applied",
    "pending_expired",
    "unresolved_hashes",
    "unknown_removes",
    "unaligned_blocks",
    "malformed_events",
    "overflow_resets",
)


class PrefixIndex:
    """Exact, hybrid-aware index of every engine's prefix cache.

    ``unit``: tokens per content-key step; must divide every block size in use (events with a
    block size it does not divide are counted in ``unaligned_blocks`` and dropped).
    ``cpu_chunk_tokens``: CPU offload chunk size (vLLM's ``kv_connector_extra_config.block_size``).
    ``max_entries``: cap on resident (engine, group, medium, block) entries over all engines.
    Exceeding it means events were lost (missed removals) or the cap is too small for the fleet;
    the rule is: the engine holding the most entries is reset (its state dropped, counter
    ``overflow_resets``) so the index never exceeds the cap and never keeps entries it cannot
    vouch for. The caller (the subscriber) marks that engine degraded until events rebuild it.
    ``pending_batches``: how many later batches an event with an unknown parent waits for its
    parent (replay may fill the gap) before it is dropped (``pending_expired``).
    ``vllm_hash_seed`` / ``locator_entries``: for models with no full-attention group only, sparse
    hashes are located by recomputing vLLM's default hash chain (see indexer/vllm_hash.py), with
    this seed (vLLM's default, or the workers' PYTHONHASHSEED) and a bounded memory per engine.
    """

    def __init__(
        self,
        unit: int = DEFAULT_UNIT,
        cpu_chunk_tokens: int = 256,
        max_entries: int = 5_000_000,
        pending_batches: int = 8,
        max_pending_events: int = 256,
        vllm_hash_seed: str = "vllm-none-hash",
        locator_entries: int = 32_768,
    ) -> None:
        if unit <= 0 or cpu_chunk_tokens % unit:
            raise ValueError("unit must be positive and divide cpu_chunk_tokens")
        self.unit = unit
        self.cpu_chunk_tokens = cpu_chunk_tokens
        self.max_entries = max_entries
        self.pending_batches = pending_batches
        self.max_pending_events = max_pending_events
        self.vllm_hash_seed = vllm_hash_seed
        self.locator_entries = locator_entries
        self._engines: dict[EngineId, _Engine] = {}
        self._by_slot: dict[int, _Engine] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._residency: dict[tuple[int, str], Table] = {}
        self._dups: dict[tuple[int, int, str, int], int] = {}
        self._roots: dict[tuple[str, str | None], int] = {}
        self.total_entries = 0
        self.overflowed: list[EngineId] = []
        """Engines reset by the cap since the caller last cleared this list."""

    # ------------------------------------------------------------------ engines

    def add_engine(
        self,
        engine: EngineId,
        model: str = "",
        groups: dict[int, GroupSpec] | None = None,
    ) -> None:
        """Register an engine and the base model name its events belong to.

        ``groups`` gives group facts for vLLM versions whose events do not carry
        ``kv_cache_spec_kind`` (before 0.24); facts learned from events take precedence.
        """
        e = self._engines.get(engine)
        if e is None:
            e = self._new_engine(engine, model)
        e.model = model
        if groups:
            e.configured_groups = dict(groups)

    def _new_engine(self, engine: EngineId, model: str = "") -> _Engine:
        slot = self._free_slots.pop() if self._free_slots else self._next_slot
        if slot == self._next_slot:
            self._next_slot += 1
        e = _Engine(engine, slot, model, bit=1 << slot)
        self._engines[engine] = e
        self._by_slot[slot] = e
        return e

    def remove_engine(self, engine: EngineId) -> None:
        """Forget an engine entirely (worker left, or restarted)."""
        e = self._engines.pop(engine, None)
        if e is None:
            return
        self._drop_state(e)
        del self._by_slot[e.slot]
        self._free_slots.append(e.slot)

    def clear_engine(self, engine: EngineId) -> None:
        """Drop everything an engine holds on every medium (``AllBlocksCleared``, resets)."""
        e = self._engines.get(engine)
        if e is not None:
            self._drop_state(e)

    def engines(self) -> list[EngineId]:
        return list(self._engines)

    def has_engine(self, engine: EngineId) -> bool:
        return engine in self._engines

    # ------------------------------------------------------------------ apply

    def apply(self, engine: EngineId, events: Sequence[Event]) -> None:
        """Apply one batch of events of one engine, in list order (vLLM's order)."""
        e = self._engines.get(engine) or self._new_engine(engine)
        e.counters["batches"] += 1
        lookahead: dict[BlockHash, int] | None = None
        # One re-announce decision per prefix per batch: vLLM sends one event per group for the
        # same request step, and storing the first must not change how the next is judged.
        reannounce: dict[int, bool] = {}
        i, n = 0, len(events)
        while i < n:
            ev = events[i]
            kind = type(ev)
            i += 1
            if kind is BlockStored:
                if not self._store(e, ev, reannounce):  # type: ignore[arg-type]
                    continue
                # A sparse event listed hashes we could not resolve yet: vLLM sends the
                # sliding-window group's event *before* the full-attention group's event of the
                # same step (group order), so learn the mappings the rest of this batch brings.
                if lookahead is None:
                    lookahead = self._learn_ahead(e, events, i)
                self._store_sparse(e, ev, lookahead)  # type: ignore[arg-type]
            elif kind is BlockRemoved:
                # vLLM's GPU pool sends one single-hash BlockRemoved per evicted block, in runs:
                # a run with one group and medium is applied as one pass (same order, same
                # result, a fraction of the per-event cost).
                g = ev.group_idx or 0  # type: ignore[union-attr]
                medium = ev.medium or GPU  # type: ignore[union-attr]
                hashes = ev.block_hashes  # type: ignore[union-attr]
                if i < n and type(events[i]) is BlockRemoved:
                    hashes = list(hashes)
                    while i < n:
                        nxt = events[i]
                        if (
                            type(nxt) is not BlockRemoved
                            or (nxt.group_idx or 0) != g  # type: ignore[union-attr]
                            or (nxt.medium or GPU) != medium  # type: ignore[union-attr]
                        ):
                            break
                        hashes.extend(nxt.block_hashes)  # type: ignore[union-attr]
                        i += 1
                self._remove(e, hashes, g, medium)
            elif kind is AllBlocksCleared:
                self._drop_state(e)
                e.counters["cleared"] += 1
        if e.pending:
            self._retry_pending(e)
        if self.total_entries > self.max_entries:
            self._enforce_cap()

    def _root(self, e: _Engine, ev: BlockStored, extra0: Any) -> tuple[int, Any]:
        """Namespace root of a chain that starts at token 0, and block 0's remaining extras.

        vLLM's event ``extra_keys`` are untagged (0.24+ events): per block, the LoRA name, then
        multimodal ``(id, offset)`` items, then the ``cache_salt`` string (block 0 only), then a
        prompt-embeds digest. The LoRA name is the namespace already; on block 0 the first
        remaining string is the salt.
        """
        salt: str | None = None
        rest = extra0
        if extra0 is not None:
            items = [x for x in _as_tuple(extra0) if x != ev.lora_name or ev.lora_name is None]
            for j, item in enumerate(items):
                if isinstance(item, str):
                    salt = item
                    del items[j]
                    break
            rest = tuple(items) or None
        model = ev.lora_name if ev.lora_name is not None else e.model
        return self.root(model, salt), rest

    def _block_keys(self, e: _Engine, ev: BlockStored) -> list[int] | None:
        """Content key at the end of every block of ``ev``'s token range, or None (counted)."""
        bs = ev.block_size
        unit = self.unit
        if bs <= 0 or bs % unit:
            e.counters["unaligned_blocks"] += len(ev.block_hashes)
            return None
        if ev.parent_block_hash is None:
            extras = ev.extra_keys
            seed, rest0 = self._root(e, ev, extras[0] if extras else None)
            if extras:
                extras = [rest0, *extras[1:]]
        else:
            v = e.hashes.get(ev.parent_block_hash)
            if v is None:
                return None  # caller handles the unknown parent
            seed = v
            extras = ev.extra_keys
        step = bs // unit
        nblocks = len(ev.token_ids) // bs
        # Common case first: no extras at all (a C-level count, not a Python loop).
        block_extras = None
        if extras and extras.count(None) != len(extras):
            block_extras = [_strip_lora(x, ev.lora_name) for x in extras]
        try:
            data = tokens_to_bytes(ev.token_ids)
        except ValueError:  # token ids outside [0, 2**32): not a real prompt
            e.counters["malformed_events"] += 1
            return None
        if block_extras is None or block_extras.count(None) == len(block_extras):
            keys = chain_keys(seed, data, unit, nblocks * step)
            return keys[step - 1 :: step] if step > 1 else keys
        # Rare path: multimodal or prompt-embeds extras fold into the chain block by block
        # (dense events only: extra_keys has one entry per listed block).
        out: list[int] = []
        for b in range(nblocks):
            seed = chain_keys(seed, data[b * bs * 4 : (b + 1) * bs * 4], unit)[-1]
            extra = block_extras[b] if b < len(block_extras) else None
            if extra is not None:
                seed = mix_extra(seed, extra)
            out.append(seed)
        return out

    def _store(self, e: _Engine, ev: BlockStored, reannounce: dict[int, bool]) -> bool:
        """Apply a BlockStored. Returns True when it is sparse and still needs resolving."""
        hashes = ev.block_hashes
        g = ev.group_idx or 0
        medium = ev.medium or GPU
        if (
            medium == GPU
            and ev.block_size > 0
            and (ev.kv_cache_spec_kind is not None or g not in e.groups)
        ):
            # Before anything else: even a sparse event listing no block tells us the group
            # exists, and matching without it would ignore that group's rule (over-predict).
            self._learn_group(e, g, ev)
        if not hashes:
            return False  # sparse groups may list nothing; the event is still sent
        if ev.block_size <= 0 or not ev.token_ids:
            # CPU placeholder (vLLM OffloadingConnector default): one chunk-tail hash per chunk,
            # no tokens. The same hash was published for the chunk's last GPU block.
            for h in hashes:
                v = e.hashes.get(h)
                if v is None:
                    e.counters["unresolved_hashes"] += 1
                else:
                    self._add(e, g, medium, h, v)
            return False
        nblocks = len(ev.token_ids) // ev.block_size
        if len(hashes) > nblocks:
            e.counters["malformed_events"] += 1
            return False
        if len(hashes) < nblocks:
            return True  # sparse: resolved through the engine map by the caller
        if ev.parent_block_hash is not None and ev.parent_block_hash not in e.hashes:
            e.counters["unknown_parent"] += 1
            if len(e.pending) >= self.max_pending_events:
                e.pending.pop(0)
                e.counters["pending_expired"] += 1
            e.pending.append((ev, e.counters["batches"]))
            return False
        keys = self._block_keys(e, ev)
        if keys is None:
            return False
        from_root_on_gpu = ev.parent_block_hash is None and medium == GPU
        if from_root_on_gpu and self._is_reannounce(e, ev, keys, reannounce):
            e.counters["reannounced"] += 1
            return False
        res = self._residency.get((g, medium))
        if res is None:
            res = self._residency[(g, medium)] = new_table()
        self._add_many(e, g, medium, res, hashes, keys)
        return False

    def _store_sparse(self, e: _Engine, ev: BlockStored, lookahead: dict[BlockHash, int]) -> None:
        g = ev.group_idx or 0
        medium = ev.medium or GPU
        hashes_map = e.hashes
        located: dict[int, int] | None = None
        for h in ev.block_hashes:
            v = hashes_map.get(h)
            if v is not None:
                self._add(e, g, medium, h, v)
                continue
            key = lookahead.get(h)
            if key is None:
                if located is None:
                    located = self._locate(e, ev)
                key = located.get(h)  # type: ignore[arg-type]
            if key is None:
                e.counters["unresolved_hashes"] += 1
            else:
                self._add(e, g, medium, h, key)

    def _locate(self, e: _Engine, ev: BlockStored) -> dict[int, int]:
        """Event hash -> content key for every block of a sparse event, by recomputing vLLM's
        default hash chain (indexer/vllm_hash.py). Empty when that cannot be done exactly."""
        parent = ev.parent_block_hash
        if isinstance(parent, bytes) or any(isinstance(h, bytes) for h in ev.block_hashes):
            return {}
        if ev.extra_keys and any(x is not None for x in ev.extra_keys):
            return {}  # internal extra keys (LoRA path, tagged salt) are not in the event
        if e.locator is None:
            e.locator = VllmHashLocator(self.vllm_hash_seed, self.locator_entries)
        if parent is None:
            seed: int | None = self._root(e, ev, None)[0]
        else:
            v = e.hashes.get(parent)
            seed = v if v is not None else e.locator.key_of(parent)
        if seed is None:
            return {}
        keys = self._chain_from(seed, ev)
        if not keys:
            return {}
        lows = e.locator.chain(parent, ev.token_ids, ev.block_size, keys)
        if lows is None:
            return {}
        return dict(zip(lows, keys, strict=True))

    def _learn_ahead(self, e: _Engine, events: Sequence[Event], start: int) -> dict[BlockHash, int]:
        """Hash -> key mappings that dense BlockStored events later in this batch will create."""
        learned: dict[BlockHash, int] = {}
        for ev in events[start:]:
            if type(ev) is not BlockStored or ev.block_size <= 0 or not ev.token_ids:
                continue
            if len(ev.block_hashes) != len(ev.token_ids) // ev.block_size:
                continue
            parent = ev.parent_block_hash
            if parent is not None and parent not in e.hashes and parent not in learned:
                continue
            if parent is not None and parent not in e.hashes:
                # Chain from a parent learned earlier in this look-ahead.
                keys = self._chain_from(learned[parent], ev)
            else:
                keys = self._block_keys(e, ev)
            if keys:
                learned.update(zip(ev.block_hashes, keys, strict=False))
        return learned

    def _chain_from(self, seed: int, ev: BlockStored) -> list[int] | None:
        bs = ev.block_size
        if bs <= 0 or bs % self.unit:
            return None
        step = bs // self.unit
        try:
            keys = chain_keys(seed, ev.token_ids, self.unit, (len(ev.token_ids) // bs) * step)
        except ValueError:  # token ids outside [0, 2**32)
            return None
        return keys[step - 1 :: step] if step > 1 else keys

    def _learn_group(self, e: _Engine, g: int, ev: BlockStored) -> None:
        # vLLM 0.33 repeats the group facts on every BlockStored: skip when nothing changed.
        raw = (ev.kv_cache_spec_kind, ev.block_size, ev.kv_cache_spec_sliding_window)
        if e.group_facts.get(g) == raw:
            return
        e.group_facts[g] = raw
        if ev.kv_cache_spec_kind is None and g in e.configured_groups:
            e.groups[g] = e.configured_groups[g]
            return
        kind = group_kind(ev.kv_cache_spec_kind)
        spec = GroupSpec(kind, ev.block_size, ev.kv_cache_spec_sliding_window)
        old = e.groups.get(g)
        if (
            old is None
            or old.kind != spec.kind
            or old.block_size != spec.block_size
            or (spec.sliding_window is not None and old.sliding_window != spec.sliding_window)
        ):
            if kind == CHUNKED and g in e.configured_groups:
                spec = GroupSpec(kind, ev.block_size, None, e.configured_groups[g].attention_chunk)
            e.groups[g] = spec

    def _is_reannounce(
        self, e: _Engine, ev: BlockStored, keys: list[int], decided: dict[int, bool]
    ) -> bool:
        """Is this parent-None GPU store vLLM's ``kv_cache_report_mode="full"`` re-announce?

        vLLM stores from token 0 (parent None) only when the request's prefix hit was zero.
        The re-announce instead re-sends a *hit* from token 0: no BlockRemoved will match it,
        so it must add no references -- and on a sliding-window group it lists every position,
        including blocks that group never cached (seen in the gemma3-swa capture). So: if the
        engine, by the hit rules over all its groups, would hit the event's whole range, vLLM
        would have hit it too, and the event is a re-announce. A from-scratch recompute after
        sliding-window-only eviction (full attention still resident, window tail gone) fails
        this test and is stored, with its full-attention duplicates reference-counted.
        """
        if not e.groups or not e.resident or not keys:
            return False
        align = math.lcm(*(spec.block_size for spec in e.groups.values()))
        point = (len(ev.token_ids) // align) * align
        if point == 0 or align % ev.block_size:
            return False
        # One decision per prefix per batch, keyed by K(point): every group's event of the same
        # request step reaches the same LCM-aligned point even when their ranges differ (a
        # 16-token group may cover 48 tokens where a 32-token group covers 32), so storing the
        # first cannot make the next look like a hit. K(point) is one of this event's block keys.
        decision_key = keys[point // ev.block_size - 1]
        verdict = decided.get(decision_key)
        if verdict is not None:
            return verdict
        # Fast rejection, exact: a full hit from token 0 needs block 0 of every full-attention
        # group, and a new prompt's first block is almost never resident.
        bit = e.bit
        for g, spec in e.groups.items():
            if spec.kind == FULL and spec.block_size == ev.block_size:
                res = self._residency.get((g, GPU))
                if res is None or not res[keys[0] & SLOT_MASK].get(keys[0], 0) & bit:
                    decided[decision_key] = False
                    return False
        seed, _ = self._root(e, ev, ev.extra_keys[0] if ev.extra_keys else None)
        unit_keys = chain_keys(seed, ev.token_ids[:point], self.unit)
        verdict = decided[decision_key] = all(
            self._group_ok(e, g, spec, unit_keys, point) for g, spec in e.groups.items()
        )
        return verdict

    def _add_many(
        self,
        e: _Engine,
        g: int,
        medium: str,
        res: Table,
        hashes: list[BlockHash],
        keys: list[int],
    ) -> None:
        bit = e.bit
        hmap = e.hashes
        # The whole event in C-level passes (map/update) rather than a Python loop per block:
        # this is what makes ingest fast. Duplicates (a block already resident on this engine,
        # group and medium) are rare and take the slow loop.
        dicts = list(map(res.__getitem__, map(SLOT_MASK.__and__, keys)))
        before = list(map(dict.get, dicts, keys, repeat(0, len(keys))))
        after = list(map(bit.__or__, before))
        if any(map(eq, after, before)):
            added = 0
            for d, key, m, m_new in zip(dicts, keys, before, after, strict=True):
                if m_new == m:
                    dk = (e.slot, g, medium, key)
                    self._dups[dk] = self._dups.get(dk, 0) + 1
                    e.counters["duplicates"] += 1
                else:
                    d[key] = m_new
                    added += 1
        else:
            _consume(map(dict.__setitem__, dicts, keys, after))
            added = len(keys)
        # One more reference per hash; a hash already mapped keeps its key (first store wins).
        hdicts = list(map(hmap.table.__getitem__, map(SLOT_MASK.__and__, map(hash, hashes))))
        if not any(map(dict.__contains__, hdicts, hashes)):
            _consume(map(dict.__setitem__, hdicts, hashes, keys))
        else:
            extra = e.extra_refs
            for d, h, key in zip(hdicts, hashes, keys, strict=False):
                if h in d:
                    extra[h] = extra.get(h, 0) + 1
                else:
                    d[h] = key
        if added:
            gm = (g, medium)
            e.resident[gm] = e.resident.get(gm, 0) + added
            self.total_entries += added
        e.counters["blocks_stored"] += len(keys)

    def _add(self, e: _Engine, g: int, medium: str, h: BlockHash, key: int) -> None:
        res = self._residency.get((g, medium))
        if res is None:
            res = self._residency[(g, medium)] = new_table()
        self._add_many(e, g, medium, res, [h], [key])

    def _remove(self, e: _Engine, block_hashes: list[BlockHash], g: int, medium: str) -> None:
        # Hot path: vLLM's GPU pool sends one BlockRemoved per evicted block, so per-event
        # overhead matters as much as per-block work. Counters are summed locally, and the
        # duplicate and extra-reference tables are consulted only when non-empty (both rare).
        res = self._residency.get((g, medium))
        bit = e.bit
        others = ~bit
        hmap = e.hashes
        extra_refs = e.extra_refs
        dups = self._dups
        removed = unknown = cleared = 0
        htable = hmap.table
        for h in block_hashes:
            hd = htable[hash(h) & SLOT_MASK]
            key = hd.get(h)
            if key is None or res is None:
                unknown += 1
                if e.pending:
                    e.pending_removed.add(h)
                continue
            d = res[key & SLOT_MASK]
            m = d.get(key, 0)
            if not m & bit:
                unknown += 1
                if e.pending:
                    e.pending_removed.add(h)
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
                    d[key] = m
                else:
                    del d[key]
                cleared += 1
            refs = extra_refs.get(h) if extra_refs else None
            if refs is None:
                del hd[h]
            elif refs == 1:
                del extra_refs[h]
            else:
                extra_refs[h] = refs - 1
            removed += 1
        if cleared:
            e.resident[(g, medium)] -= cleared
            self.total_entries -= cleared
        counters = e.counters
        if removed:
            counters["blocks_removed"] += removed
        if unknown:
            counters["unknown_removes"] += unknown

    def _drop_state(self, e: _Engine) -> None:
        bit = e.bit
        keep = ~bit
        keys = set(e.hashes.values())
        for res in self._residency.values():
            for key in keys:
                d = res[key & SLOT_MASK]
                m = d.get(key)
                if m is not None and m & bit:
                    m &= keep
                    if m:
                        d[key] = m
                    else:
                        del d[key]
        if self._dups:
            for dk in [dk for dk in self._dups if dk[0] == e.slot]:
                del self._dups[dk]
        self.total_entries -= sum(e.resident.values())
        e.resident.clear()
        e.hashes = HashMap()
        e.extra_refs = {}
        e.pending.clear()
        e.pending_removed.clear()

    def _retry_pending(self, e: _Engine) -> None:
        now = e.counters["batches"]
        still: list[tuple[BlockStored, int]] = []
        progress = True
        waiting = e.pending
        while progress:
            progress = False
            e.pending = []
            for ev, born in waiting:
                if ev.parent_block_hash in e.hashes:
                    removed = e.pending_removed
                    if removed and any(h in removed for h in ev.block_hashes):
                        # A later BlockRemoved already evicted part of it: applying it now
                        # would create phantom residency.
                        e.counters["pending_expired"] += 1
                        continue
                    if self._store(e, ev, {}):
                        self._store_sparse(e, ev, {})
                    e.counters["pending_applied"] += 1
                    progress = True
                elif now - born >= self.pending_batches:
                    e.counters["pending_expired"] += 1
                else:
                    still.append((ev, born))
            waiting, still = still, []
        e.pending = waiting
        if not e.pending:
            e.pending_removed.clear()

    def _enforce_cap(self) -> None:
        while self.total_entries > self.max_entries and self._engines:
            largest = max(self._engines.values(), key=lambda x: sum(x.resident.values()))
            self._drop_state(largest)
            largest.counters["overflow_resets"] += 1
            self.overflowed.append(largest.engine)

    # ------------------------------------------------------------------ match

    def root(self, model: str, cache_salt: str | None = None) -> int:
        """Namespace root for a request (model or LoRA name, optional cache_salt)."""
        key = (model, cache_salt)
        root = self._roots.get(key)
        if root is None:
            if len(self._roots) > 4096:  # bounded: namespaces are few, salts may be many
                self._roots.clear()
            root = self._roots[key] = namespace_root(model, cache_salt)
        return root

    def prompt_keys(self, tokens: Sequence[int], root: int) -> list[int]:
        """Content keys of a prompt at every whole-unit boundary (the GPU hit stops at
        ``n - 1`` but a CPU chunk may end exactly at ``n``)."""
        return chain_keys(root, tokens, self.unit)

    def match(
        self, tokens: Sequence[int], root: int, engines: Iterable[EngineId] | None = None
    ) -> dict[EngineId, PrefixMatch]:
        """Per engine, the GPU hit and CPU extension vLLM would find for this prompt."""
        return self.match_keys(self.prompt_keys(tokens, root), len(tokens), engines)

    def match_keys(
        self, keys: Sequence[int], n_tokens: int, engines: Iterable[EngineId] | None = None
    ) -> dict[EngineId, PrefixMatch]:
        """Like :meth:`match`, from precomputed ``prompt_keys`` (callers cache them)."""
        selected = (
            list(self._engines.values())
            if engines is None
            else [self._engines[x] for x in engines if x in self._engines]
        )
        # Engines with the same group layout are matched together, one pass over the prompt.
        layouts: dict[tuple[tuple[int, GroupSpec], ...], list[_Engine]] = {}
        for e in selected:
            layout = tuple(sorted(e.groups.items()))
            layouts.setdefault(layout, []).append(e)
        out: dict[EngineId, PrefixMatch] = {}
        for layout, members in layouts.items():
            self._match_layout(dict(layout), members, keys, n_tokens, out)
        return out

    def _match_layout(
        self,
        groups: dict[int, GroupSpec],
        members: list[_Engine],
        keys: Sequence[int],
        n_tokens: int,
        out: dict[EngineId, PrefixMatch],
    ) -> None:
        max_hit = max(n_tokens - 1, 0)
        # Callers may pass keys for fewer tokens than n_tokens; never read past them.
        max_hit = min(max_hit, len(keys) * self.unit)
        if not groups:
            for e in members:
                out[e.engine] = PrefixMatch(0, 0, [])
            return
        align = math.lcm(*(s.block_size for s in groups.values()))
        limit = (max_hit // align) * align
        full = [g for g, s in groups.items() if s.kind == FULL]
        others = [g for g, s in groups.items() if s.kind != FULL]
        # Full attention: the unbroken run of resident blocks from token 0, for all members at
        # once (bitmask), stopping as soon as no member is still running.
        fa_hit = {e.slot: limit for e in members}
        fa_per_group: dict[int, dict[int, int]] = {}
        for g in full:
            bs = groups[g].block_size
            hits = self._full_run(g, bs, members, keys, limit)
            fa_per_group[g] = hits
            for slot, h in hits.items():
                if h < fa_hit[slot]:
                    fa_hit[slot] = h
        for e in members:
            start = (fa_hit[e.slot] // align) * align
            point, per_group = self._fit_other_groups(e, groups, others, keys, start, align)
            explain = [
                GroupHit(g, FULL, groups[g].block_size, fa_per_group[g][e.slot]) for g in full
            ]
            explain.extend(
                GroupHit(
                    g, groups[g].kind, groups[g].block_size, per_group[g], groups[g].sliding_window
                )
                for g in others
            )
            explain.sort(key=lambda x: x.group_idx)
            cpu = self._cpu_extension(e, full or others, keys, point, n_tokens)
            out[e.engine] = PrefixMatch(point, cpu, explain)

    def _full_run(
        self, g: int, bs: int, members: list[_Engine], keys: Sequence[int], limit: int
    ) -> dict[int, int]:
        res = self._residency.get((g, GPU)) or EMPTY_TABLE
        step = bs // self.unit
        alive = 0
        for e in members:
            alive |= e.bit
        hits: dict[int, int] = {}
        if step == 0:  # blocks smaller than the unit are never indexed (unaligned_blocks)
            return dict.fromkeys((e.slot for e in members), 0)
        nblocks = limit // bs
        # One lookup per block (keyed by its last unit): an 8k-token prompt is 512 lookups, most
        # of them cache misses in a large index. run_scan (C when built) runs them until some
        # member drops out, so this loop turns once per distinct drop point, not once per block.
        # Blocks without a key (keys for fewer than limit tokens) are not scanned, and members
        # still alive after the last scanned block get nblocks * bs, as before.
        scan = min(nblocks, len(keys) // step)
        b = 0
        while alive:
            b, now = run_scan(res, keys, b, step, scan, alive)
            if b == scan:
                break
            dropped = alive & ~now
            while dropped:
                low = dropped & -dropped
                hits[low.bit_length() - 1] = b * bs
                dropped ^= low
            alive = now
            b += 1
        while alive:
            low = alive & -alive
            hits[low.bit_length() - 1] = nblocks * bs
            alive ^= low
        return hits

    def _fit_other_groups(
        self,
        e: _Engine,
        groups: dict[int, GroupSpec],
        others: list[int],
        keys: Sequence[int],
        start: int,
        align: int,
    ) -> tuple[int, dict[int, int]]:
        """Largest aligned point <= start that every non-full group accepts (vLLM's fixed point).

        Full attention is downward-closed, so any point below its run is fine for it; each other
        group's rule is checked at candidate points from right to left.
        """
        per_group: dict[int, int] = {}
        if not others:
            return start, per_group
        for g in others:
            per_group[g] = self._group_best(e, g, groups[g], keys, start, align)
        point = min(per_group.values())
        while point > 0 and not all(self._group_ok(e, g, groups[g], keys, point) for g in others):
            point = min(
                self._group_best(e, g, groups[g], keys, point - align, align) for g in others
            )
        return point, per_group

    def _group_best(
        self, e: _Engine, g: int, spec: GroupSpec, keys: Sequence[int], start: int, align: int
    ) -> int:
        point = (max(start, 0) // align) * align
        while point > 0 and not self._group_ok(e, g, spec, keys, point):
            point -= align
        return max(point, 0)

    def _group_ok(
        self,
        e: _Engine,
        g: int,
        spec: GroupSpec,
        keys: Sequence[int],
        point: int,
    ) -> bool:
        """Whether group ``g`` of engine ``e`` accepts a hit ending at ``point``.

        Full attention needs every block from 0 (in :meth:`match` it is handled by the faster
        fleet-wide :meth:`_full_run`; this per-engine check serves :meth:`_is_reannounce`)."""
        if point == 0:
            return True
        res = self._residency.get((g, GPU))
        if res is None:
            return False
        bs = spec.block_size
        step = bs // self.unit
        bit = e.bit
        end_block = point // bs  # blocks [0, end_block) end at or before point
        if spec.kind == SLIDING:
            window = spec.sliding_window or bs
            need = -(-(window - 1) // bs)  # cdiv(W - 1, block_size)
            first = max(end_block - need, 0)  # a shorter run from block 0 also counts
        elif spec.kind == MAMBA:
            first = end_block - 1  # only the state block ending exactly at the point
        elif spec.kind == CHUNKED:
            chunk = spec.attention_chunk or bs
            first = ((point // chunk) * chunk) // bs
            if first >= end_block:
                return True
        else:
            first = 0
        return all(
            res[k & SLOT_MASK].get(k, 0) & bit
            for k in (keys[(b + 1) * step - 1] for b in range(first, end_block))
        )

    def _cpu_extension(
        self,
        e: _Engine,
        groups: list[int],
        keys: Sequence[int],
        gpu_hit: int,
        n_tokens: int,
    ) -> int:
        """Tokens loadable from CPU chunks beyond the GPU hit, as vLLM's OffloadingConnector
        counts them (``OffloadingConnectorScheduler.get_num_new_matched_tokens``):

        * the lookup covers the request's whole chunks (``n // chunk``) and starts at chunk
          ``gpu_hit // chunk``; present chunks must be contiguous from there;
        * the loaded part must be at least one whole chunk, else nothing is loaded;
        * a chunk is present when its tail key (the offload key is the chunk's last block hash)
          is resident on CPU in every group considered;
        * if GPU + CPU cover the whole prompt, the scheduler recomputes the last token
          (``num_computed_tokens -= 1`` after the load), so the usable extension is one less.
        """
        chunk = self.cpu_chunk_tokens
        found = [self._residency.get((g, CPU)) for g in groups]
        if any(t is None for t in found):
            return 0
        tables: list[Table] = found  # type: ignore[assignment]
        whole = n_tokens // chunk
        if whole * chunk - gpu_hit < chunk:
            return 0
        bit = e.bit
        step = chunk // self.unit
        k = gpu_hit // chunk
        while k < whole:
            key = keys[(k + 1) * step - 1] if (k + 1) * step <= len(keys) else None
            if key is None or not all(t[key & SLOT_MASK].get(key, 0) & bit for t in tables):
                break
            k += 1
        loaded = k * chunk - gpu_hit
        if loaded < chunk:
            return 0
        return min(loaded, n_tokens - 1 - gpu_hit)

    # ------------------------------------------------------------------ snapshots

    def export_engine(self, engine: EngineId) -> bytes:
        """One engine's exact state as msgpack (for Redis snapshots): a new router replica
        imports it and replays only the sequence numbers after it. Size is bounded by the
        engine's resident blocks (about 30 bytes per block)."""
        e = self._engines.get(engine)
        if e is None:
            raise KeyError(engine)
        resident: list[tuple[int, str, list[int]]] = []
        bit = e.bit
        for (g, medium), res in self._residency.items():
            keys = [k for k in set(e.hashes.values()) if res[k & SLOT_MASK].get(k, 0) & bit]
            if keys:
                resident.append((g, medium, keys))
        dups = [(g, m, k, n) for (slot, g, m, k), n in self._dups.items() if slot == e.slot]
        state = _EngineSnapshot(
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

    def import_engine(self, engine: EngineId, data: bytes) -> None:
        """Replace an engine's state with an :meth:`export_engine` snapshot.

        Raises ``ValueError`` on a malformed snapshot (the engine is then left empty)."""
        try:
            state = msgspec.msgpack.decode(data, type=_EngineSnapshot)
        except msgspec.MsgspecError as exc:
            self.clear_engine(engine)
            raise ValueError(f"bad index snapshot: {exc}") from None
        e = self._engines.get(engine) or self._new_engine(engine, state.model)
        self._drop_state(e)
        e.model = state.model
        e.hashes = HashMap((h, key) for h, key, _refs in state.hashes)
        e.extra_refs = {h: refs - 1 for h, _key, refs in state.hashes if refs > 1}
        e.groups = {
            g: GroupSpec(kind, bs, window, chunk) for g, kind, bs, window, chunk in state.groups
        }
        e.group_facts.clear()
        bit = e.bit
        for g, medium, keys in state.resident:
            res = self._residency.get((g, medium))
            if res is None:
                res = self._residency[(g, medium)] = new_table()
            for k in keys:
                d = res[k & SLOT_MASK]
                d[k] = d.get(k, 0) | bit
            e.resident[(g, medium)] = e.resident.get((g, medium), 0) + len(keys)
            self.total_entries += len(keys)
        for g, medium, k, n in state.dups:
            self._dups[(e.slot, g, medium, k)] = n
        if self.total_entries > self.max_entries:
            self._enforce_cap()

    # ------------------------------------------------------------------ inspection

    def engine_stats(self, engine: EngineId) -> EngineStats | None:
        e = self._engines.get(engine)
        if e is None:
            return None
        return EngineStats(
            engine=e.engine,
            model=e.model,
            groups={
                g: {
                    "kind": s.kind,
                    "block_size": s.block_size,
                    "sliding_window": s.sliding_window,
                }
                for g, s in sorted(e.groups.items())
            },
            resident={f"{g}/{m}": n for (g, m), n in sorted(e.resident.items())},
            hashes=len(e.hashes),
            counters=dict(e.counters),
        )

    def churn(self, engine: EngineId) -> tuple[int, int]:
        """(blocks stored, blocks removed) counters of an engine: two snapshots tell whether its
        cache changed in between (the verifier uses this to tell races from wrong predictions)."""
        e = self._engines.get(engine)
        if e is None:
            return (0, 0)
        return (e.counters["blocks_stored"], e.counters["blocks_removed"])

    def resident_blocks(self, engine: EngineId) -> int:
        e = self._engines.get(engine)
        return 0 if e is None else sum(e.resident.values())

    def holds(self, engine: EngineId, group_idx: int, medium: str, key: int) -> bool:
        """Whether ``engine`` holds the block named ``key`` (tests and /debug)."""
        e = self._engines.get(engine)
        res = self._residency.get((group_idx, medium))
        return bool(e is not None and res and res[key & SLOT_MASK].get(key, 0) & e.bit)


class _EngineSnapshot(msgspec.Struct, array_like=True, gc=False):
    model: str
    hashes: list[tuple[BlockHash, int, int]]  # (engine hash, content key, references)
    groups: list[tuple[int, str, int, int | None, int | None]]
    resident: list[tuple[int, str, list[int]]]
    dups: list[tuple[int, str, int, int]]


def _as_tuple(extra: Any) -> tuple[Any, ...]:
    if isinstance(extra, list | tuple):
        return tuple(extra)
    return (extra,)


def _strip_lora(extra: Any, lora_name: str | None) -> Any:
    if extra is None:
        return None
    items = tuple(x for x in _as_tuple(extra) if lora_name is None or x != lora_name)
    return items or None
