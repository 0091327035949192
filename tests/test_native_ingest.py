"""The native event path (indexer/_ingest.c) against the Python reference.

* Decoding: every payload either takes the C decoder's packed form and then reads exactly as
  the Python decoder's objects, or goes to the Python decoder; truncated, corrupted and
  wrong-typed frames never raise anything but ``DecodeError``.
* Applying: random vLLM-like event streams -- chained stores, unknown parents, duplicates,
  re-announces, removal runs, unknown removals, resets, CPU tiers, LoRA, extras, hybrid groups,
  bytes hashes, malformed events -- leave two indexes, one fed each way, in identical states
  (every table, map, counter and pending event), matching identically.
* The property tests of tests/test_index_property.py run again with every batch going through
  the wire and the native path (``IndexVsReferenceNative``).
"""

from __future__ import annotations

import math
import random
from typing import Any

import msgspec
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tests.test_index_property as prop
from indexer import wire
from indexer.index import PrefixIndex
from indexer.wire import DecodeError, PackedEvents, decode_payload, decode_payload_py
from tests.ingest_impls import as_impl, require_native

NATIVE = wire._native_decode is not None
"""Without the extension (allowed unless KVROUTER_REQUIRE_NATIVE=1) both sides are Python."""

enc = msgspec.msgpack.encode
H_BIG = 2**64 - 5


def stored(hashes: list[Any], parent: Any, tokens: list[int], **extra: Any) -> dict[str, Any]:
    """A vLLM 0.33 BlockStored map (GPU, group 0, full attention unless told)."""
    event = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
        "kv_cache_spec_sliding_window": None,
        "locality": None,
        "ownership": None,
        "session_id": None,
        "lookahead_token_ids": None,
    }
    event.update(extra)
    return event


def removed(hashes: list[Any], **extra: Any) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0} | extra


def same_outcome(payload: bytes) -> None:
    """The contract: both decoders agree, and only DecodeError escapes."""
    try:
        want = decode_payload_py(payload)
    except DecodeError:
        want = None
    try:
        got = decode_payload(payload)
    except DecodeError:
        got = None
    assert (got is None) == (want is None), payload[:120]
    if got is not None and want is not None:
        assert got.events == want.events, payload[:120]
        assert got.data_parallel_rank == want.data_parallel_rank
        assert (got.unknown_events, got.unknown_fields) == (
            want.unknown_events,
            want.unknown_fields,
        )
        assert got.ts == want.ts or (math.isnan(got.ts) and math.isnan(want.ts))
        assert type(got.ts) is float


# --------------------------------------------------------------------------- decoding


def test_common_batches_decode_packed_and_read_as_python_objects() -> None:
    require_native()
    tokens = list(range(48))
    payloads = [
        enc([1.5, [stored([1, 2, H_BIG], None, tokens)], 0]),
        # vLLM 0.32: no locality / ownership / session_id / lookahead keys; no rank field.
        enc([2.5, [{k: v for k, v in stored([7], 3, tokens[:16]).items() if k[0] not in "los"}]]),
        enc([3.5, [removed([H_BIG]), removed([5], medium="CPU"), {"type": "AllBlocksCleared"}], 2]),
    ]
    for payload in payloads:
        batch = decode_payload(payload)
        assert type(batch.events) is PackedEvents or not NATIVE
        assert batch == decode_payload_py(payload)
        assert batch.events[-1:] == decode_payload_py(payload).events[-1:]


# Unsigned ints of every msgpack width (fixint, uint8/16/32/64), with the edges of each.
WIDTHS = [0, 127, 128, 255, 256, 2**16 - 1, 2**16, 2**32 - 1, 2**32, H_BIG, 2**64 - 1]


def test_ints_of_every_width_decode_packed_wherever_they_sit() -> None:
    """Token ids and hashes of mixed widths, also within a few bytes of the payload's end
    (no rank field after a removal), read the same as through the Python decoder."""
    require_native()
    rng = random.Random(7)
    tokens = [rng.choice(WIDTHS[:8]) for _ in range(16 * 8)]
    for order in range(40):
        hashes = [rng.choice(WIDTHS[1:]) for _ in range(8)]
        last = [rng.choice(WIDTHS[1:]) for _ in range(order % 4)] or [WIDTHS[order % 11] or 1]
        for tail in ([], [3]):  # without and with the rank field after the last removal
            payload = enc([1.0, [stored(hashes, None, tokens), removed(last)], *tail])
            batch = decode_payload(payload)
            assert type(batch.events) is PackedEvents
            assert batch == decode_payload_py(payload)


