"""Decode vLLM KV-cache event payloads of every era into one normalized form.

The payload is the third frame of a ZMQ message: msgpack of an array-like ``EventBatch``
``[ts, events, data_parallel_rank, ...]`` (2 elements before the DP field existed, more when a
future vLLM appends fields). Each event is either

* a map tagged by ``"type"`` (vLLM >= 0.24, msgspec ``tag=True`` without ``array_like``), or
* a tagged positional array ``["BlockStored", hashes, parent, ...]`` (vLLM <= 0.23).

Why two paths: the fast path decodes the common case (maps, only known keys) with one typed
msgspec call, entirely in C. Anything else -- positional arrays, unknown keys, unknown event
types -- fails that strict schema and is re-decoded generically, where unknown keys and types are
skipped and *counted* (``DecodedBatch.unknown_fields`` / ``unknown_events``). A malformed
payload raises :class:`DecodeError` and nothing else; the caller treats it like a lost message.

Where the C extension is built, ``decode_payload`` first tries ``indexer._native.decode_batch``
(indexer/_ingest.c), which takes the common shape only -- map-encoded events with known keys,
int hashes, token ids in [0, 2**32), no extra keys but nils, no look-ahead tokens -- and keeps
each event's hashes and token ids as packed bytes: :class:`PackedEvents`. The index applies those
without making a Python object per block (indexer/ingest.py); anyone else reading the events gets
exactly the objects the Python decoder makes, built on first access. Anything else, malformed or
merely unusual, goes to the Python decoder, which is the reference: ``decode_payload_py``.

Block hashes are kept as they arrive: ``int`` (the low 64 bits of vLLM's digest, possibly
>= 2**63) or ``bytes`` (full digest, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``). The index
only uses them as opaque dictionary keys, so no conversion is needed.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from typing import Any, overload

import msgspec

from indexer.keys import _native

__all__ = [
    "CLEARED",
    "REMOVED",
    "STORED",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "DecodeError",
    "DecodedBatch",
    "Event",
    "PackedEvents",
    "decode_payload",
    "decode_payload_py",
]

BlockHash = int | bytes


class DecodeError(ValueError):
    """The payload is not a vLLM KV-event batch. The whole batch must be treated as lost."""


class BlockStored(
    msgspec.Struct, tag="BlockStored", tag_field="type", forbid_unknown_fields=True, gc=False
):
    """Blocks that became cached on a worker (vLLM 0.33 field set, all later fields optional)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(
    msgspec.Struct, tag="BlockRemoved", tag_field="type", forbid_unknown_fields=True, gc=False
):
    """Cached blocks evicted (vLLM sends one hash per event on GPU, many on CPU)."""

    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(
    msgspec.Struct, tag="AllBlocksCleared", tag_field="type", forbid_unknown_fields=True, gc=False
):
    """The worker's prefix cache was reset. Carries no medium: drop every medium."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class DecodedBatch(msgspec.Struct, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None
    unknown_events: int = 0
    """Events of a type this decoder does not know (skipped)."""
    unknown_fields: int = 0
    """Map keys this decoder does not know (ignored)."""


class _FastBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_fast_decoder = msgspec.msgpack.Decoder(_FastBatch)
_generic_decoder = msgspec.msgpack.Decoder()

# Field order of the positional (<= 0.23) encoding, after the tag. Trailing fields at their
# defaults were omitted by msgspec's omit_defaults, so arrays may be shorter than this.
_ARRAY_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": BlockStored.__struct_fields__,
    "BlockRemoved": BlockRemoved.__struct_fields__,
    "AllBlocksCleared": (),
}
_TYPES: dict[str, type[Event]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}
_KNOWN_KEYS: dict[str, frozenset[str]] = {
    name: frozenset(fields) | {"type"} for name, fields in _ARRAY_FIELDS.items()
}


STORED, REMOVED, CLEARED = 0, 1, 2
"""``PackedEvents.records[i][0]``: the event's type."""


def _u64s(data: bytes) -> list[int]:
    a = array("Q")
    a.frombytes(data)
    return a.tolist()


def _u32s(data: bytes) -> list[int]:
    a = array("I")
    a.frombytes(data)
    return a.tolist()


def _event(r: tuple[Any, ...]) -> Event:
    """The event a record stands for, equal to what the Python decoder makes of it."""
    if r[0] == STORED:
        extra = None if r[8] is None else [None] * r[8]
        return BlockStored(_u64s(r[1]), r[2], _u32s(r[3]), r[4], r[5], r[6], r[7], extra, *r[9:])
    if r[0] == REMOVED:
        return BlockRemoved(_u64s(r[1]), *r[2:6])
    return AllBlocksCleared()


def _events(r: tuple[Any, ...]) -> list[Event]:
    """The events a record stands for: one, or a removed record's run of one-hash events."""
    if r[0] == REMOVED and r[6] > 1:
        return [BlockRemoved([h], *r[2:6]) for h in _u64s(r[1])]
    return [_event(r)]


