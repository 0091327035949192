"""Fuzz and format tests for indexer.wire.decode_payload.

The contract (wire.py docstring): a payload either decodes to a ``DecodedBatch`` of well-typed
events, or raises ``DecodeError`` -- never any other exception, because the subscriber treats
a DecodeError as one lost batch (a gap to replay) and anything else as an internal error.

Both eras of the event encoding are covered: vLLM >= 0.24 sends each event as a msgpack map
tagged by ``"type"``; vLLM <= 0.23 sent a tagged positional array, whose field order is
``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window]``,
``["BlockRemoved", block_hashes, medium, group_idx]``, ``["AllBlocksCleared"]``, with trailing
fields at their defaults trimmed by older versions (reference §1.1-1.3).
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from indexer.index import PrefixIndex
from indexer.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    DecodeError,
    decode_payload,
)

enc = msgspec.msgpack.encode

FUZZ = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

STORED_ARRAY_ORDER = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
REMOVED_ARRAY_ORDER = ("block_hashes", "medium", "group_idx")
STORED_REQUIRED = ("block_hashes", "parent_block_hash", "token_ids", "block_size")
STORED_033_ONLY = ("locality", "ownership", "session_id", "lookahead_token_ids")


def decode_or_error(payload: bytes) -> DecodedBatch | None:
    """The contract under test: a DecodedBatch, or DecodeError (returned as None)."""
    try:
        batch = decode_payload(payload)
    except DecodeError:
        return None
    except BaseException as exc:  # the assertion: nothing else may escape
        raise AssertionError(
            f"decode_payload raised {type(exc).__name__}: {exc!r} for {payload[:80]!r}"
        ) from exc
    assert_well_typed(batch)
    return batch


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _opt(x: Any, pred) -> bool:
    return x is None or pred(x)


def _is_hash(x: Any) -> bool:
    return _is_int(x) or isinstance(x, bytes)


def _is_str(x: Any) -> bool:
    return isinstance(x, str)


def assert_well_typed(batch: Any) -> None:
    """What the index relies on when it applies a decoded batch."""
    assert isinstance(batch, DecodedBatch)
    assert isinstance(batch.ts, float)
    assert _opt(batch.data_parallel_rank, _is_int)
    assert batch.unknown_events >= 0 and batch.unknown_fields >= 0
    for ev in batch.events:
        assert type(ev) in (BlockStored, BlockRemoved, AllBlocksCleared), type(ev)
        if isinstance(ev, BlockStored):
            assert isinstance(ev.block_hashes, list) and all(map(_is_hash, ev.block_hashes))
            assert _opt(ev.parent_block_hash, _is_hash)
            assert isinstance(ev.token_ids, list) and all(map(_is_int, ev.token_ids))
            assert _is_int(ev.block_size)
            assert _opt(ev.lora_id, _is_int)
            for name in (
                "medium",
                "lora_name",
                "kv_cache_spec_kind",
                "locality",
                "ownership",
                "session_id",
            ):
                assert _opt(getattr(ev, name), _is_str), name
            assert _opt(ev.extra_keys, lambda x: isinstance(x, list))
            assert _opt(ev.group_idx, _is_int)
            assert _opt(ev.kv_cache_spec_sliding_window, _is_int)
            assert _opt(
                ev.lookahead_token_ids,
                lambda x: all(isinstance(r, list) and all(map(_is_int, r)) for r in x),
            )
        elif isinstance(ev, BlockRemoved):
            assert isinstance(ev.block_hashes, list) and all(map(_is_hash, ev.block_hashes))
            for name in ("medium", "locality", "ownership"):
                assert _opt(getattr(ev, name), _is_str), name
            assert _opt(ev.group_idx, _is_int)


# --------------------------------------------------------------------------- strategies

U64 = st.integers(0, 2**64 - 1)
HASH = st.one_of(
    U64,
    st.integers(2**63, 2**64 - 1),
    st.binary(min_size=32, max_size=32),
    st.binary(min_size=16, max_size=16),
)
SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=12),
    st.binary(max_size=40),
)
ANY = st.recursive(
    SCALAR,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.one_of(st.text(max_size=12), st.integers(-3, 3)), inner, max_size=5),
    ),
    max_leaves=20,
)
OPT_INT = st.one_of(st.none(), st.integers(0, 2**31))
OPT_STR = st.one_of(st.none(), st.text(max_size=8))


@st.composite
def stored_fields(draw: st.DrawFn, new_fields: bool = True) -> dict[str, Any]:
    """A BlockStored's fields as vLLM 0.33 would send them (None = at its default)."""
    bs = draw(st.sampled_from([16, 32, 0, 1]))
    n = draw(st.integers(0, 4))
    f: dict[str, Any] = {
        "block_hashes": draw(st.lists(HASH, min_size=n, max_size=n)),
        "parent_block_hash": draw(st.one_of(st.none(), HASH)),
        "token_ids": draw(st.lists(st.integers(0, 2**32 - 1), max_size=n * max(bs, 1))),
        "block_size": bs,
        "lora_id": draw(OPT_INT),
        "medium": draw(st.sampled_from([None, "GPU", "CPU", "STORAGE"])),
        "lora_name": draw(OPT_STR),
        "extra_keys": draw(
            st.one_of(
                st.none(),
                st.lists(
                    st.one_of(
                        st.none(),
                        st.lists(st.one_of(st.text(max_size=5), st.integers(0, 99)), max_size=3),
                    ),
                    max_size=n,
                ),
            )
        ),
        "group_idx": draw(st.one_of(st.none(), st.integers(0, 3))),
        "kv_cache_spec_kind": draw(st.sampled_from([None, "full_attention", "sliding_window"])),
        "kv_cache_spec_sliding_window": draw(st.one_of(st.none(), st.sampled_from([32, 4096]))),
    }
    if new_fields:
        f["locality"] = draw(st.sampled_from([None, "LOCAL", "REMOTE"]))
        f["ownership"] = draw(OPT_STR)
        f["session_id"] = draw(OPT_STR)
        f["lookahead_token_ids"] = draw(
            st.one_of(st.none(), st.lists(st.lists(st.integers(0, 1000), max_size=3), max_size=3))
        )
    return f


