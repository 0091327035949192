"""What the index keeps per engine: its bit, its hash map, its groups and its counters."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from indexer.export_log import ExportLog
from indexer.staggered import HashMap
from indexer.types import EngineId, GroupSpec
from indexer.vllm_hash import VllmHashLocator
from indexer.wire import BlockHash, BlockStored

__all__ = ["COUNTERS", "EngineState", "next_epoch"]

COUNTERS = (
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
    "key_mismatch",
    "partial_blocks",
    "partial_unplaced",
    "overflow_resets",
)


_epochs = itertools.count(1)


def next_epoch() -> int:
    """A number no engine state has had in this process."""
    return next(_epochs)


@dataclass(slots=True)
class EngineState:
    """One engine's share of the index.

    ``hashes``: engine hash -> content key; ``extra_refs``: engine hash -> references beyond the
    first (see indexer/residency.py). ``groups`` are the group facts in use, learned from events
    or taken from ``configured_groups``; ``group_facts`` the raw facts last seen per group.
    ``resident`` counts entries per (group, medium). ``pending`` holds stores waiting for an
    unknown parent, with the batch number they arrived in; ``pending_removed`` the hashes removed
    while they wait. ``exports`` are the logs of the chunked exports reading it
    (indexer/export_log.py): every change to its residency records the pre-image there first.
    """

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
    eagle: bool = False
    """vLLM drops the last matched block (EAGLE / MTP drafting): learned from events carrying
    ``lookahead_token_ids``, or set for every engine by ``PrefixIndex(eagle=True)``."""
    bit: int = 0
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    exports: list[ExportLog] = field(default_factory=list)
    epoch: int = field(default_factory=next_epoch)
    """Renewed whenever the engine's state is dropped (``AllBlocksCleared``, a restart, a
    reset): credit given to the engine outside the index before then (the router's speculative
    entries and session bindings) no longer holds."""
