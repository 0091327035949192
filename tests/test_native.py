"""indexer._native (C) and its Python fallbacks give the same answers, and the same refusals.

Each property runs against both implementations, called directly (the C one is skipped when the
extension is not built; set KVROUTER_REQUIRE_NATIVE=1 to make that a failure instead).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import xxhash
from hypothesis import example, given, settings
from hypothesis import strategies as st

from indexer import keys
from indexer.keys import tokens_to_bytes
from indexer.native import _chain_keys_bytes_py, _ids_from_json_py

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


@_needs_c
@settings(max_examples=2000, deadline=None)
@given(raw=st.binary(max_size=40) | st.text(alphabet='[], \t\n\r0123456789-.eE"', max_size=40))
def test_ids_from_json_both_agree_on_arbitrary_input(raw: bytes | str) -> None:
    """On any input, both return the same bytes or both raise ValueError."""
    assert _c is not None
    data = raw.encode() if isinstance(raw, str) else raw
    try:
        want: bytes | None = _ids_from_json_py(data)
    except ValueError:
        want = None
    if want is None:
        with pytest.raises(ValueError):
            _c.ids_from_json(data)
    else:
        assert _c.ids_from_json(data) == want


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
    assert _c is not None
    try:
        want: bytes | None = _ids_from_json_py(raw)
    except ValueError:
        want = None
    if want is None:
        with pytest.raises(ValueError):
            _c.ids_from_json(raw)
    else:
        assert _c.ids_from_json(raw) == want


def test_ids_from_json_bad_byte_in_an_id_that_crosses_a_block() -> None:
    """Every single-byte damage of arrays whose ids straddle the C fast path's 64-byte blocks
    (a bad byte before a block boundary once went unchecked)."""
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
        "print(n.NATIVE, n.ids_from_json is n._ids_from_json_py, k._native_chain is None)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_kvrouter_native_0_forces_the_fallback() -> None:
    assert _native_flag("0") == "False True True"


@_needs_c
def test_native_used_when_built() -> None:
    assert _native_flag(None) == "True False False"
