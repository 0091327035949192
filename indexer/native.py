"""Request-path loops in C (``indexer._native``), with exactly equivalent Python fallbacks.

Why: for every request the router (1) turns the ``"tokens"`` array of a worker's ``/tokenize``
answer into the uint32 bytes every content key is computed over, and (2) chains one xxh3_64 per
16-token unit over those bytes (indexer/keys.py), all on the router's one event loop. In Python,
(1) makes one int object per token before packing them, and (2) one bytes slice and one call
per unit. (3) ``run_scan`` is the block loop of ``hit_rules.full_attention_run`` (one residency
lookup per block of the prompt, 512 for 8k tokens), whose interpreter overhead grows in the busy
router process. bench/native_bench.py measures each against its fallback.

The C parser reads digits straight into the output bytes;
for compact arrays it finds each id from a bitmap of the commas (64 bytes at a time) rather
than from the end of the previous id, and anything unusual goes to a byte-by-byte loop.

Bound: both allocate only their result (the output bytes, sized from the number of commas, or
the list of keys); input is read through bounds-checked indexes, so any bytes are safe, and
anything but a JSON array of integers in [0, 2**32) is a ValueError.

``NATIVE`` says whether the extension is in use. It is optional (``setup.py`` builds it with
``optional=True``: no C compiler, no extension, same answers). ``KVROUTER_NATIVE=0`` in the
environment at import time forces the Python code, for A/B benchmarks and equivalence tests.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Sequence
from operator import index
from typing import Any

import msgspec

from indexer.keys import _chain_keys_py, _native, tokens_to_bytes
from indexer.staggered import Table
from indexer.u64map import PyU64Map, U64Map

__all__ = ["NATIVE", "chain_keys_bytes", "ids_from_json", "ids_to_json", "run_scan"]

NATIVE: bool = _native is not None

_decode_ids = msgspec.json.Decoder(list[int]).decode


def _ids_from_json_py(raw: bytes | bytearray | memoryview) -> bytes:
    """Python ``ids_from_json``: msgspec decodes, ``tokens_to_bytes`` packs and range-checks."""
    if isinstance(raw, str):  # msgspec would take a str; the C version takes bytes-likes only
        raise TypeError(f"a bytes-like object is required, not {type(raw).__name__!r}")
    try:
        ids = _decode_ids(raw)
    except msgspec.DecodeError as exc:
        raise ValueError(f"token ids JSON: {exc}") from None
    # msgspec reads "-0" as 0. In an array that decoded as ints a "-" can only be a sign, so
    # any "-" is a negative id (a memchr: far cheaper than looking for a 0 among the ids).
    if b"-" in (raw if isinstance(raw, bytes | bytearray) else bytes(raw)):
        raise ValueError("token ids JSON: negative token id")
    return tokens_to_bytes(ids)  # ValueError outside [0, 2**32)


def _chain_keys_bytes_py(
    seed: int, data: bytes | bytearray | memoryview, unit: int, limit: int | None
) -> list[int]:
    """Python ``chain_keys_bytes``: any bytes-like, read as bytes (as the C version does)."""
    if not isinstance(data, bytes):
        with memoryview(data) as mv:  # TypeError for non-buffers, as in C
            if not mv.c_contiguous:
                raise BufferError("chain_keys: data is not C-contiguous")
            data = mv.tobytes()
    return _chain_keys_py(seed, data, unit, limit)


_SSIZE_MIN = -sys.maxsize - 1


def _clamp_ssize(n: Any) -> int:
    """``n`` as an int clamped to the C Py_ssize_t range, as the C version reads it."""
    n = index(n)
    return sys.maxsize if n > sys.maxsize else _SSIZE_MIN if n < _SSIZE_MIN else n


def _run_scan_py(
    tables: Table,
    keys: Sequence[int],
    first: int,
    step: int,
    count: int,
    alive: int,
) -> tuple[int, int]:
    """Python ``run_scan``: the plain block loop, with the checks of the C version."""
    first, step, count = _clamp_ssize(first), _clamp_ssize(step), _clamp_ssize(count)
    if not isinstance(tables, U64Map | PyU64Map):
        raise TypeError(f"run_scan: tables must be a U64Map, not {type(tables).__name__}")
    if not isinstance(alive, int):
        raise TypeError(f"run_scan: alive must be an int, not {type(alive).__name__}")
    if first < 0 or step < 1:
        raise ValueError("run_scan: first must be >= 0 and step >= 1")
    if first >= count:
        return count, alive
    get = tables.get
    block_keys = keys[(first + 1) * step - 1 : count * step : step]  # ends early if keys do
    for b, key in enumerate(block_keys, first):
        now = alive & get(index(key), 0)  # index: a TypeError for a key that is no int, as in C
        if now != alive:
            return b, now
    if first + len(block_keys) < count:
        raise IndexError("run_scan: key index out of range")
    return count, alive


_encode = msgspec.json.Encoder().encode


def _ids_to_json_py(data: bytes | bytearray | memoryview) -> bytes:
    """Python ``ids_to_json``: unpack the uint32 ids, let msgspec write the array."""
    with memoryview(data) as mv:
        if mv.nbytes % 4:
            raise ValueError(f"ids_to_json: {mv.nbytes} bytes is not a whole number of uint32")
        ids = array("I")
        ids.frombytes(mv.tobytes())
    if sys.byteorder == "big":  # pragma: no cover - every supported platform is little-endian
        ids.byteswap()
    return _encode(ids.tolist())


ids_from_json: Callable[[bytes | bytearray | memoryview], bytes]
"""The JSON array of token ids in ``raw`` (e.g. a /tokenize answer's ``"tokens"`` as
``msgspec.Raw``) as little-endian uint32 bytes, ``tokens_to_bytes(ids)``. ValueError unless it
is an array of integers in [0, 2**32); JSON whitespace around tokens is allowed."""

chain_keys_bytes: Callable[[int, bytes | bytearray | memoryview, int, int | None], list[int]]
"""``indexer.keys.chain_keys(seed, data, unit, limit)`` for a bytes-like ``data``, all four
arguments positional. ValueError for ``unit <= 0`` or a negative ``limit``."""

ids_to_json: Callable[[bytes | bytearray | memoryview], bytes]
"""The inverse of ``ids_from_json``: packed little-endian uint32 ids as a compact JSON array
(``b"[1,2,3]"``), for the upstream body of a prompt whose ids come from the tokenizer's cache.
ValueError unless the length is a multiple of 4."""

run_scan: Callable[[Table, Sequence[int], int, int, int, int], tuple[int, int]]
"""``run_scan(tables, keys, first, step, count, alive)``, all positional: for blocks
``b = first, ..., count - 1`` (block ``b``'s key is ``keys[(b + 1) * step - 1]``),
``now = alive & tables.get(key, 0)``; returns ``(b, now)`` for the first block where
``now != alive``, else ``(count, alive)``.

``tables`` is a residency table (a U64Map, indexer/u64map.py: key -> bitmask of engines);
``keys`` a list of ints or an ``array("Q")``; ``alive`` and the values any non-negative ints
(more than 64 bits when there are more than 64 engines: C has a 64-bit fast path and handles the
rest with Python ints). Errors: TypeError if ``tables`` is not a U64Map, a key, ``alive`` or a
value is not an int; ValueError for ``first < 0`` or ``step < 1``; IndexError when a block to
scan has no key (blocks before it are scanned first: a mismatch there is returned instead)."""

if _native is not None:
    ids_from_json = _native.ids_from_json
    chain_keys_bytes = _native.chain_keys
    run_scan = _native.run_scan
    ids_to_json = _native.ids_to_json
else:
    ids_from_json = _ids_from_json_py
    chain_keys_bytes = _chain_keys_bytes_py
    run_scan = _run_scan_py
    ids_to_json = _ids_to_json_py