@pytest.mark.parametrize(
    "event",
    [
        stored([1], None, list(range(16)), extra_keys=[["mm", 0]]),  # extras with a value
        stored([b"\x01" * 32], None, list(range(16))),  # bytes hashes
        stored([-3], None, list(range(16))),  # a negative hash
        stored([1], None, [2**32, *list(range(15))]),  # a token id beyond uint32
        stored([1], None, list(range(16)), lookahead_token_ids=[[1, 2]]),
        stored([1], None, list(range(16)), surprise=1),  # an unknown key
        ["BlockStored", [1], None, list(range(16)), 16],  # the <= 0.23 positional form
        {"type": "Unheard"},
    ],
)
def test_unusual_events_go_to_the_python_decoder(event: Any) -> None:
    payload = enc([1.0, [event], 0])
    assert wire._native_decode is None or wire._native_decode(payload) is None
    same_outcome(payload)


def test_every_truncation_and_byte_flip_of_a_batch() -> None:
    batch = [
        stored([11, 12], None, list(range(32))),
        removed([H_BIG]),
        stored([13], 12, list(range(300, 316)), medium=None, group_idx=None),
        {"type": "AllBlocksCleared"},
    ]
    payload = enc([1.25, batch, 1])
    for cut in range(len(payload)):
        same_outcome(payload[:cut])
    rng = random.Random(5)
    for i in range(len(payload)):
        for value in (0x00, 0xC0, 0xC1, 0xC3, 0xCF, 0xDD, 0xDF, 0xFF, rng.randrange(256)):
            same_outcome(payload[:i] + bytes([value]) + payload[i + 1 :])
    same_outcome(payload + b"\x00")  # trailing bytes


WRONG = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.lists(st.one_of(st.none(), st.integers(-5, 2**33), st.text(max_size=2)), max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(-9, 9), max_size=2),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    field=st.sampled_from(list(stored([1], None, []))),
    value=WRONG,
    which=st.sampled_from(["stored", "removed", "ts", "rank", "events"]),
)
def test_wrong_typed_fields_decode_the_same_both_ways(field: str, value: Any, which: str) -> None:
    ev: dict[str, Any] = stored([1, 2], None, list(range(32)))
    top: list[Any] = [1.0, [ev], 0]
    if which == "stored":
        ev[field] = value
    elif which == "removed":
        top[1] = [removed([1]) | {field: value}]
    else:
        top[{"ts": 0, "events": 1, "rank": 2}[which]] = value
    same_outcome(enc(top))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=64), prefix=st.sampled_from([b"", b"\x93\xcb", b"\x92\xca"]))
def test_random_bytes_never_escape(data: bytes, prefix: bytes) -> None:
    same_outcome(prefix + data)


# --------------------------------------------------------------------------- applying


def engine_state(index: PrefixIndex) -> dict[str, Any]:
    """Everything the index holds, order of the hash maps included (snapshots list them)."""
    res = index._residency
    tables = {gm: dict(t.items()) for gm, t in res.tables.items()}
    engines = {}
    for eid in index.engines():
        e = index._engines[eid]
        engines[eid] = (
            list(e.hashes.items()),
            dict(e.extra_refs),
            dict(e.resident),
            dict(e.counters),
            dict(e.groups),
            dict(e.group_facts),
            list(e.pending),
            set(e.pending_removed),
            e.eagle,
            index.export_engine(eid),
        )
    return {"tables": tables, "dups": dict(res.dups), "total": res.total, "engines": engines}


