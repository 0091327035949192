"""indexer._native (C) and its Python fallbacks give the same answers, and the same refusals.

Each property runs against both implementations, called directly (the C one is skipped when the
extension is not built; set KVROUTER_REQUIRE_NATIVE=1 to make that a failure instead).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from array import array
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import xxhash
from hypothesis import example, given, settings
from hypothesis import strategies as st

import indexer.hit_rules
from indexer import keys
from indexer.index import PrefixIndex
from indexer.keys import tokens_to_bytes
from indexer.native import (
    _chain_keys_bytes_py,
    _ids_from_json_py,
    _ids_to_json_py,
    _run_scan_py,
)
from indexer.staggered import Table, new_table
from tests.test_index import Engine

_c: ModuleType | None
try:
    from indexer import _native as _c
except ImportError:  # not built: the C cases skip (test_extension_built fails if required)
    _c = None

ROOT = Path(__file__).resolve().parent.parent
U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1

_needs_c = pytest.mark.skipif(_c is None, reason="indexer._native is not built")

IdsFn = Callable[[bytes | bytearray | memoryview], bytes]
ChainFn = Callable[[int, bytes | bytearray | memoryview, int, int | None], list[int]]


def _c_ids(raw: bytes | bytearray | memoryview) -> bytes:
    assert _c is not None
    return _c.ids_from_json(raw)


def _c_chain(
    seed: int, data: bytes | bytearray | memoryview, unit: int, limit: int | None
) -> list[int]:
    assert _c is not None
    return _c.chain_keys(seed, data, unit, limit)


IDS_IMPLS = [
    pytest.param(_ids_from_json_py, id="python"),
    pytest.param(_c_ids, id="c", marks=_needs_c),
]
CHAIN_IMPLS = [
    pytest.param(_chain_keys_bytes_py, id="python"),
    pytest.param(_c_chain, id="c", marks=_needs_c),
]

ScanFn = Callable[[Table, Sequence[int], int, int, int, int], tuple[int, int]]


def _c_scan(
    tables: Table, keys: Sequence[int], first: int, step: int, count: int, alive: int
) -> tuple[int, int]:
    assert _c is not None
    return _c.run_scan(tables, keys, first, step, count, alive)


SCAN_IMPLS = [
    pytest.param(_run_scan_py, id="python"),
    pytest.param(_c_scan, id="c", marks=_needs_c),
]


def reference_chain(seed: int, data: bytes, unit: int, limit: int | None) -> list[int]:
    """The definition (indexer/keys.py), written out independently of both implementations."""
    step = unit * 4
    n = len(data) // step if limit is None else min(len(data) // step, limit)
    out, key = [], seed
    for i in range(n):
        key = xxhash.xxh3_64_intdigest(data[i * step : (i + 1) * step], key)
        out.append(key)
    return out


# ------------------------------------------------------------------------------ chain_keys

_units = st.sampled_from([1, 2, 3, 16, 256])
_seeds = st.one_of(st.integers(0, U64_MAX), st.integers(U64_MAX - 3, U64_MAX), st.just(0))
_limits = st.one_of(st.none(), st.integers(0, 40))


@pytest.mark.parametrize("impl", CHAIN_IMPLS)
@settings(max_examples=300, deadline=None)
@given(seed=_seeds, data=st.binary(max_size=3000), unit=_units, limit=_limits)
@example(seed=U64_MAX, data=b"", unit=16, limit=None)
@example(seed=U64_MAX, data=bytes(64 * 3 + 5), unit=16, limit=None)  # partial trailing unit
@example(seed=1, data=bytes(range(256)) * 5, unit=256, limit=None)  # exactly one whole unit
@example(seed=1, data=bytes(128), unit=1, limit=0)
def test_chain_keys_match_xxh3_chaining(
    impl: ChainFn, seed: int, data: bytes, unit: int, limit: int | None
) -> None:
    assert impl(seed, data, unit, limit) == reference_chain(seed, data, unit, limit)


@settings(max_examples=100, deadline=None)
@given(seed=_seeds, data=st.binary(max_size=2000), unit=_units, limit=_limits)
def test_keys_chain_keys_uses_either_and_agrees(
    seed: int, data: bytes, unit: int, limit: int | None
) -> None:
    """The public keys.chain_keys (native when built) for bytes and for the same ids as a list."""
    want = reference_chain(seed, data, unit, limit)
    assert keys.chain_keys(seed, data, unit, limit) == want
    ids = list(memoryview(data[: len(data) // 4 * 4]).cast("I"))
    assert keys.chain_keys(seed, ids, unit, limit) == reference_chain(
        seed, data[: len(ids) * 4], unit, limit
    )


@pytest.mark.parametrize("impl", CHAIN_IMPLS)
def test_chain_keys_takes_any_bytes_like(impl: ChainFn) -> None:
    data = bytes(range(256)) * 4
    want = reference_chain(7, data, 16, None)
    assert impl(7, bytearray(data), 16, None) == want
    assert impl(7, memoryview(data), 16, None) == want
    assert impl(7, memoryview(data).cast("I"), 16, None) == want  # bytes, not items, count


@pytest.mark.parametrize("impl", CHAIN_IMPLS)
def test_chain_keys_limit_and_unit_edges(impl: ChainFn) -> None:
    data = os.urandom(64 * 10 + 3)
    full = reference_chain(3, data, 16, None)
    assert len(full) == 10
    assert impl(3, data, 16, 4) == full[:4]
    assert impl(3, data, 16, 10) == full
    assert impl(3, data, 16, 2**80) == full  # a limit beyond any C integer caps nothing
    assert impl(3, data, 2**62, None) == []  # unit * 4 would overflow a 64-bit size
    assert impl(3, data, 2**80, None) == []


@pytest.mark.parametrize("impl", CHAIN_IMPLS)
@pytest.mark.parametrize(
    ("unit", "limit", "error"),
    [
        (0, None, ValueError),
        (-1, None, ValueError),
        (-(2**80), None, ValueError),
        (16, -1, ValueError),
        (16, -(2**80), ValueError),
    ],
)
def test_chain_keys_rejects_bad_unit_and_limit(
    impl: ChainFn, unit: int, limit: int | None, error: type[Exception]
) -> None:
    with pytest.raises(error):
        impl(0, bytes(256), unit, limit)


@pytest.mark.parametrize("impl", CHAIN_IMPLS)
@pytest.mark.parametrize("data", ["text", 12, None, [1, 2, 3]])
def test_chain_keys_rejects_non_buffer_data(impl: ChainFn, data: object) -> None:
    with pytest.raises(TypeError):
        impl(0, data, 1, None)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ ids_from_json

_ws = st.text(alphabet=" \t\n\r", max_size=3)
_ids = st.lists(
    st.one_of(st.integers(0, U32_MAX), st.sampled_from([0, 1, 9, 10, U32_MAX])), max_size=300
)


@st.composite
def _json_arrays(draw: st.DrawFn) -> tuple[list[int], bytes]:
    ids = draw(_ids)
    parts = [draw(_ws), "[", draw(_ws)]
    for i, v in enumerate(ids):
        if i:
            parts += [draw(_ws), ",", draw(_ws)]
        parts.append(str(v))
    parts += [draw(_ws), "]", draw(_ws)]
    return ids, "".join(parts).encode()


@pytest.mark.parametrize("impl", IDS_IMPLS)
@settings(max_examples=300, deadline=None)
@given(case=_json_arrays())
@example(case=([], b"[]"))
@example(case=([0, U32_MAX], b"[0,4294967295]"))
def test_ids_from_json_matches_json_loads(impl: IdsFn, case: tuple[list[int], bytes]) -> None:
    ids, raw = case
    want = tokens_to_bytes(json.loads(raw))
    assert want == tokens_to_bytes(ids)
    assert impl(raw) == want
    assert impl(bytearray(raw)) == want
    assert impl(memoryview(raw)) == want


def test_ids_from_json_vllm_sized_answer() -> None:
    ids = [(i * 7919) % 32000 for i in range(8192)]
    raw = json.dumps({"count": 8192, "tokens": ids}).encode()
    tokens = raw[raw.index(b"[") :].rstrip(b"}")
    want = tokens_to_bytes(ids)
    assert _ids_from_json_py(tokens) == want
    if _c is not None:
        assert _c.ids_from_json(tokens) == want


REJECTED = [
    b"",
    b"   ",
    b"1",
    b"{}",
    b"null",
    b'"[1]"',
    b"[",
    b"[1",
    b"[1,",
    b"[ 1 , ",
    b"[1 2]",
    b"[1,]",
    b"[1 , ]",
    b"[,1]",
    b"[,]",
    b"[1,,2]",
    b"[1.0]",
    b"[1.5]",
    b"[1e3]",
    b"[1E3]",
    b"[0e0]",
    b"[-1]",
    b"[-0]",
    b"[0,-0]",
    b"[5,-0,7]",
    b"[4294967296]",
    b"[99999999999999999999999]",
    b"[18446744073709551616]",
    b"[01]",
    b"[00]",
    b"[0 1]",
    b"[+1]",
    b"[0x10]",
    b'["1"]',
    b"[[1]]",
    b"[1,[2]]",
    b"[{}]",
    b"[true]",
    b"[null]",
    b"[1]x",
    b"[1],",
    b"[1]]",
    b"[][]",
    b"[] x",
    b"[1]\x00",
    b"[1\x00]",
    b"\xef\xbb\xbf[1]",  # a UTF-8 BOM is not JSON whitespace
    b"[\x0c1]",  # nor is form feed
    b"[\xa01]",
]


@pytest.mark.parametrize("impl", IDS_IMPLS)
@pytest.mark.parametrize("raw", REJECTED, ids=[repr(r) for r in REJECTED])
def test_ids_from_json_rejects(impl: IdsFn, raw: bytes) -> None:
    with pytest.raises(ValueError):
        impl(raw)


@pytest.mark.parametrize("impl", IDS_IMPLS)
@pytest.mark.parametrize("raw", ["[1]", 5, None, [1]])
def test_ids_from_json_rejects_non_bytes(impl: IdsFn, raw: object) -> None:
    with pytest.raises(TypeError):
        impl(raw)  # type: ignore[arg-type]


def _both_give_the_same_ids_or_refuse(data: bytes) -> None:
    assert _c is not None
    try:
        want: bytes | None = _ids_from_json_py(data)
    except ValueError:
        want = None
    if want is None:
        with pytest.raises(ValueError):
            _c.ids_from_json(data)
    else:
        assert _c.ids_from_json(data) == want


@_needs_c
@settings(max_examples=2000, deadline=None)
@given(raw=st.binary(max_size=40) | st.text(alphabet='[], \t\n\r0123456789-.eE"', max_size=40))
def test_ids_from_json_both_agree_on_arbitrary_input(raw: bytes | str) -> None:
    """On any input, both return the same bytes or both raise ValueError."""
    _both_give_the_same_ids_or_refuse(raw.encode() if isinstance(raw, str) else raw)


_long_ids = st.lists(
    st.one_of(
        st.integers(0, 99999),  # vocabulary-sized ids, the common case
        st.integers(0, U32_MAX),  # up to 10 digits: past the 8-digit fast path
        st.sampled_from([0, 9, 10, 99999999, 100000000, U32_MAX]),
    ),
    min_size=10,
    max_size=120,
)
_json_bytes = st.sampled_from(list(b'0123456789,[] \t\n-.eE+x"\x00\xff'))


@st.composite
def _mutated_long_arrays(draw: st.DrawFn) -> bytes:
    """A long compact array (so whole 64-byte blocks take the C fast path), or one space after
    each comma, with up to three bytes replaced, inserted or deleted anywhere."""
    sep = draw(st.sampled_from([",", ", "]))
    raw = bytearray(("[" + sep.join(map(str, draw(_long_ids))) + "]").encode())
    for _ in range(draw(st.integers(0, 3))):
        pos = draw(st.integers(0, len(raw) - 1))
        op = draw(st.sampled_from(["replace", "insert", "delete"]))
        if op == "delete":
            del raw[pos]
        elif op == "insert":
            raw.insert(pos, draw(_json_bytes))
        else:
            raw[pos] = draw(_json_bytes)
    return bytes(raw)


@settings(max_examples=200, deadline=None)
@given(ids=_long_ids, sep=st.sampled_from([",", ", ", " , ", ",\n"]))
def test_ids_from_json_long_arrays(ids: list[int], sep: str) -> None:
    raw = ("[" + sep.join(map(str, ids)) + "]").encode()
    want = tokens_to_bytes(ids)
    assert _ids_from_json_py(raw) == want
    if _c is not None:
        assert _c.ids_from_json(raw) == want


@_needs_c
@settings(max_examples=1500, deadline=None)
@given(raw=_mutated_long_arrays())
def test_ids_from_json_both_agree_on_damaged_long_arrays(raw: bytes) -> None:
    """Damage anywhere in a long array, also across the C fast path's 64-byte blocks: both
    implementations return the same bytes or both raise ValueError."""
    _both_give_the_same_ids_or_refuse(raw)


def test_ids_from_json_bad_byte_in_an_id_that_crosses_a_block() -> None:
    """Every single-byte damage of arrays whose ids straddle the C fast path's 64-byte blocks
    (a bad byte just before a block boundary is the case a block-at-a-time scan can miss)."""
    for digits in range(1, 9):
        raw = ("[" + ",".join([str(10 ** (digits - 1) + 3)] * 40) + "]").encode()
        for pos in range(1, len(raw) - 1):
            for byte in b"x .-0":
                bad = raw[:pos] + bytes([byte]) + raw[pos + 1 :]
                try:
                    want: bytes | None = _ids_from_json_py(bad)
                except ValueError:
                    want = None
                for impl in ([_c.ids_from_json] if _c is not None else []) + [_ids_from_json_py]:
                    if want is None:
                        with pytest.raises(ValueError):
                            impl(bad)
                    else:
                        assert impl(bad) == want, bad


# ------------------------------------------------------------------------------ run_scan

U128_MAX = 2**128 - 1


def reference_scan(
    tables: Table, keys: Sequence[int], first: int, step: int, count: int, alive: int
) -> tuple[int, int]:
    """The definition (indexer/native.py), block by block."""
    for b in range(first, count):
        i = (b + 1) * step - 1
        if i >= len(keys):
            raise IndexError(i)
        key = keys[i]
        now = alive & tables.get(key, 0)
        if now != alive:
            return b, now
    return count, alive


def _outcome(fn: Callable[[], tuple[int, int]]) -> tuple[int, int] | type[BaseException]:
    try:
        return fn()
    except (TypeError, ValueError, IndexError) as exc:
        return type(exc)


@st.composite
def _scans(draw: st.DrawFn) -> tuple[Table, list[int], int, int, int, int]:
    """A residency table over a prompt's keys: most blocks held by every engine (so runs go on
    for a while), some by a random subset or by none; masks up to 130 engines."""
    bits = draw(st.sampled_from([1, 3, 16, 64, 65, 130]))
    everyone = (1 << bits) - 1
    step = draw(st.sampled_from([1, 2, 16]))
    nblocks = draw(st.integers(0, 40))
    keys = draw(
        st.lists(
            st.one_of(st.integers(0, U64_MAX), st.sampled_from([0, 1, 1023, 1024, U64_MAX])),
            min_size=nblocks * step,
            max_size=nblocks * step + step - 1,
        )
    )
    table = new_table()
    values = st.one_of(
        st.just(everyone), st.just(everyone), st.just(everyone), st.integers(0, everyone)
    )
    for b in range(nblocks):
        if draw(st.integers(0, 9)):  # else: not resident anywhere (missing from the dict)
            key = keys[(b + 1) * step - 1]
            table[key] = draw(values)
    alive = draw(st.one_of(st.just(everyone), st.integers(0, everyone), st.just(0)))
    first = draw(st.integers(0, nblocks + 1))
    count = draw(st.one_of(st.just(nblocks), st.integers(0, nblocks + 2)))
    return table, keys, first, step, count, alive


@settings(max_examples=200, deadline=None)
@given(case=_scans())
def test_run_scan_c_and_python_agree(case: tuple[Table, list[int], int, int, int, int]) -> None:
    """Same answer (or the same error: IndexError when count runs past the keys) from the
    definition, the fallback and C, with keys as a list and as array("Q")."""
    table, key_list, first, step, count, alive = case
    key_array = array("Q", key_list)
    want = _outcome(lambda: reference_scan(table, key_list, first, step, count, alive))
    impls: list[ScanFn] = [_run_scan_py] + ([_c.run_scan] if _c is not None else [])
    for ks in (key_list, key_array):
        for impl in impls:
            assert _outcome(partial(impl, table, ks, first, step, count, alive)) == want


@pytest.mark.parametrize("impl", SCAN_IMPLS)
def test_run_scan_edges(impl: ScanFn) -> None:
    table = new_table()
    ks = list(range(100, 132))
    for k in ks[:20]:
        table[k] = 0b111
    assert impl(table, ks, 0, 1, 32, 0b101) == (20, 0)
    assert impl(table, array("Q", ks), 0, 1, 32, 0b101) == (20, 0)
    assert impl(table, ks, 0, 2, 16, 0b101) == (10, 0)  # block b is key (b + 1) * 2 - 1
    assert impl(table, ks, 0, 1, 20, 0b101) == (20, 0b101)  # none failed: (count, alive)
    assert impl(table, ks, 5, 1, 5, 0b101) == (5, 0b101)  # first == count: nothing scanned
    assert impl(table, ks, 9, 1, 3, 0b101) == (3, 0b101)  # first > count: nothing either
    assert impl(new_table(), [], 0, 1, 0, 1) == (0, 1)  # count == 0
    assert impl(table, ks, 0, 1, 32, 0) == (32, 0)  # alive 0 never changes
    # More than 64 engines: the bits above 64 decide, in C too.
    big = 1 << 100
    table[ks[3]] = big | 1
    assert impl(table, ks, 0, 1, 20, big | 1) == (0, 1)  # block 0 holds 0b111: bit 100 is out
    assert impl(table, ks, 3, 1, 20, big | 1) == (4, 1)
    assert impl(table, ks, 3, 1, 20, 1) == (20, 1)  # a small alive against a big value
    # Negative values (not bitmasks, but ints): Python's & on two's complement, in C too.
    table[ks[5]] = -2
    assert impl(table, ks, 5, 1, 20, 0b111) == (5, 0b110)
    assert impl(table, ks, 5, 1, 20, big | 0b111) == (5, big | 0b110)
    # Keys past 2**63 and a strided uint64 view read the same as a list.
    hi = [U64_MAX - i for i in range(8)]
    for k in hi[1::2]:
        table[k] = 1
    assert impl(table, hi, 0, 2, 4, 1) == (4, 1)
    assert impl(table, memoryview(array("Q", hi))[1::2], 0, 1, 4, 1) == (4, 1)
    assert impl(table, memoryview(array("Q", hi)).cast("B").cast("Q"), 0, 2, 4, 1) == (4, 1)
    # Other sequences of ints (read item by item): a tuple, bytes, array("I").
    small = [5, 6, 7]
    for k in small:
        table[k] = 1
    for ks2 in (tuple(small), bytes(small), array("I", small)):
        assert impl(table, ks2, 0, 1, 3, 1) == (3, 1)  # type: ignore[arg-type]
    # first and count beyond Py_ssize_t are clamped to it (in both): nothing to scan here.
    assert impl(table, ks, 2**70, 1, 2**80, 1) == (sys.maxsize, 1)


_SCAN_ERRORS: list[tuple[str, type[Exception]]] = [
    ("tables is a list", TypeError),
    ("tables is a dict", TypeError),
    ("tables is a tuple of dicts", TypeError),
    ("index past the keys", IndexError),
    ("huge count", IndexError),
    ("huge step", IndexError),
    ("float value", TypeError),
    ("str value", TypeError),
    ("None value", TypeError),
    ("float value, big alive", TypeError),
    ("str key", TypeError),
    ("float key", TypeError),
    ("alive is a float", TypeError),
    ("alive is None", TypeError),
    ("first < 0", ValueError),
    ("step 0", ValueError),
    ("step < 0", ValueError),
    ("first is a float", TypeError),
]


@pytest.mark.parametrize("impl", SCAN_IMPLS)
@pytest.mark.parametrize(("case", "error"), _SCAN_ERRORS, ids=[c for c, _ in _SCAN_ERRORS])
def test_run_scan_rejects(impl: ScanFn, case: str, error: type[Exception]) -> None:
    table = new_table()
    ks: list[Any] = [10, 11, 12, 13]
    for k in ks:
        table[k] = 1
    args: list[Any] = [table, ks, 0, 1, 4, 1]
    if case == "tables is a list":
        args[0] = list(table)
    elif case == "tables is a dict":
        args[0] = dict(table.items())
    elif case == "tables is a tuple of dicts":
        args[0] = (dict(table.items()),) * 1024
    elif case == "index past the keys":
        args[4] = 5
    elif case == "huge count":
        args[4] = 2**80
    elif case == "huge step":
        args[3] = 2**80
    elif case.startswith(("float value", "str value", "None value")):
        table[12] = {"float": 1.0, "str": "1", "None": None}[case.split()[0]]
        if case.endswith("big alive"):
            args[5] = 2**100 | 1
            for k in ks:
                if k != 12:
                    table[k] = 2**100 | 1
    elif case == "str key":
        ks[2] = "12"
    elif case == "float key":
        ks[2] = 12.0
    elif case.startswith("alive is"):
        args[5] = 1.0 if case.endswith("float") else None
    elif case == "first < 0":
        args[2] = -1
    elif case == "step 0":
        args[3] = 0
    elif case == "step < 0":
        args[3] = -1
    elif case == "first is a float":
        args[2] = 0.0
    with pytest.raises(error):
        impl(*args)


@pytest.mark.parametrize("impl", SCAN_IMPLS)
def test_run_scan_index_error_only_when_reached(impl: ScanFn) -> None:
    """A block without a key is an IndexError only if the scan gets there."""
    table = new_table()
    ks = [10, 11, 12]
    table[10] = 1
    assert impl(table, ks, 0, 1, 10, 1) == (1, 0)
    with pytest.raises(IndexError):
        impl(table, ks, 0, 1, 10, 0)  # alive 0 never stops: runs out of keys
    with pytest.raises(IndexError):
        impl(table, array("Q", ks), 3, 1, 4, 1)


@settings(max_examples=60, deadline=None)
@given(
    runs=st.lists(st.integers(0, 20), min_size=1, max_size=70),
    step_tokens=st.sampled_from([16, 32]),
)
def test_full_run_same_hits_with_either_scan(runs: list[int], step_tokens: int) -> None:
    """The full-attention run over run_scan, C or Python: engine i holds the first runs[i] blocks
    of one 20-block prompt (up to 70 engines: masks beyond 64 bits) and gets that many blocks."""
    index, p = PrefixIndex(), list(range(1000, 1000 + 20 * step_tokens))
    engines = [(f"http://w{i}", 0) for i in range(len(runs))]
    for eng_id, n in zip(engines, runs, strict=True):
        index.add_engine(eng_id, "m")
        if n:
            index.apply(eng_id, [Engine().stored(p, 0, n, step_tokens)])
    want = {eng_id: min(n, 19) * step_tokens for eng_id, n in zip(engines, runs, strict=True)}
    query = [*p[: 19 * step_tokens], 7, 7]  # blocks 0..18 and a partial one: at most 19 blocks
    impls: list[ScanFn] = [_run_scan_py] + ([_c.run_scan] if _c is not None else [])
    for impl in impls:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(indexer.hit_rules, "run_scan", impl)
            got = index.match(query, index.root("m"))
        assert {e: m.gpu_tokens for e, m in got.items()} == want


# ------------------------------------------------------------------------------ selection


@pytest.mark.skipif(
    os.environ.get("KVROUTER_REQUIRE_NATIVE") != "1",
    reason="set KVROUTER_REQUIRE_NATIVE=1 to require the C extension",
)
def test_extension_built() -> None:
    import indexer.native

    assert _c is not None, "indexer._native did not import: was the package built?"
    assert indexer.native.NATIVE or os.environ.get("KVROUTER_NATIVE") == "0"


def _native_flag(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "KVROUTER_NATIVE"}
    if env_value is not None:
        env["KVROUTER_NATIVE"] = env_value
    code = (
        "import indexer.native as n, indexer.keys as k;"
        "print(n.NATIVE, n.ids_from_json is n._ids_from_json_py, k._native_chain is None,"
        " n.run_scan is n._run_scan_py, n.ids_to_json is n._ids_to_json_py)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_kvrouter_native_0_forces_the_fallback() -> None:
    assert _native_flag("0") == "False True True True True"


@_needs_c
def test_native_used_when_built() -> None:
    assert _native_flag(None) == "True False False False False"


# ---------------------------------------------------------------- ids_to_json

TO_JSON = [
    pytest.param(_ids_to_json_py, id="python"),
    pytest.param(lambda d: _c.ids_to_json(d), id="c", marks=_needs_c),
]


@pytest.mark.parametrize("to_json", TO_JSON)
@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 2**32 - 1), max_size=300))
@example(ids=[])
@example(ids=[0, 9, 10, 99, 100, 2**32 - 1])
def test_ids_to_json_is_the_compact_array_and_inverts_ids_from_json(
    to_json: Callable[[bytes], bytes], ids: list[int]
) -> None:
    data = tokens_to_bytes(ids)
    out = to_json(data)
    assert out == json.dumps(ids, separators=(",", ":")).encode()
    assert _ids_from_json_py(out) == data
    assert to_json(memoryview(bytearray(data))) == out  # any bytes-like


@pytest.mark.parametrize("to_json", TO_JSON)
@pytest.mark.parametrize("data", [b"\x01", b"\x01\x02\x03\x04\x05", b"abc"])
def test_ids_to_json_refuses_a_partial_id(to_json: Callable[[bytes], bytes], data: bytes) -> None:
    with pytest.raises(ValueError, match="whole number of uint32"):
        to_json(data)
