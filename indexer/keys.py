"""Content keys: kvrouter's own names for prefixes (docs/design.md, "Identity of a prefix").

vLLM's block hashes cannot be recomputed by a router (algorithm, per-process seeds before 0.25,
LoRA paths missing from events, only the low 64 bits published), so every prefix is named by a
*content key* computed the same way from an event's ``token_ids`` and from a request's prompt:

    K(0)     = xxh3_64(namespace)                      namespace = model or LoRA name + cache_salt
    K(T + u) = xxh3_64(tokens[T : T+u] as uint32 LE, seed = K(T))

``u`` (the *unit*, default 16) must divide every block size in use. A block of any group or
medium that ends at token ``T`` is identified by ``K(T)``, so blocks of different sizes (16-token
GPU blocks, 256-token groups, 256-token CPU chunks) need no special case: they are boundaries.

Why xxh3 seeded by the previous key: chaining through the seed costs one C call per unit and no
concatenation; xxh3_64 is deterministic across processes and platforms.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import xxhash

__all__ = [
    "DEFAULT_UNIT",
    "NamespaceRoots",
    "chain_keys",
    "mix_extra",
    "namespace_root",
    "packed_keys",
    "tokens_to_bytes",
]

DEFAULT_UNIT = 16

_xxh64 = xxhash.xxh3_64_intdigest


def _load_native() -> ModuleType | None:
    """The C extension ``indexer._native`` if it was built, else None (see indexer/native.py).

    ``KVROUTER_NATIVE=0`` in the environment at import time forces the pure-Python code, for A/B
    benchmarks and for the tests that hold both implementations to the same answers.
    """
    if os.environ.get("KVROUTER_NATIVE") == "0":
        return None
    try:
        from indexer import _native
    except ImportError:
        return None
    return _native


_native = _load_native()
_native_chain: Callable[[int, bytes, int, int | None], list[int]] | None = (
    None if _native is None else _native.chain_keys
)


# The match path's C loops (indexer/_match.c) are part of the same extension: they read the
# residency tables through the U64Map C API that lives there.
_match: ModuleType | None = _native
_token_keys: Callable[[int, Sequence[int], int, int | None, bool], Any] | None = (
    None if _match is None else _match.token_keys
)


def namespace_root(model: str, cache_salt: str | None = None) -> int:
    """K(0) of a namespace. Different models, LoRA adapters or salts never share keys."""
    salt = "" if cache_salt is None else cache_salt
    # The NUL separator keeps ("ab", "c") and ("a", "bc") apart; the flag byte keeps salt "" apart
    # from no salt (vLLM answers an empty salt 400, so such a request never caches anything).
    flag = "0" if cache_salt is None else "1"
    return _xxh64(f"kvrouter/1\0{model}\0{flag}{salt}".encode())


class NamespaceRoots:
    """``namespace_root`` with a memo, as the index asks for the same few roots again and again.

    Bounded: namespaces are few, but salts may be many, so the memo is emptied past ``limit``.
    """

    __slots__ = ("_memo", "limit")

    def __init__(self, limit: int = 4096) -> None:
        self._memo: dict[tuple[str, str | None], int] = {}
        self.limit = limit

    def __call__(self, model: str, cache_salt: str | None = None) -> int:
        key = (model, cache_salt)
        root = self._memo.get(key)
        if root is None:
            if len(self._memo) > self.limit:
                self._memo.clear()
            root = self._memo[key] = namespace_root(model, cache_salt)
        return root


def tokens_to_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32, the byte form every key is computed over."""
    try:
        buf = array("I", tokens)
    except OverflowError:
        raise ValueError("token ids must be in [0, 2**32)") from None
    if buf.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte "I"
        buf = array("L", tokens)
    return buf.tobytes()


def chain_keys(
    seed: int, tokens: Sequence[int] | bytes, unit: int = DEFAULT_UNIT, limit: int | None = None
) -> list[int]:
    """Keys at every unit boundary after ``seed``: ``[K(T+u), K(T+2u), ...]``.

    ``seed`` is the key of the boundary where ``tokens`` start. A partial trailing unit gets no
    key (only whole units can end a block). ``limit`` caps the number of keys computed.
    ``unit`` must be positive and ``limit`` not negative (ValueError).

    Computed by ``indexer._native`` when it is built (same keys, about 7x faster; see
    indexer/native.py), else by the Python loop below. A list or tuple of ids goes to C as it
    is (indexer/_match.c): packing it into an array first costs more than hashing it.
    """
    if _token_keys is not None and type(tokens) in (list, tuple):
        keys = _token_keys(seed, tokens, unit, limit, False)
        if keys is not None:
            return keys  # type: ignore[no-any-return]
    data = tokens if isinstance(tokens, bytes) else tokens_to_bytes(tokens)
    if _native_chain is not None:
        return _native_chain(seed, data, unit, limit)
    return _chain_keys_py(seed, data, unit, limit)


def packed_keys(
    seed: int, tokens: Sequence[int] | bytes, unit: int = DEFAULT_UNIT
) -> Sequence[int]:
    """``chain_keys(seed, tokens, unit)`` as an ``array("Q")`` when C is built: no int object
    per key (matching reads the few keys it needs from it), else as the list."""
    if _token_keys is not None and type(tokens) in (list, tuple):
        packed = _token_keys(seed, tokens, unit, None, True)
        if packed is not None:
            keys = array("Q")
            keys.frombytes(packed)
            return keys
    return chain_keys(seed, tokens, unit)


def _chain_keys_py(seed: int, data: bytes, unit: int, limit: int | None) -> list[int]:
    """The pure-Python chain_keys over bytes: the reference the C version must match."""
    if unit <= 0:
        raise ValueError("chain_keys: unit must be positive")
    if limit is not None and limit < 0:
        raise ValueError("chain_keys: limit must not be negative")
    step = unit * 4
    end = len(data) - len(data) % step
    if limit is not None and limit * step < end:
        end = limit * step
    keys = []
    append = keys.append
    key = seed
    for start in range(0, end, step):
        # Slicing bytes (a 64-byte copy) is cheaper than creating memoryview slices.
        key = _xxh64(data[start : start + step], key)
        append(key)
    return keys


def mix_extra(key: int, extra: object) -> int:
    """Fold per-block extra keys (multimodal ids, prompt-embeds digests) into a content key.

    A router cannot see multimodal identifiers in a plain prompt, so blocks carrying them get
    keys no prompt reproduces: such blocks never produce a (possibly wrong) predicted hit.
    """
    return _xxh64(repr(extra).encode(), key)