class Stream:
    """vLLM-like batches for a few engines, with the rare cases mixed in."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.engines = [("e0", 0), ("e1", 0), ("e2", 0)]
        self.resident: dict[tuple[str, int], list[tuple[int, ...]]] = {e: [] for e in self.engines}
        self.prompts = [tuple(self.rng.randrange(50) for _ in range(160)) for _ in range(4)]

    def h(self, eid: tuple[str, int], prefix: tuple[int, ...]) -> int | bytes:
        raw = xxhash.xxh3_64_intdigest(repr(prefix).encode(), 1 if eid[0] == "e2" else 0)
        return raw.to_bytes(8, "little") * 4 if eid[0] == "e1" and len(prefix) > 96 else raw

    def request(self, eid: tuple[str, int]) -> list[dict[str, Any]]:
        rng = self.rng
        base = rng.choice(self.prompts)
        seq = base[: rng.randrange(16, 160)] + tuple(rng.randrange(50) for _ in range(48))
        n = len(seq) // 16
        start = rng.choice([0, 0, rng.randrange(n)])  # a hit: stores start later
        events = []
        for s in range(start, n, 4):
            t = min(s + 4, n)
            hashes = [self.h(eid, seq[: (j + 1) * 16]) for j in range(s, t)]
            parent = self.h(eid, seq[: s * 16]) if s else None
            events.append(stored(hashes, parent, list(seq[s * 16 : t * 16])))
            self.resident[eid] += [seq[: (j + 1) * 16] for j in range(s, t)]
        return events

    def rare(self, eid: tuple[str, int], events: list[dict[str, Any]]) -> None:
        """Bend one event of the batch into a rarer shape."""
        rng = self.rng
        if not events:
            return
        ev = events[rng.randrange(len(events))]
        case = rng.randrange(12)
        if case == 0 and ev["type"] == "BlockStored":
            ev["parent_block_hash"] = rng.getrandbits(64)  # an unknown parent: waits
        elif case == 1 and ev["type"] == "BlockStored":
            ev["extra_keys"] = [["img", 3], *ev["extra_keys"][1:]]
        elif case == 2 and ev["type"] == "BlockStored":
            ev["lora_name"] = "adapter"
        elif case == 3 and ev["type"] == "BlockStored":
            ev["block_hashes"] = ev["block_hashes"][1:]  # sparse: fewer hashes than blocks
        elif case == 4 and ev["type"] == "BlockStored":
            ev["block_hashes"] = ev["block_hashes"] + [rng.getrandbits(64)]  # malformed
        elif case == 5 and ev["type"] == "BlockStored":
            ev.update(medium="CPU", block_size=64, kv_cache_spec_kind=None)
        elif case == 6 and ev["type"] == "BlockStored":
            ev.update(medium="CPU", block_size=0, token_ids=[])  # a placeholder
        elif case == 7 and ev["type"] == "BlockStored":
            ev.update(
                group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=32
            )
        elif case == 8 and ev["type"] == "BlockStored":
            ev.update(kv_cache_spec_kind=None)
        elif case == 9 and ev["type"] == "BlockStored":
            ev.update(block_size=24)  # not a multiple of the unit
        elif case == 10:
            events.insert(rng.randrange(len(events) + 1), {"type": "AllBlocksCleared"})
        elif case == 11:
            events.append(dict(ev))  # sent twice: a duplicate

    def evictions(self, eid: tuple[str, int]) -> list[dict[str, Any]]:
        rng = self.rng
        held = self.resident[eid]
        out = []
        for _ in range(rng.randrange(1, 12)):
            if held and rng.random() < 0.85:
                h = self.h(eid, held.pop(rng.randrange(len(held))))
            else:
                h = rng.getrandbits(64)  # never stored: an unknown removal
            medium = rng.choice(["GPU", "GPU", "GPU", "CPU", None])
            out.append(removed([h], medium=medium, group_idx=rng.choice([0, 0, 0, None, 1])))
        if rng.random() < 0.2:
            out.append(removed([self.h(eid, p) for p in held[:3]]))
        return out

    def batch(self) -> tuple[tuple[str, int], bytes]:
        rng = self.rng
        eid = rng.choice(self.engines)
        events: list[dict[str, Any]] = []
        for _ in range(rng.randrange(1, 4)):
            events += self.request(eid) if rng.random() < 0.6 else self.evictions(eid)
        if rng.random() < 0.3:
            self.rare(eid, events)
        if rng.random() < 0.1:  # vLLM's full-report re-announce of a stored prompt
            done = [
                ev
                for ev in events
                if ev["type"] == "BlockStored" and ev["parent_block_hash"] is None
            ]
            events += [dict(ev) for ev in done[:1]]
        return eid, enc([rng.random(), events, 0])


def _index(fillers: int = 0) -> PrefixIndex:
    """The stream's three engines, after ``fillers`` idle ones (70: their bits pass 2**64)."""
    index = PrefixIndex(unit=16, cpu_chunk_tokens=64, max_entries=100_000)
    for i in range(fillers):
        index.add_engine((f"idle{i}", 0), "m")
    for eid, model in ((("e0", 0), "m"), (("e1", 0), "m"), (("e2", 0), "other")):
        index.add_engine(eid, model)
    return index


