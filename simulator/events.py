"""KV-cache event structs and encoders, byte-compatible with vLLM.

Map era (vLLM >= 0.24, PR #42892): ``vllm/distributed/kv_events.py`` 0.33 L31-L148:
``EventBatch`` is ``array_like`` + ``omit_defaults``; events are tagged maps
(``tag=True`` -> key ``"type"``, class name as value) with ``omit_defaults``: required
fields are always written (even null), defaulted fields only when not at default.
Array era (vLLM <= 0.23): the same events with ``array_like=True`` (positional, the tag
first), without the fields added after 0.23 (locality, ownership, session_id, ...).
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


# ---- map era (0.24 .. 0.33) -------------------------------------------------------------
class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class BlockStored032(KVCacheEvent, tag="BlockStored"):
    """0.32 layout (no ``lookahead_token_ids``): 14 fields + tag, so msgspec writes a
    fixmap header exactly like the captures; 0.33's 15 fields make msgspec use map16."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# ---- array era (<= 0.23) ------------------------------------------------------------------
class _OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class OldBlockStored(_OldEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class OldBlockRemoved(_OldEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class OldAllBlocksCleared(_OldEvent, tag="AllBlocksCleared"):
    pass


class OldKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[OldBlockStored | OldBlockRemoved | OldAllBlocksCleared]
    data_parallel_rank: int | None = None


Event = BlockStored | BlockRemoved | AllBlocksCleared

_ENC = msgspec.msgpack.Encoder()


def _to_old(ev: Event) -> OldBlockStored | OldBlockRemoved | OldAllBlocksCleared:
    if isinstance(ev, BlockStored):
        return OldBlockStored(
            ev.block_hashes,
            ev.parent_block_hash,
            ev.token_ids,
            ev.block_size,
            ev.lora_id,
            ev.medium,
            ev.lora_name,
            ev.extra_keys,
            ev.group_idx,
            ev.kv_cache_spec_kind,
            ev.kv_cache_spec_sliding_window,
        )
    if isinstance(ev, BlockRemoved):
        return OldBlockRemoved(ev.block_hashes, ev.medium, ev.group_idx)
    return OldAllBlocksCleared()


class KVEventBatch032(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored032 | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def _to_032(ev: Event) -> BlockStored032 | BlockRemoved | AllBlocksCleared:
    if isinstance(ev, BlockStored):
        return BlockStored032(
            ev.block_hashes,
            ev.parent_block_hash,
            ev.token_ids,
            ev.block_size,
            ev.lora_id,
            ev.medium,
            ev.lora_name,
            ev.extra_keys,
            ev.group_idx,
            ev.kv_cache_spec_kind,
            ev.kv_cache_spec_sliding_window,
            ev.locality,
            ev.ownership,
            ev.session_id,
        )
    return ev


ENCODINGS = ("map", "array", "map-0.32")


def encode_batch(ts: float, events: list[Event], dp_rank: int, encoding: str = "map") -> bytes:
    """The msgpack payload frame exactly as ``ZmqEventPublisher`` sends it."""
    if encoding == "array":
        return _ENC.encode(OldKVEventBatch(ts, [_to_old(e) for e in events], dp_rank))
    if encoding == "map-0.32":
        return _ENC.encode(KVEventBatch032(ts, [_to_032(e) for e in events], dp_rank))
    return _ENC.encode(KVEventBatch(ts, list(events), dp_rank))