@st.composite
def removed_fields(draw: st.DrawFn, new_fields: bool = True) -> dict[str, Any]:
    f: dict[str, Any] = {
        "block_hashes": draw(st.lists(HASH, min_size=1, max_size=4)),
        "medium": draw(st.sampled_from([None, "GPU", "CPU"])),
        "group_idx": draw(st.one_of(st.none(), st.integers(0, 3))),
    }
    if new_fields:
        f["locality"] = draw(st.sampled_from([None, "LOCAL"]))
        f["ownership"] = draw(OPT_STR)
    return f


def as_map(tag: str, fields: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    """msgspec omit_defaults: fields still at their default (None) are left out, required
    fields are always written (vLLM 0.33: lora_id, medium and lora_name are required too)."""
    out: dict[str, Any] = {"type": tag}
    for k, v in fields.items():
        if v is not None or k in required:
            out[k] = v
    return out


def as_array(tag: str, fields: dict[str, Any], order: tuple[str, ...], trim: bool) -> list:
    """The <= 0.23 positional form; ``trim``: trailing default fields left out."""
    values = [fields.get(k) for k in order]
    if trim:
        while values and values[-1] is None:
            values.pop()
    return [tag, *values]


STORED_MAP_REQUIRED = (*STORED_REQUIRED, "lora_id", "medium", "lora_name")


@st.composite
def events(draw: st.DrawFn) -> tuple[Any, Any]:
    """(wire form, the event it must decode to), in either era's encoding."""
    kind = draw(st.sampled_from(["stored", "removed", "cleared"]))
    arrayform = draw(st.booleans())
    if kind == "cleared":
        return (
            ["AllBlocksCleared"] if arrayform else {"type": "AllBlocksCleared"},
            AllBlocksCleared(),
        )
    if kind == "stored":
        f = draw(stored_fields(new_fields=not arrayform))
        want = BlockStored(**f)
        if arrayform:
            return as_array("BlockStored", f, STORED_ARRAY_ORDER, draw(st.booleans())), want
        return as_map("BlockStored", f, STORED_MAP_REQUIRED), want
    f = draw(removed_fields(new_fields=not arrayform))
    want = BlockRemoved(**f)
    if arrayform:
        return as_array("BlockRemoved", f, REMOVED_ARRAY_ORDER, draw(st.booleans())), want
    return as_map("BlockRemoved", f, ("block_hashes", "medium")), want


@st.composite
def batches(draw: st.DrawFn) -> tuple[list, DecodedBatch]:
    """A batch as some vLLM era sends it: [ts, events], [ts, events, dp], [ts, events, dp, x]."""
    pairs = draw(st.lists(events(), max_size=5))
    ts = draw(st.one_of(st.floats(0, 2e9), st.integers(0, 2**31)))
    dp = draw(st.one_of(st.none(), st.integers(0, 7)))
    shape = draw(st.sampled_from([2, 3, 4]))
    raw: list[Any] = [ts, [w for w, _ in pairs]]
    if shape >= 3:
        raw.append(dp)
    if shape == 4:
        raw.append(draw(ANY))  # e.g. a future publisher_id
    want = DecodedBatch(float(ts), [e for _, e in pairs], dp if shape >= 3 else None)
    return raw, want


# --------------------------------------------------------------------------- fuzz


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_decode_or_decode_error(payload: bytes) -> None:
    decode_or_error(payload)


@FUZZ
@given(ANY)
def test_random_msgpack_structures_decode_or_decode_error(obj: Any) -> None:
    decode_or_error(enc(obj))


@FUZZ
@given(
    st.lists(ANY, max_size=4),
    st.lists(
        st.one_of(
            ANY,
            st.dictionaries(
                st.just("type"),
                st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Nope"]),
                min_size=1,
            ),
        ),
        max_size=4,
    ),
)
def test_batch_shaped_garbage_decode_or_decode_error(head: list, evs: list) -> None:
    """Batch-shaped payloads whose parts are random: [ts?, events?, ...]."""
    decode_or_error(enc([*head[:1], evs, *head[1:]]))
    decode_or_error(enc([0.0, evs]))


@FUZZ
@given(batches(), st.data())
def test_byte_mutations_of_valid_payloads(
    batch: tuple[list, DecodedBatch], data: st.DataObject
) -> None:
    payload = bytearray(enc(batch[0]))
    op = data.draw(st.sampled_from(["truncate", "flip", "insert", "delete", "splice"]))
    i = data.draw(st.integers(0, max(len(payload) - 1, 0)))
    if op == "truncate":
        payload = payload[:i]
    elif op == "flip" and payload:
        payload[i] ^= data.draw(st.integers(1, 255))
    elif op == "insert":
        payload[i:i] = data.draw(st.binary(min_size=1, max_size=9))
    elif op == "delete":
        del payload[i : i + data.draw(st.integers(1, 9))]
    else:
        payload[i:] = enc(data.draw(ANY))
    decode_or_error(bytes(payload))


@FUZZ
@given(batches(), st.data())
def test_structural_mutations_of_valid_payloads(
    batch: tuple[list, DecodedBatch], data: st.DataObject
) -> None:
    """Drop or replace a field (with a value of any type), or replace a whole part."""
    raw = batch[0]
    evs = raw[1]
    target = data.draw(st.sampled_from(["ts", "events", "dp", "event"] if evs else ["ts", "dp"]))
    if target == "ts":
        raw[0] = data.draw(ANY)
    elif target == "events":
        raw[1] = data.draw(ANY)
    elif target == "dp":
        raw[2:3] = [data.draw(ANY)]
    else:
        j = data.draw(st.integers(0, len(evs) - 1))
        ev = evs[j]
        if isinstance(ev, dict):
            key = data.draw(st.sampled_from(sorted(ev)))
            if data.draw(st.booleans()):
                del ev[key]
            else:
                ev[key] = data.draw(ANY)
        else:
            k = data.draw(st.integers(0, len(ev) - 1))
            if data.draw(st.booleans()):
                del ev[k:]
            else:
                ev[k] = data.draw(ANY)
    decode_or_error(enc(raw))


@FUZZ
@given(st.sampled_from(STORED_ARRAY_ORDER + STORED_033_ONLY), ANY, stored_fields())
def test_wrong_type_in_each_stored_field(name: str, value: Any, f: dict) -> None:
    """Whatever value a field holds, the batch decodes (and the value then has the field's
    type) or is rejected -- in the map form (fast path) and in the array form."""
    f[name] = value
    decode_or_error(enc([1.0, [as_map("BlockStored", f, STORED_MAP_REQUIRED)], 0]))
    if name in STORED_ARRAY_ORDER:
        decode_or_error(enc([1.0, [as_array("BlockStored", f, STORED_ARRAY_ORDER, False)], 0]))


@FUZZ
@given(st.sampled_from((*REMOVED_ARRAY_ORDER, "locality", "ownership")), ANY, removed_fields())
def test_wrong_type_in_each_removed_field(name: str, value: Any, f: dict) -> None:
    f[name] = value
    decode_or_error(enc([1.0, [as_map("BlockRemoved", f, ("block_hashes", "medium"))]]))
    if name in REMOVED_ARRAY_ORDER:
        decode_or_error(enc([1.0, [as_array("BlockRemoved", f, REMOVED_ARRAY_ORDER, False)]]))


# --------------------------------------------------------------------------- valid payloads


@FUZZ
@given(batches())
def test_valid_batches_of_either_era_decode_exactly(batch: tuple[list, DecodedBatch]) -> None:
    raw, want = batch
    got = decode_or_error(enc(raw))
    assert got is not None
    assert got.events == want.events
    assert got.ts == want.ts
    assert got.data_parallel_rank == want.data_parallel_rank
    assert got.unknown_events == 0
    assert got.unknown_fields == 0


@FUZZ
@given(st.lists(st.tuples(stored_fields(new_fields=False), st.booleans()), min_size=1, max_size=4))
def test_fast_and_generic_paths_agree(items: list[tuple[dict, bool]]) -> None:
    """The typed fast path (known map keys only) and the generic path (taken when any event
    has an unknown key or is an array) must produce the same events."""
    fields = [f for f, _ in items]
    maps = [as_map("BlockStored", f, STORED_MAP_REQUIRED) for f in fields]
    fast = decode_or_error(enc([2.5, maps, 1]))
    arrays = [as_array("BlockStored", f, STORED_ARRAY_ORDER, trim) for f, trim in items]
    generic_arrays = decode_or_error(enc([2.5, arrays, 1]))
    extra = [{**m, "future_field": [1, {"x": None}]} for m in maps]
    generic_maps = decode_or_error(enc([2.5, extra, 1]))
    assert fast is not None and generic_arrays is not None and generic_maps is not None
    assert fast.events == generic_arrays.events == generic_maps.events
    assert fast.events == [BlockStored(**f) for f in fields]
    assert generic_maps.unknown_fields == len(items)


# --------------------------------------------------------------------------- deterministic

H_BIG = 2**64 - 1
H_HI = 2**63 + 12345
H_BYTES = bytes(range(32))

STORED_033 = {
    "type": "BlockStored",
    "block_hashes": [H_HI, H_BIG],
    "parent_block_hash": 2**63,
    "token_ids": list(range(64)),
    "block_size": 32,
    "lora_id": 7,
    "medium": "GPU",
    "lora_name": "adapter-a",
    "extra_keys": [["adapter-a", "salt"], None],
    "group_idx": 1,
    "kv_cache_spec_kind": "sliding_window",
    "kv_cache_spec_sliding_window": 4096,
    "locality": "LOCAL",
    "ownership": "tier-2",
    "session_id": "sess-1",
    "lookahead_token_ids": [[64, 65], [96, 97]],
}


def test_every_033_field_round_trips() -> None:
    batch = decode_or_error(enc([1.25, [STORED_033], 3]))
    assert batch is not None and batch.unknown_fields == 0 and batch.unknown_events == 0
    (ev,) = batch.events
    assert isinstance(ev, BlockStored)
    for k, v in STORED_033.items():
        if k != "type":
            assert getattr(ev, k) == v, k
    removed = {
        "type": "BlockRemoved",
        "block_hashes": [H_BIG],
        "medium": "CPU",
        "group_idx": 2,
        "locality": "REMOTE",
        "ownership": "o",
    }
    batch = decode_or_error(enc([1.25, [removed], 0]))
    assert batch is not None
    assert batch.events == [BlockRemoved([H_BIG], "CPU", 2, "REMOTE", "o")]


def _same_events_both_eras() -> tuple[list, list, list]:
    stored = {k: STORED_033[k] for k in ("type", *STORED_ARRAY_ORDER)}
    maps = [
        stored,
        {"type": "BlockRemoved", "block_hashes": [H_HI], "medium": "GPU", "group_idx": 1},
        {"type": "AllBlocksCleared"},
    ]
    arrays = [
        ["BlockStored", *(stored[k] for k in STORED_ARRAY_ORDER)],
        ["BlockRemoved", [H_HI], "GPU", 1],
        ["AllBlocksCleared"],
    ]
    want = [
        BlockStored(**{k: stored[k] for k in STORED_ARRAY_ORDER}),
        BlockRemoved([H_HI], "GPU", 1),
        AllBlocksCleared(),
    ]
    return maps, arrays, want


@pytest.mark.parametrize("shape", [2, 3, 4])
def test_map_and_array_eras_decode_to_equal_events(shape: int) -> None:
    maps, arrays, want = _same_events_both_eras()
    tail = [5, "publisher-xyz"][: shape - 2]
    a = decode_or_error(enc([1.5, maps, *tail]))
    b = decode_or_error(enc([1.5, arrays, *tail]))
    mixed = decode_or_error(enc([1.5, [arrays[0], maps[1], arrays[2]], *tail]))
    assert a is not None and b is not None and mixed is not None
    assert a.events == b.events == mixed.events == want
    for x in (a, b, mixed):
        assert x.ts == 1.5
        assert x.data_parallel_rank == (5 if shape >= 3 else None)
        assert x.unknown_fields == 0 and x.unknown_events == 0


def test_dp_rank_nil_and_integer_ts() -> None:
    """0.33 with msgspec writes data_parallel_rank=None as nil; ts may arrive as an int."""
    batch = decode_or_error(enc([17, [{"type": "AllBlocksCleared"}], None]))
    assert batch is not None
    assert batch.ts == 17.0 and isinstance(batch.ts, float)
    assert batch.data_parallel_rank is None


@pytest.mark.parametrize("n", range(4, 12))
def test_old_arrays_with_trailing_fields_trimmed(n: int) -> None:
    """Each older vLLM wrote fewer trailing fields; missing ones take their defaults."""
    full = [
        "BlockStored",
        [H_HI],
        None,
        list(range(16)),
        16,
        None,
        "GPU",
        None,
        None,
        0,
        "full_attention",
        None,
    ]
    batch = decode_or_error(enc([0.0, [full[: n + 1]]]))
    assert batch is not None
    (ev,) = batch.events
    assert ev.block_hashes == [H_HI] and ev.token_ids == list(range(16))
    assert ev.block_size == 16
    assert ev.medium == ("GPU" if n >= 6 else None)
    assert ev.group_idx == (0 if n >= 9 else None)
    assert ev.kv_cache_spec_kind == ("full_attention" if n >= 10 else None)
    for removed, medium, group in (
        (["BlockRemoved", [H_BIG]], None, None),
        (["BlockRemoved", [H_BIG], "CPU"], "CPU", None),
        (["BlockRemoved", [H_BIG], "GPU", 3], "GPU", 3),
    ):
        batch = decode_or_error(enc([0.0, [removed]]))
        assert batch is not None
        assert batch.events == [BlockRemoved([H_BIG], medium, group)]


def test_array_with_appended_future_fields_counts_them() -> None:
    arr = ["BlockRemoved", [1], "GPU", 0, "LOCAL", "own", "future-1", "future-2"]
    batch = decode_or_error(enc([0.0, [arr, ["AllBlocksCleared", "x"]]]))
    assert batch is not None
    assert batch.events == [BlockRemoved([1], "GPU", 0, "LOCAL", "own"), AllBlocksCleared()]
    assert batch.unknown_fields == 3


def test_unknown_keys_and_event_types_are_skipped_and_counted() -> None:
    maps, _, want = _same_events_both_eras()
    maps[0] = {**maps[0], "new_thing": 1, "other": {"a": [1]}}
    maps[2] = {**maps[2], "medium": "GPU"}
    evs = [
        {"type": "BlockInactive", "block_hashes": [1]},
        *maps,
        ["SnapshotMarker", 1, 2],
        {"type": "Heartbeat"},
    ]
    batch = decode_or_error(enc([9.0, evs, 0, "publisher-id"]))
    assert batch is not None
    assert batch.events == want
    assert batch.unknown_events == 3
    assert batch.unknown_fields == 3


@pytest.mark.parametrize("h", [0, 2**63 - 1, 2**63, H_HI, H_BIG, H_BYTES, bytes(16)])
def test_hash_values_accepted_as_they_arrive(h: int | bytes) -> None:
    for ev in (
        {
            "type": "BlockStored",
            "block_hashes": [h],
            "parent_block_hash": h,
            "token_ids": [1] * 16,
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        },
        ["BlockStored", [h], h, [1] * 16, 16, None, "GPU"],
        {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"},
        ["BlockRemoved", [h], "GPU", 0],
    ):
        batch = decode_or_error(enc([0.0, [ev]]))
        assert batch is not None
        (got,) = batch.events
        assert got.block_hashes == [h] and type(got.block_hashes[0]) is type(h)
        if isinstance(got, BlockStored):
            assert got.parent_block_hash == h


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        enc({"ts": 1.0, "events": []}),
        enc([1.0]),
        enc(["1.0", []]),
        enc([True, []]),
        enc([1.0, {}]),
        enc([1.0, [], True]),
        enc([1.0, [], "0"]),
        enc([1.0, [[]]]),
        enc([1.0, [5]]),
        enc([1.0, [[5, 1]]]),
        enc([1.0, [{"block_hashes": [1]}]]),
        enc([1.0, [{"type": 3}]]),
        enc([1.0, [{"type": "BlockStored"}]]),
        enc([1.0, [["BlockStored", [1]]]]),
        enc([1.0, [{"type": "BlockRemoved", "block_hashes": [True], "medium": "GPU"}]]),
        enc([1.0, [{"type": "BlockRemoved", "block_hashes": [1.5], "medium": "GPU"}]]),
        enc([1.0, [{"type": "BlockRemoved", "block_hashes": ["ab"], "medium": "GPU"}]]),
        enc(
            [
                1.0,
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": [1],
                        "parent_block_hash": None,
                        "token_ids": [1],
                        "block_size": 16.0,
                    }
                ],
            ]
        ),
        enc(
            [
                1.0,
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": [1],
                        "parent_block_hash": None,
                        "token_ids": [1],
                        "block_size": True,
                    }
                ],
            ]
        ),
        enc(
            [
                1.0,
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": [1],
                        "parent_block_hash": None,
                        "token_ids": ["a"],
                        "block_size": 16,
                    }
                ],
            ]
        ),
        msgspec.msgpack.encode([1.0, [msgspec.msgpack.Ext(5, b"x")]]),
        b"\x92\xd6\xff\x00\x00\x00\x01\x90",  # ts is a msgpack timestamp (a datetime)
        b"\x92\xd7\xff" + b"\xff" * 8 + b"\x90",  # an invalid timestamp
        b"\x92\x00\x91\x81\x81\x01\x02\x03",  # a map used as a map key
        b"\xdd\xff\xff\xff\xff",  # array32 header, no body
    ],
)
def test_malformed_payloads_raise_decode_error(payload: bytes) -> None:
    assert decode_or_error(payload) is None