@pytest.mark.parametrize(("seed", "fillers"), [(s, 0) for s in range(8)] + [(8, 62), (9, 70)])
def test_random_streams_leave_identical_indexes(seed: int, fillers: int) -> None:
    require_native()
    stream = Stream(seed)
    ref, nat = _index(fillers), _index(fillers)
    packed = 0
    for i in range(250):
        eid, payload = stream.batch()
        try:
            want = decode_payload_py(payload)
        except DecodeError:
            continue
        got = decode_payload(payload)
        packed += type(got.events) is PackedEvents
        ref.apply(eid, want.events)
        nat.apply(eid, got.events)
        if i % 25 == 24:
            assert engine_state(nat) == engine_state(ref), f"batch {i}"
    assert engine_state(nat) == engine_state(ref)
    assert packed > 150 or not NATIVE, "most batches must take the packed path"
    for prompt in stream.prompts:
        for model in ("m", "other", "adapter"):
            keys = ref.prompt_keys(list(prompt), ref.root(model))
            assert nat.match_keys(keys, len(prompt)) == ref.match_keys(keys, len(prompt))


def test_packed_batches_during_an_export_keep_the_cut() -> None:
    """An export in progress makes the engine's batches take the Python path, which records
    the cut's values: the export equals the snapshot taken before the batches."""
    require_native()
    stream = Stream(99)
    index = _index()
    eid = ("e0", 0)
    for _ in range(40):
        index.apply(eid, decode_payload(enc([1.0, stream.request(eid), 0])).events)
    cut = index.export_engine(eid)
    pieces = iter(index.export_engine_chunks(eid))
    out = [next(pieces)]
    for i in range(40):
        events = stream.request(eid) if i % 2 else stream.evictions(eid)
        batch = decode_payload(enc([1.0, events, 0]))
        assert type(batch.events) is PackedEvents or not NATIVE
        index.apply(eid, batch.events)
    out += list(pieces)
    assert _canonical(b"".join(out)) == _canonical(cut)
    assert _canonical(index.export_engine(eid)) != _canonical(cut)


def _canonical(snapshot: bytes) -> Any:
    """A snapshot's content; a chunked export may list entries in another order."""

    def sort(x: Any) -> Any:
        return sorted((sort(y) for y in x), key=repr) if isinstance(x, list) else x

    return sort(msgspec.msgpack.decode(snapshot))


# --------------------------------------------------------------------------- property tests


class IndexVsReferenceNative(prop.IndexVsReference):
    """tests/test_index_property.py's machine, every batch taken through the wire and the
    native decoder, so the C path applies what it can."""

    def _apply(self, cfg: prop.EngineCfg, batch: list) -> None:
        super()._apply(cfg, as_impl(batch, "native") if batch else batch)  # type: ignore[arg-type]


IndexVsReferenceNative.TestCase.settings = prop.IndexVsReference.TestCase.settings
TestIndexVsReferenceNative = IndexVsReferenceNative.TestCase


# --------------------------------------------------------------------------- store_run


def _chain(seed: int, tokens: list[int], start: int, end: int) -> dict[str, Any]:
    """A plain store of blocks [start, end) of ``tokens``, hashed per engine ``seed``."""

    def h(j: int) -> int:
        return xxhash.xxh3_64_intdigest(repr(tokens[: (j + 1) * 16]).encode(), seed)

    parent = h(start - 1) if start else None
    return stored([h(j) for j in range(start, end)], parent, tokens[start * 16 : end * 16])


