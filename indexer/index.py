"""The prefix index: which engine holds which prefix, per KV-cache group and medium.

A pure data structure (no I/O, no clocks): ``apply(engine, events)`` and ``match(...)``.
docs/design.md explains the design; the decisions that make it exact are written next to the
code that makes them:

* indexer/types.py -- engine ids, media, group kinds (the router's vocabulary too);
* indexer/engine_state.py -- what the index keeps per engine;
* indexer/residency.py -- who holds which block: engine bitmasks per (group, medium);
* indexer/ingest.py -- vLLM events into residency (sparse, placeholder, pending, re-announce);
* indexer/hit_rules.py -- vLLM's hit rules, pure functions over residency tables;
* indexer/matching.py -- a prompt against a set of engines, one pass per group layout;
* indexer/cap.py -- the cap on resident entries;
* indexer/snapshot.py -- one engine's state as msgpack.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from indexer.cap import enforce_cap
from indexer.eagle import eagle_groups
from indexer.engine_state import EngineState
from indexer.ingest import Ingest
from indexer.keys import DEFAULT_UNIT, NamespaceRoots, chain_keys, packed_keys
from indexer.matching import GroupHit, Layouts, PrefixMatch, match_engines
from indexer.residency import Residency
from indexer.snapshot import EngineExport, decode_snapshot, encode_snapshot, restore_snapshot
from indexer.types import CHUNKED, EngineId, GroupSpec, group_kind
from indexer.wire import Event

__all__ = [
    "EngineId",
    "EngineStats",
    "GroupHit",
    "GroupSpec",
    "PrefixIndex",
    "PrefixMatch",
    "group_kind",
]


class EngineStats(msgspec.Struct):
    engine: EngineId
    model: str
    groups: dict[int, dict[str, Any]]
    resident: dict[str, int]
    """Resident blocks per "group_idx/medium"."""
    hashes: int
    counters: dict[str, int]


class PrefixIndex:
    """Exact, hybrid-aware index of every engine's prefix cache.

    ``unit``: tokens per content-key step; must divide every block size in use (events with a
    block size it does not divide are counted in ``unaligned_blocks`` and dropped).
    ``cpu_chunk_tokens``: CPU offload chunk size (vLLM's ``kv_connector_extra_config.block_size``).
    ``max_entries``: cap on resident (engine, group, medium, block) entries over all engines;
    past it the engine holding the most entries is reset (counter ``overflow_resets``) and listed
    in ``overflowed`` (indexer/cap.py says why).
    ``pending_batches``: how many later batches an event with an unknown parent waits for its
    parent (replay may fill the gap) before it is dropped (``pending_expired``);
    ``max_pending_events``: how many such events wait per engine.
    ``eagle``: the workers run EAGLE / MTP speculative decoding (vLLM then drops the last
    matched block); engines whose events carry ``lookahead_token_ids`` are treated so anyway.
    ``attention_chunk``: tokens per chunk of the workers' chunked-local-attention groups (the
    model's ``attention_chunk_size``: Llama 4's 8,192), which vLLM's events do not carry; None
    reads such groups as full attention (never more than vLLM hits; exact for prompts within
    the first chunk).
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
        eagle: bool = False,
        attention_chunk: int | None = None,
    ) -> None:
        if unit <= 0 or cpu_chunk_tokens % unit:
            raise ValueError("unit must be positive and divide cpu_chunk_tokens")
        self.unit = unit
        self.cpu_chunk_tokens = cpu_chunk_tokens
        self.max_entries = max_entries
        if attention_chunk is not None and attention_chunk <= 0:
            raise ValueError("attention_chunk must be positive")
        self.eagle = eagle
        self._engines: dict[EngineId, EngineState] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._residency = Residency()
        self._roots = NamespaceRoots()
        self._layouts = Layouts()
        self._ingest = Ingest(
            self._residency,
            unit,
            self._roots,
            pending_batches,
            max_pending_events,
            vllm_hash_seed,
            locator_entries,
            attention_chunk,
        )
        self.overflowed: list[EngineId] = []
        """Engines reset by the cap since the caller last cleared this list."""

    @property
    def total_entries(self) -> int:
        """Resident (engine, group, medium, block) entries over all engines."""
        return self._residency.total

    @property
    def pending_batches(self) -> int:
        return self._ingest.pending_batches

    @property
    def max_pending_events(self) -> int:
        return self._ingest.max_pending_events

    @property
    def vllm_hash_seed(self) -> str:
        return self._ingest.vllm_hash_seed

    @property
    def locator_entries(self) -> int:
        return self._ingest.locator_entries

    @property
    def attention_chunk(self) -> int | None:
        return self._ingest.attention_chunk

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

    def _new_engine(self, engine: EngineId, model: str = "") -> EngineState:
        slot = self._free_slots.pop() if self._free_slots else self._next_slot
        if slot == self._next_slot:
            self._next_slot += 1
        e = EngineState(engine, slot, model, bit=1 << slot, eagle=self.eagle)
        self._engines[engine] = e
        return e

    def remove_engine(self, engine: EngineId) -> None:
        """Forget an engine entirely (worker left, or restarted)."""
        e = self._engines.pop(engine, None)
        if e is None:
            return
        self._residency.drop(e)
        self._free_slots.append(e.slot)

    def clear_engine(self, engine: EngineId) -> None:
        """Drop everything an engine holds on every medium (``AllBlocksCleared``, resets)."""
        e = self._engines.get(engine)
        if e is not None:
            self._residency.drop(e)

    def epoch(self, engine: EngineId) -> int:
        """A number that changes whenever ``engine``'s state is dropped or the engine is added
        again (0: not in the index), so that credit kept outside the index can be checked."""
        e = self._engines.get(engine)
        return 0 if e is None else e.epoch

    def engines(self) -> list[EngineId]:
        return list(self._engines)

    def has_engine(self, engine: EngineId) -> bool:
        return engine in self._engines

    # ------------------------------------------------------------------ apply

    def apply(self, engine: EngineId, events: Sequence[Event]) -> None:
        """Apply one batch of events of one engine, in list order (vLLM's order)."""
        e = self._engines.get(engine) or self._new_engine(engine)
        self._ingest.apply(e, events)
        if self._residency.total > self.max_entries:
            enforce_cap(self._residency, self._engines, self.max_entries, self.overflowed)

    # ------------------------------------------------------------------ match

    def root(self, model: str, cache_salt: str | None = None) -> int:
        """Namespace root for a request (model or LoRA name, optional cache_salt)."""
        return self._roots(model, cache_salt)

    def prompt_keys(self, tokens: Sequence[int], root: int) -> list[int]:
        """Content keys of a prompt at every whole-unit boundary (the GPU hit stops at
        ``n - 1`` but a CPU chunk may end exactly at ``n``)."""
        return chain_keys(root, tokens, self.unit)

    def match(
        self, tokens: Sequence[int], root: int, engines: Iterable[EngineId] | None = None
    ) -> dict[EngineId, PrefixMatch]:
        """Per engine, the GPU hit and CPU extension vLLM would find for this prompt."""
        # The keys as packed uint64 (when C is built): matching reads only the blocks it walks.
        return self.match_keys(packed_keys(root, tokens, self.unit), len(tokens), engines)

    def match_keys(
        self, keys: Sequence[int], n_tokens: int, engines: Iterable[EngineId] | None = None
    ) -> dict[EngineId, PrefixMatch]:
        """Like :meth:`match`, from precomputed ``prompt_keys`` (callers cache them)."""
        selected = (
            list(self._engines.values())
            if engines is None
            else [e for e in map(self._engines.get, engines) if e is not None]
        )
        return match_engines(
            self._residency.tables,
            selected,
            keys,
            n_tokens,
            self.unit,
            self.cpu_chunk_tokens,
            self._layouts,
        )

    # ------------------------------------------------------------------ snapshots

    def export_engine(self, engine: EngineId) -> bytes:
        """One engine's exact state as msgpack (indexer/snapshot.py). KeyError if unknown."""
        e = self._engines.get(engine)
        if e is None:
            raise KeyError(engine)
        return encode_snapshot(self._residency, e)

    def export_engine_chunks(self, engine: EngineId) -> EngineExport:
        """:meth:`export_engine` as of this call, encoded a slice per piece while events keep
        being applied in between (indexer/snapshot.py). KeyError if unknown."""
        e = self._engines.get(engine)
        if e is None:
            raise KeyError(engine)
        return EngineExport(self._residency, e)

    def import_engine(self, engine: EngineId, data: bytes) -> None:
        """Replace an engine's state with an :meth:`export_engine` snapshot.

        Raises ``ValueError`` on a malformed snapshot (the engine is then left empty)."""
        try:
            state = decode_snapshot(data)
        except ValueError:
            self.clear_engine(engine)
            raise
        e = self._engines.get(engine) or self._new_engine(engine, state.model)
        restore_snapshot(self._residency, e, state)
        if self._residency.total > self.max_entries:
            enforce_cap(self._residency, self._engines, self.max_entries, self.overflowed)

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
                    **({"attention_chunk": s.attention_chunk} if s.kind == CHUNKED else {}),
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

    def attention_chunk_unknown(self, engine: EngineId) -> bool:
        """Whether the engine has a chunked-local-attention group whose chunk the index was not
        told: matched as full attention, so it under-counts such hits by design."""
        e = self._engines.get(engine)
        return e is not None and any(
            s.kind == CHUNKED and s.attention_chunk is None for s in e.groups.values()
        )

    def group_specs(self, engine: EngineId) -> tuple[GroupSpec, ...]:
        """The engine's KV-cache groups as its events declared them (or its configuration
        did), as matching reads them (under EAGLE, :func:`indexer.eagle.eagle_groups`); empty
        while unknown. What a prediction made before the engine's events arrive needs: its
        hits' alignment, and which groups keep blocks only sparsely (router/speculative.py)."""
        e = self._engines.get(engine)
        if e is None:
            return ()
        return tuple((eagle_groups(e.groups) if e.eagle else e.groups).values())

    def resident_blocks(self, engine: EngineId) -> int:
        e = self._engines.get(engine)
        return 0 if e is None else sum(e.resident.values())

    def holds(self, engine: EngineId, group_idx: int, medium: str, key: int) -> bool:
        """Whether ``engine`` holds the block named ``key`` (tests and /debug)."""
        e = self._engines.get(engine)
        return e is not None and self._residency.holds(e, group_idx, medium, key)
