"""The index's vocabulary: engines, media and KV-cache group kinds.

Declared once here for the whole project: the router names engines with :data:`EngineId` too.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CHUNKED",
    "CPU",
    "FULL",
    "GPU",
    "MAMBA",
    "SLIDING",
    "EngineId",
    "GroupSpec",
    "group_kind",
]

EngineId = tuple[str, int]
"""(worker id, data-parallel rank): one vLLM scheduler with its own cache and sequence numbers."""

GPU = "GPU"
CPU = "CPU"

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
    attention_chunk: int | None = None
    """Tokens per chunk of a chunked-local-attention group. vLLM's events do not carry it; None
    (unknown) reads the group as full attention, which never credits more than vLLM hits and is
    exact for every point inside the first chunk."""
    eagle: bool = False
    """Matching only (indexer/eagle.py): the group drops its last matched block."""