class PackedEvents(Sequence[Event]):
    """A batch's events as decoded by ``indexer._native.decode_batch``: a record per event, but
    one for each run of one-hash removals.

    A stored record is ``(STORED, hashes, parent, tokens, block_size, lora_id, medium,
    lora_name, extra_count, group_idx, kv_cache_spec_kind, window, locality, ownership,
    session_id)``, a removed one ``(REMOVED, hashes, medium, group_idx, locality, ownership,
    n)``, with ``hashes`` packed uint64 and ``tokens`` packed uint32, little-endian (the byte
    order every supported platform reads them in), ``extra_count`` the number of nil extra keys
    (None: no list). A removed record with ``n`` > 1 stands for ``n`` consecutive BlockRemoved
    events of one hash each (vLLM sends one per evicted block; a record each would cost a tuple
    and a bytes object per block).
    As a sequence it holds the decoded events (``count`` of them), built once on first access;
    :meth:`event_of` and :meth:`events_from` address them by record.
    """

    __slots__ = ("_events", "count", "records")

    def __init__(self, records: list[tuple[Any, ...]], count: int) -> None:
        self.records = records
        self.count = count
        self._events: list[Event] | None = None

    def events(self) -> list[Event]:
        if self._events is None:
            self._events = [ev for r in self.records for ev in _events(r)]
        return self._events

    def event_of(self, i: int) -> Event:
        """The event of record ``i`` (a stored or cleared one, or a removal of one event)."""
        return _event(self.records[i])

    def events_from(self, i: int) -> list[Event]:
        """The events of records ``i`` onwards."""
        return [ev for r in self.records[i:] for ev in _events(r)]

    def __len__(self) -> int:
        return self.count

    @overload
    def __getitem__(self, i: int) -> Event: ...
    @overload
    def __getitem__(self, i: slice) -> list[Event]: ...
    def __getitem__(self, i: int | slice) -> Event | list[Event]:
        return self.events()[i]

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedEvents | list):
            return self.events() == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return repr(self.events())

    __hash__ = None  # type: ignore[assignment]


_native_decode = None if _native is None else _native.decode_batch


def decode_payload(payload: bytes | memoryview) -> DecodedBatch:
    """Decode one msgpack ``EventBatch`` payload; raise :class:`DecodeError` if malformed."""
    if _native_decode is not None:
        try:
            packed = _native_decode(payload)
        except (BufferError, TypeError):  # not a contiguous buffer: the Python decoder judges
            packed = None
        if packed is not None:
            ts, rank, records, count = packed
            return DecodedBatch(ts, PackedEvents(records, count), rank)  # type: ignore[arg-type]
    return decode_payload_py(payload)


def decode_payload_py(payload: bytes | memoryview) -> DecodedBatch:
    """``decode_payload`` by the Python decoder alone: every event a Python object."""
    try:
        fast = _fast_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return _decode_generic(payload)
    except RecursionError:  # a small payload can nest thousands of arrays deep
        raise DecodeError("payload nests too deeply") from None
    return DecodedBatch(fast.ts, fast.events, fast.data_parallel_rank)


def _decode_generic(payload: bytes | memoryview) -> DecodedBatch:
    try:
        raw = _generic_decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise DecodeError(f"payload is not msgpack: {exc}") from None
    except RecursionError:
        raise DecodeError("payload nests too deeply") from None
    if not isinstance(raw, list) or len(raw) < 2:
        raise DecodeError("batch must be a msgpack array [ts, events, dp_rank?, ...]")
    ts, raw_events = raw[0], raw[1]
    dp_rank = raw[2] if len(raw) > 2 else None
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise DecodeError(f"batch ts must be a number, got {type(ts).__name__}")
    if not isinstance(raw_events, list):
        raise DecodeError("batch events must be an array")
    if dp_rank is not None and (isinstance(dp_rank, bool) or not isinstance(dp_rank, int)):
        raise DecodeError("data_parallel_rank must be an int or nil")
    batch = DecodedBatch(float(ts), [], dp_rank)
    for raw_event in raw_events:
        event = _normalize_event(raw_event, batch)
        if event is not None:
            batch.events.append(event)
    return batch


def _normalize_event(raw: Any, batch: DecodedBatch) -> Event | None:
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise DecodeError("event map without a string 'type'")
        if tag not in _TYPES:
            batch.unknown_events += 1
            return None
        known = _KNOWN_KEYS[tag]
        fields = {k: v for k, v in raw.items() if k in known and k != "type"}
        batch.unknown_fields += len(raw) - len(fields) - 1
    elif isinstance(raw, list) and raw:
        tag = raw[0]
        if not isinstance(tag, str):
            raise DecodeError("event array must start with its type tag")
        if tag not in _TYPES:
            batch.unknown_events += 1
            return None
        names = _ARRAY_FIELDS[tag]
        values = raw[1:]
        if len(values) > len(names):
            # A newer positional encoding with appended fields: ignore what we do not know.
            batch.unknown_fields += len(values) - len(names)
            values = values[: len(names)]
        fields = dict(zip(names, values, strict=False))
    else:
        raise DecodeError(f"event must be a map or a tagged array, got {type(raw).__name__}")
    try:
        return msgspec.convert(fields, _TYPES[tag], strict=True)
    except msgspec.ValidationError as exc:
        raise DecodeError(f"malformed {tag}: {exc}") from None
    except RecursionError:
        raise DecodeError(f"malformed {tag}: nests too deeply") from None
