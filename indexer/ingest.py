"""Read one engine's vLLM KV events into the residency tables.

``BlockStored`` events name blocks by the engine's own hashes; ingest turns them into content
keys (indexer/keys.py) and records them. The cases that make this exact:

* *dense* events list one hash per block of ``token_ids``: keys are chained from the parent's
  key (or the namespace root) over the tokens;
* *sparse* events (sliding-window and mamba groups) list only some blocks: their hashes are
  resolved through the engine's hash map, through the dense events later in the same batch
  (look-ahead), or, for models with no full-attention group, by recomputing vLLM's hash chain
  (indexer/vllm_hash.py);
* CPU placeholders carry one chunk-tail hash per chunk and no tokens: resolved through the map;
* an event whose parent is unknown waits a few batches for it (replay may fill the gap);
* a GPU store from token 0 that the engine would already hit is vLLM's full-report re-announce
  and adds no reference.

Packed batches (indexer/wire.py ``PackedEvents``) take ``_apply_packed``: dense full-attention
stores on an engine with that one group, and removals, are applied in C (indexer/residency.py
``store_run``, ``store_packed``, ``remove_packed``); every other event, and every batch of an
engine with several groups or an export in progress, by the Python reference below.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from indexer.engine_state import EngineState
from indexer.hit_rules import alignment, group_accepts
from indexer.keys import chain_keys, mix_extra, tokens_to_bytes
from indexer.residency import NATIVE_INGEST, STORE_BAIL, STORE_REANNOUNCED, Residency
from indexer.types import CHUNKED, FULL, GPU, GroupSpec, group_kind
from indexer.vllm_hash import VllmHashLocator
from indexer.wire import (
    REMOVED,
    STORED,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    PackedEvents,
)

__all__ = ["Ingest"]


class Ingest:
    """Applies event batches to ``residency``; ``root(model, cache_salt)`` names namespaces.

    ``pending_batches`` / ``max_pending_events``: how many later batches a store with an unknown
    parent waits, and how many may wait per engine. ``vllm_hash_seed`` / ``locator_entries``:
    the seed and memory bound of the hash-chain locator (indexer/vllm_hash.py).
    """

    def __init__(
        self,
        residency: Residency,
        unit: int,
        root: Callable[[str, str | None], int],
        pending_batches: int,
        max_pending_events: int,
        vllm_hash_seed: str,
        locator_entries: int,
        attention_chunk: int | None = None,
    ) -> None:
        self.residency = residency
        self.unit = unit
        self.root = root
        self.pending_batches = pending_batches
        self.max_pending_events = max_pending_events
        self.vllm_hash_seed = vllm_hash_seed
        self.locator_entries = locator_entries
        self.attention_chunk = attention_chunk
        """The fleet's chunk of chunked-local-attention groups (``PrefixIndex``)."""

    def apply(self, e: EngineState, events: Sequence[Event]) -> None:
        """Apply one batch of events of one engine, in list order (vLLM's order)."""
        if type(events) is PackedEvents:
            if NATIVE_INGEST and len(e.groups) <= 1 and not e.exports:
                self._apply_packed(e, events)
                return
            events = events.events()
        e.counters["batches"] += 1
        lookahead: dict[BlockHash, int] | None = None
        # One re-announce decision per prefix per batch: vLLM sends one event per group for the
        # same request step, and storing the first must not change how the next is judged.
        reannounce: dict[int, bool] = {}
        if len(e.groups) > 1:
            # Judge every from-root GPU store on the state before the batch: one group's event
            # applied first (a sliding-window tail, or the window a CPU load restored) must not
            # make another group's real store look like vLLM's re-announce of a hit. But not a
            # store after the batch's clear (vLLM announces a reset at the head of its next
            # step), nor one listing a block removed earlier in the batch: at the step's start
            # the engine did not hold it, so vLLM could not hit it and stores a new copy.
            removed: set[BlockHash] = set()
            cleared = False
            for ev in events:
                kind = type(ev)
                if kind is BlockStored and ev.parent_block_hash is None:  # type: ignore[union-attr]
                    gone = cleared or not removed.isdisjoint(ev.block_hashes)  # type: ignore[union-attr]
                    self._decide_reannounce(e, ev, reannounce, gone)  # type: ignore[arg-type]
                elif kind is BlockRemoved:
                    removed.update(ev.block_hashes)  # type: ignore[union-attr]
                elif kind is AllBlocksCleared:
                    cleared = True
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
                # Stores waiting for a parent must not bring back a block removed meanwhile.
                waiting = e.pending_removed if e.pending else None
                self.residency.remove(e, hashes, g, medium, waiting)
            elif kind is AllBlocksCleared:
                self.residency.drop(e)
                e.counters["cleared"] += 1
        if e.pending:
            self._retry_pending(e)

    def _apply_packed(self, e: EngineState, packed: PackedEvents) -> None:
        """``apply`` for a packed batch on an engine with at most one group (so no re-announce
        pre-pass): same order and result; an event C does not take is applied by the Python
        path from its decoded form, in its place."""
        e.counters["batches"] += 1
        reannounce: dict[int, bool] = {}
        lookahead: dict[BlockHash, int] | None = None
        records = packed.records
        i, n = 0, len(records)
        while i < n:
            if records[i][0] == STORED:  # plain stores in one C call; the rest below
                i = self._store_run(e, records, i, reannounce)
                if i == n:
                    break
            r = records[i]
            i += 1
            if r[0] == STORED:
                if self._store_packed(e, r, reannounce):
                    continue
                ev: BlockStored = packed.event_of(i - 1)  # type: ignore[assignment]
                if not self._store(e, ev, reannounce):
                    continue
                if lookahead is None:
                    lookahead = self._learn_ahead(e, packed.events_from(i), 0)
                self._store_sparse(e, ev, lookahead)
            elif r[0] == REMOVED:
                # Runs of single-hash removals in one pass, as in ``apply``.
                g, medium, hashes = r[3] or 0, r[2] or GPU, r[1]
                if i < n and records[i][0] == REMOVED:
                    parts = [hashes]
                    while i < n and records[i][0] == REMOVED:
                        nxt = records[i]
                        if (nxt[3] or 0) != g or (nxt[2] or GPU) != medium:
                            break
                        parts.append(nxt[1])
                        i += 1
                    hashes = b"".join(parts)
                waiting = e.pending_removed if e.pending else None
                self.residency.remove_packed(e, hashes, g, medium, waiting)
            else:
                self.residency.drop(e)
                e.counters["cleared"] += 1
        if e.pending:
            self._retry_pending(e)

    def _store_run(
        self, e: EngineState, records: list[tuple[Any, ...]], i: int, decided: dict[int, bool]
    ) -> int:
        """Apply the plain stores from record ``i`` on in C (``_store_packed``'s plainest
        case); the index of the first record left to the caller."""
        if len(e.groups) != 1:
            return i
        ((g, spec),) = e.groups.items()
        res = self.residency.tables.get((g, GPU))
        bs = spec.block_size
        if res is None or spec.kind != FULL or bs <= 0 or bs % self.unit:
            return i
        facts = e.group_facts.get(g)
        kind, window = (
            (facts[0], facts[2]) if facts is not None and facts[1] == bs else (None, None)
        )
        end, added, reannounced = self.residency.store_run(
            e, res, records, i, self.root(e.model, None), self.unit, bs, g, kind, window, decided
        )
        if reannounced:
            e.counters["reannounced"] += reannounced
        if added:
            self.residency.stored(e, g, GPU, added)
        return end  # type: ignore[no-any-return]

    def _store_packed(self, e: EngineState, r: tuple[Any, ...], decided: dict[int, bool]) -> bool:
        """Apply a packed BlockStored in C when ``_store`` would take its plainest path: a dense
        store with no extras but nils; on a GPU, of the engine's only group, full attention,
        with its group facts unchanged. False: nothing done, the Python path applies it."""
        _, hashes, parent, tokens, bs, _, medium, lora_name, _, g, kind, window = r[:12]
        g = g or 0
        if bs <= 0 or bs % self.unit or not hashes or len(hashes) // 8 != len(tokens) // 4 // bs:
            return False
        if medium is None or medium == GPU:
            medium = GPU
            spec = e.groups.get(g)
            if (
                spec is None
                or len(e.groups) != 1
                or spec.kind != FULL
                or spec.block_size != bs
                or (kind is not None and e.group_facts.get(g) != (kind, bs, window))
            ):
                return False
            check = decided if parent is None and e.resident else None
        else:
            check = None  # group facts and re-announces concern GPU stores only
        seed = None
        if parent is None:
            seed = self.root(lora_name if lora_name is not None else e.model, None)
        code = self.residency.store_packed(
            e, g, medium, seed, parent, hashes, tokens, self.unit, bs, check
        )
        if code == STORE_REANNOUNCED:
            e.counters["reannounced"] += 1
        return code != STORE_BAIL

    # ------------------------------------------------------------------ stores

    def _store(self, e: EngineState, ev: BlockStored, reannounce: dict[int, bool]) -> bool:
        """Apply a BlockStored. Returns True when it is sparse and still needs resolving."""
        hashes = ev.block_hashes
        g = ev.group_idx or 0
        medium = ev.medium or GPU
        if ev.lookahead_token_ids is not None:
            e.eagle = True  # only EAGLE's look-ahead hashing sends them
        if (
            medium == GPU
            and ev.block_size > 0
            and (ev.kv_cache_spec_kind is not None or g not in e.groups)
        ):
            # Before anything else: even a sparse event listing no block tells us the group
            # exists, and matching without it would ignore that group's rule (over-predict).
            self._learn_group(e, g, ev)
        located: dict[int, int] | None = None
        if (
            medium == GPU
            and ev.token_ids
            and e.groups
            and all(s.kind != FULL for s in e.groups.values())
        ):
            # No group lists every block, so a later event's parent may be a block no event
            # ever listed: follow vLLM's hash chain through every event (even one listing
            # nothing), not only through events with unresolved hashes.
            located = self._locate(e, ev)
        if not hashes:
            return False  # sparse groups may list nothing; the event is still sent
        if (
            ev.parent_block_hash is not None
            and ev.parent_block_hash not in e.hashes
            and _is_partial_event(e.groups.get(g), ev)
        ):
            # A partial entry's parent is the hash one unit before it, which vLLM publishes
            # only where that is a block end: nothing later can place it, so it does not wait.
            e.counters["partial_unplaced"] += 1
            return False
        if ev.block_size <= 0 or not ev.token_ids:
            # CPU placeholder (vLLM OffloadingConnector default): one chunk-tail hash per chunk,
            # no tokens. The same hash was published for the chunk's last GPU block.
            for h in hashes:
                v = e.hashes.get(h)
                if v is None:
                    e.counters["unresolved_hashes"] += 1
                else:
                    self.residency.add(e, g, medium, h, v)
            return False
        nblocks = len(ev.token_ids) // ev.block_size
        if len(hashes) > nblocks:
            e.counters["malformed_events"] += 1
            return False
        if len(hashes) < nblocks:
            return True  # sparse: resolved through the engine map by the caller
        if ev.parent_block_hash is not None and ev.parent_block_hash not in e.hashes:
            if located and all(h in located for h in hashes):
                # The parent was never listed, but the recomputed chain places every block.
                table = self.residency.table(g, medium)
                self.residency.add_many(e, g, medium, table, hashes, [located[h] for h in hashes])
                return False
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
        self.residency.add_many(e, g, medium, self.residency.table(g, medium), hashes, keys)
        return False

    def _store_sparse(
        self, e: EngineState, ev: BlockStored, lookahead: dict[BlockHash, int]
    ) -> None:
        g = ev.group_idx or 0
        medium = ev.medium or GPU
        hashes_map = e.hashes
        located: dict[int, int] | None = None
        for h in ev.block_hashes:
            v = hashes_map.get(h)
            if v is not None:
                self.residency.add(e, g, medium, h, v)
                continue
            key = lookahead.get(h)
            if key is None:
                if located is None:
                    located = self._locate(e, ev)
                key = located.get(h)  # type: ignore[arg-type]
            if key is None:
                e.counters["unresolved_hashes"] += 1
            else:
                self.residency.add(e, g, medium, h, key)

    def _retry_pending(self, e: EngineState) -> None:
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

    # ------------------------------------------------------------------ content keys

    def _root(self, e: EngineState, ev: BlockStored, extra0: Any) -> tuple[int, Any]:
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

    def _block_keys(self, e: EngineState, ev: BlockStored) -> list[int] | None:
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

    # ------------------------------------------------------------------ sparse resolution

    def _learn_ahead(
        self, e: EngineState, events: Sequence[Event], start: int
    ) -> dict[BlockHash, int]:
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

    def _locate(self, e: EngineState, ev: BlockStored) -> dict[int, int]:
        """Event hash -> content key for every block of a sparse event, by recomputing vLLM's
        hash chain (indexer/vllm_hash.py). Empty when that cannot be done exactly."""
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
        return e.locator.chain(parent, ev.token_ids, ev.block_size, keys, ev.block_hashes) or {}

    # ------------------------------------------------------------------ group facts

    def _learn_group(self, e: EngineState, g: int, ev: BlockStored) -> None:
        # vLLM 0.33 repeats the group facts on every BlockStored: skip when nothing changed.
        raw = (ev.kv_cache_spec_kind, ev.block_size, ev.kv_cache_spec_sliding_window)
        if e.group_facts.get(g) == raw:
            return
        old = e.groups.get(g)
        kind = group_kind(ev.kv_cache_spec_kind)
        chunk = None
        if kind == CHUNKED:  # not in the events: configured, per group or for the fleet
            configured = e.configured_groups.get(g)
            chunk = (configured.attention_chunk if configured else None) or self.attention_chunk
        spec = GroupSpec(kind, ev.block_size, ev.kv_cache_spec_sliding_window, chunk)
        if _is_partial_block(old, spec):
            # Not kept as the group's facts, so every partial entry is counted.
            e.counters["partial_blocks"] += 1
            return
        e.group_facts[g] = raw
        if ev.kv_cache_spec_kind is None and g in e.configured_groups:
            e.groups[g] = e.configured_groups[g]
            return
        if (
            old is None
            or old.kind != spec.kind
            or old.block_size != spec.block_size
            or (spec.sliding_window is not None and old.sliding_window != spec.sliding_window)
            or old.attention_chunk != spec.attention_chunk
        ):
            e.groups[g] = spec

    # ------------------------------------------------------------------ re-announce

    def _decide_reannounce(
        self, e: EngineState, ev: BlockStored, decided: dict[int, bool], gone: bool = False
    ) -> None:
        """Record the re-announce verdict of a from-root store before its batch is applied;
        ``gone``: what it lists left the engine earlier in the batch, so it is a new copy."""
        if (ev.medium or GPU) != GPU or ev.block_size <= 0 or not ev.token_ids:
            return
        keys = self._block_keys(e, ev)
        if keys is None or not ev.block_hashes:
            return
        if gone:
            point = self._decision_point(e, ev)
            if point:
                decided.setdefault(keys[point // ev.block_size - 1], False)
            return
        self._is_reannounce(e, ev, keys, decided)

    @staticmethod
    def _decision_point(e: EngineState, ev: BlockStored) -> int:
        """The aligned point a from-root store is judged at (see :meth:`_is_reannounce`); 0
        when it cannot be a re-announce."""
        if not e.groups:
            return 0
        align = alignment(e.groups.values())
        return 0 if align % ev.block_size else (len(ev.token_ids) // align) * align

    def _is_reannounce(
        self, e: EngineState, ev: BlockStored, keys: list[int], decided: dict[int, bool]
    ) -> bool:
        """Is this parent-None GPU store vLLM's ``kv_cache_report_mode="full"`` re-announce?

        vLLM stores from token 0 (parent None) only when the request's prefix hit was zero.
        The re-announce instead re-sends a *hit* from token 0: no BlockRemoved will match it,
        so it must add no references -- and on a sliding-window group it lists every position,
        including blocks that group never cached (the gemma3-swa capture in tests/test_captures.py
        shows it). So: if the engine, by the hit rules over all its groups, would hit the event's
        whole range, vLLM would have hit it too, and the event is a re-announce. A from-scratch
        recompute after sliding-window-only eviction (full attention still resident, window tail
        gone) fails this test and is stored, with its full-attention duplicates
        reference-counted.
        """
        if not e.groups or not e.resident or not keys:
            return False
        # One decision per prefix per batch, keyed by K(point): every group's event of the same
        # request step reaches the same LCM-aligned point even when their ranges differ (a
        # 16-token group may cover 48 tokens where a 32-token group covers 32), so storing the
        # first cannot make the next look like a hit. K(point) is one of this event's block keys.
        point = self._decision_point(e, ev)
        if point == 0:
            return False
        decision_key = keys[point // ev.block_size - 1]
        verdict = decided.get(decision_key)
        if verdict is not None:
            return verdict
        # Fast rejection, exact: a full hit from token 0 needs block 0 of every full-attention
        # group, and a new prompt's first block is almost never resident.
        bit = e.bit
        tables = self.residency.tables
        for g, spec in e.groups.items():
            if spec.kind == FULL and spec.block_size == ev.block_size:
                res = tables.get((g, GPU))
                if res is None or not res.get(keys[0], 0) & bit:
                    decided[decision_key] = False
                    return False
        unit_keys = self._unit_keys(e, ev, keys, point)
        verdict = decided[decision_key] = all(
            group_accepts(spec, tables.get((g, GPU)), bit, unit_keys, point, self.unit)
            for g, spec in e.groups.items()
        )
        return verdict

    def _unit_keys(self, e: EngineState, ev: BlockStored, keys: list[int], point: int) -> list[int]:
        """Content keys at every unit of ``ev``'s first ``point`` tokens, from token 0.

        With per-block extras (multimodal items, prompt embeds) each block's key is
        ``keys[b]`` (the extras folded in) and the next block chains from it, exactly as
        :meth:`_block_keys` stored them: a multimodal re-announce is then recognised instead of
        being counted as a second copy no removal will ever match.
        """
        seed, _ = self._root(e, ev, ev.extra_keys[0] if ev.extra_keys else None)
        extras = ev.extra_keys
        if not extras or extras.count(None) == len(extras):
            return chain_keys(seed, ev.token_ids[:point], self.unit)
        bs = ev.block_size
        out: list[int] = []
        for b in range(point // bs):
            part = chain_keys(seed, ev.token_ids[b * bs : (b + 1) * bs], self.unit)
            part[-1] = seed = keys[b]
            out.extend(part)
        return out


def _is_partial_block(old: GroupSpec | None, new: GroupSpec) -> bool:
    """A ``cache_partial_block`` event: vLLM hashes prompts every ``--prefix-match-unit``
    tokens, and when that unit is finer than a group's block, full-attention and mamba groups
    register the prompt's last unit boundary inside a block as one entry whose ``block_size``
    is the unit. The group keeps the block size learned from its full-block events; an entry
    whose parent is known is indexed like any block (``_store`` counts the others), but the
    finer hits it allows are not predicted (docs/vllm-reference.md, "Partial blocks")."""
    return old is not None and old.kind == new.kind and _finer(new.block_size, old.block_size)


def _is_partial_event(spec: GroupSpec | None, ev: BlockStored) -> bool:
    """Whether ``ev`` is one partial entry of a group whose blocks are ``spec``'s."""
    return (
        spec is not None
        and len(ev.block_hashes) == 1
        and len(ev.token_ids) == ev.block_size
        and _finer(ev.block_size, spec.block_size)
    )


def _finer(unit: int, block: int) -> bool:
    """``unit`` divides ``block`` and is smaller: a partial entry's size beside its group's."""
    return 0 < unit < block and block % unit == 0


def _as_tuple(extra: Any) -> tuple[Any, ...]:
    if isinstance(extra, list | tuple):
        return tuple(extra)
    return (extra,)


def _strip_lora(extra: Any, lora_name: str | None) -> Any:
    if extra is None:
        return None
    items = tuple(x for x in _as_tuple(extra) if lora_name is None or x != lora_name)
    return items or None