# --------------------------------------------------------------------------- bugs


@pytest.mark.parametrize(
    "payload",
    [
        b"\x91" * 5000 + b"\x90",  # the whole batch nested
        b"\x92\x00" + b"\x91" * 5000 + b"\x90",  # the events list nested
        enc(
            [
                0.0,
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": [1],
                        "parent_block_hash": None,
                        "token_ids": [],
                        "block_size": 16,
                        "lora_id": None,
                        "medium": "GPU",
                        "lora_name": None,
                        "extra_keys": [None],
                    }
                ],
            ]
        )[:-2]
        + b"\x91" * 5000
        + b"\x90",  # a valid event whose extra_keys entry is nested
    ],
    ids=["batch", "events", "extra_keys"],
)
def test_deeply_nested_payload_raises_decode_error(payload: bytes) -> None:
    decode_or_error(payload)


# --------------------------------------------------------------------------- decode -> apply


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_any_decoded_batch_applies_without_raising(batch: tuple[list, DecodedBatch]) -> None:
    """The index counts malformed events (unaligned_blocks, malformed_events, unknown
    parents...) instead of raising: whatever the decoder accepts must apply cleanly."""
    raw, _ = batch
    got = decode_or_error(enc(raw))
    assume(got is not None)
    idx = PrefixIndex()
    idx.add_engine(("w", 0), "m")
    idx.apply(("w", 0), got.events)
    idx.apply(("w", 0), got.events)
    idx.match(list(range(100)), idx.root("m"))


@pytest.mark.parametrize("token", [-1, 2**32, 2**64 - 1])
def test_out_of_range_token_ids_are_rejected_or_counted(token: int) -> None:
    payload = enc(
        [
            0.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [1],
                    "parent_block_hash": None,
                    "token_ids": [token] * 16,
                    "block_size": 16,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                }
            ],
            0,
        ]
    )
    batch = decode_or_error(payload)
    if batch is None:
        return  # rejected by the decoder: fine
    idx = PrefixIndex()
    idx.apply(("w", 0), batch.events)  # must count the event, not raise