ODD_STORES: dict[str, Any] = {
    "none": None,
    "cpu": {"medium": "CPU", "block_size": 64, "kv_cache_spec_kind": None},
    "lora_from_root": {"lora_name": "adapter", "parent_block_hash": None},
    "other_group": {
        "group_idx": 1,
        "kv_cache_spec_kind": "sliding_window",
        "kv_cache_spec_sliding_window": 32,
    },
    "other_block_size": {"block_size": 32},
    "unknown_parent": {"parent_block_hash": 12345},
    "duplicate": "dup",
    "removal": "rm",
}


@pytest.mark.parametrize("odd", list(ODD_STORES))
def test_store_run_applies_plain_stores_and_stops_at_the_first_other(odd: str) -> None:
    """``Residency.store_run`` applies a batch's plain stores in one call, exactly as the
    reference does, and hands back the first record that is anything else, unapplied."""
    require_native()
    rng = random.Random(odd)
    tokens = [rng.randrange(50_000) for _ in range(16 * 12)]
    warm = [_chain(0, tokens, 0, 2)]  # creates the table and teaches the group facts
    batch = [_chain(0, tokens, 2, 4), _chain(0, tokens, 4, 6), _chain(0, tokens, 6, 8)]
    spec = ODD_STORES[odd]
    if spec == "dup":
        batch[2] = dict(batch[0])
    elif spec == "rm":
        batch[2] = removed([batch[0]["block_hashes"][0]])
    elif spec is not None:
        batch[2] |= spec
    ref, nat = _index(), _index()
    eid = ("e0", 0)
    for index, decode in ((ref, decode_payload_py), (nat, decode_payload)):
        index.apply(eid, decode(enc([1.0, warm, 0])).events)
    payload = enc([2.0, batch, 0])
    records = decode_payload(payload).events.records  # type: ignore[attr-defined]
    e = nat._engines[eid]
    stop = nat._ingest._store_run(e, records, 0, {})
    assert stop == (3 if spec is None else 2)
    e.counters["batches"] += 1  # the reference's apply counts the batch
    ref.apply(eid, decode_payload_py(payload).events[:stop])
    assert engine_state(nat) == engine_state(ref)
    # The rest of the batch through the whole native path still ends where the reference does.
    nat.apply(eid, decode_payload(enc([3.0, batch[stop:], 0])).events)
    ref.apply(eid, decode_payload_py(enc([3.0, batch[stop:], 0])).events)
    assert engine_state(nat) == engine_state(ref)


def test_a_run_of_one_hash_removals_is_one_record() -> None:
    """vLLM evicts block by block, a one-hash BlockRemoved each: a run of them with the same
    medium, group, locality and ownership decodes into one record (no tuple and bytes object
    per evicted block); the batch still reads as every event in order, as the Python decoder
    reads it, and leaves the index as those events do."""
    require_native()
    tokens = list(range(96))
    events = [
        stored([1, 2, 3, 4, 5, 6], None, tokens),
        removed([1]),
        removed([2**40]),  # a run of two (GPU, group 0), the hashes of different widths
        removed([3], medium="CPU"),
        removed([9], medium="CPU"),  # another medium: a second run
        removed([4, 5]),  # an event of two hashes stays its own record
        removed([6]),  # a run of one
        removed([7], group_idx=1),
        removed([8], group_idx=1),
        {"type": "AllBlocksCleared"},
        removed([11]),
    ]
    payload = enc([4.0, events, 0])
    batch = decode_payload(payload)
    assert type(batch.events) is PackedEvents
    shape = [(r[0], len(r[1]) // 8, r[6]) if r[0] == 1 else r[0] for r in batch.events.records]
    assert shape == [0, (1, 2, 2), (1, 2, 2), (1, 2, 1), (1, 1, 1), (1, 2, 2), 2, (1, 1, 1)]
    want = decode_payload_py(payload)
    assert len(batch.events) == len(events) and batch == want
    assert batch.events.events_from(3) == want.events[5:]
    ref, nat = _index(), _index()
    eid = ("e0", 0)
    ref.apply(eid, want.events[:-2])
    nat.apply(eid, decode_payload(enc([4.0, events[:-2], 0])).events)
    assert engine_state(nat) == engine_state(ref)
    # A run's later events are compared with its first byte for byte: any change decodes as
    # the Python decoder reads it.
    for i in range(len(payload)):
        for flip in (0x01, 0x20, 0xFF):
            same_outcome(payload[:i] + bytes([payload[i] ^ flip]) + payload[i + 1 :])
