"""Locate sparse hashes by recomputing vLLM's block hash chain -- a fallback only.

Sliding-window and mamba groups publish *sparse* ``BlockStored`` events: ``block_hashes`` lists
only the blocks that can serve a hit, while ``token_ids`` covers the whole range, so a listed
hash's position is not given. In hybrid models the full-attention group publishes the same hash
values densely and the engine map resolves them (docs/design.md). A model with *no*
full-attention group (e.g. all layers sliding window, or a pure mamba model) has no dense group
to learn from.

For that case only, this module recomputes vLLM's chain, ``hash((parent_digest, tokens,
extra_keys))`` from ``NONE_HASH = hash(seed)`` (seed ``"vllm-none-hash"`` or
``PYTHONHASHSEED``; docs/vllm-reference.md), under each ``--prefix-caching-hash-algo`` whose
seed is knowable: ``sha256`` (pickle, vLLM's default) and ``sha256_cbor`` (canonical CBOR, the
one llm-d's precise prefix routing asks for). It places each listed hash where a recomputed low
64 bits equal it: an exact identification (a false match has probability ~2**-64). The first
match settles the engine's algorithm; until then every candidate is computed. With ``xxhash``
(a random seed unless ``PYTHONHASHSEED`` is set, and a 128-bit digest), LoRA or a cache salt
(whose internal keys carry data events omit), no position matches and the hashes are counted as
unresolved: never guessed.

Bounded: the digests of recently seen boundaries (needed to continue a chain from a parent) are
kept in an LRU of ``max_entries``.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Callable, Sequence

__all__ = ["ALGORITHMS", "VllmHashLocator", "cbor_canonical"]


def _sha256_pickle(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _head(major: int, n: int) -> bytes:
    """A CBOR item head: major type and argument in the shortest form (canonical)."""
    if n < 24:
        return bytes([major << 5 | n])
    for info, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * width):
            return bytes([major << 5 | info]) + n.to_bytes(width, "big")
    raise ValueError("CBOR argument beyond 64 bits")


def cbor_canonical(obj: object) -> bytes:
    """Canonical CBOR (RFC 8949 section 4.2.1) of what vLLM hashes: bytes, str, non-negative
    ints, None and tuples or lists of them; ``cbor2.dumps(obj, canonical=True)`` for those."""
    if obj is None:
        return b"\xf6"
    if isinstance(obj, bool):
        raise TypeError("bool is not in vLLM's block hash input")
    if isinstance(obj, int):
        return _head(0, obj) if obj >= 0 else _head(1, -1 - obj)
    if isinstance(obj, bytes):
        return _head(2, len(obj)) + obj
    if isinstance(obj, str):
        data = obj.encode()
        return _head(3, len(data)) + data
    if isinstance(obj, tuple | list):
        return _head(4, len(obj)) + b"".join(cbor_canonical(x) for x in obj)
    raise TypeError(f"no canonical CBOR for {type(obj).__name__}")


def _sha256_cbor(obj: object) -> bytes:
    return hashlib.sha256(cbor_canonical(obj)).digest()


ALGORITHMS: dict[str, Callable[[object], bytes]] = {
    "sha256": _sha256_pickle,
    "sha256_cbor": _sha256_cbor,
}
"""vLLM's ``--prefix-caching-hash-algo`` values whose chain can be recomputed here."""


class VllmHashLocator:
    def __init__(self, seed: str = "vllm-none-hash", max_entries: int = 100_000) -> None:
        self.max_entries = max_entries
        self.algorithms = tuple(ALGORITHMS)
        """Candidates still in play; one once a recomputed hash matched a listed one."""
        self.none_hash = {a: ALGORITHMS[a](seed) for a in self.algorithms}
        # event hash (low 64 bits) -> (full digest, caller's content key, algorithm) of recent
        # boundaries, so a later event can continue the chain from any of them as its parent.
        self._entries: OrderedDict[int, tuple[bytes, int, str]] = OrderedDict()

    def key_of(self, event_hash: int) -> int | None:
        """Content key remembered for a boundary this locator computed."""
        found = self._entries.get(event_hash)
        return None if found is None else found[1]

    def chain(
        self,
        parent: int | None,
        token_ids: Sequence[int],
        block_size: int,
        content_keys: Sequence[int],
        listed: Sequence[int] = (),
    ) -> dict[int, int] | None:
        """Event hash (low 64 bits) -> content key for every block of the range, under every
        candidate algorithm, or None if the parent's digest is unknown. ``content_keys`` (one
        per block) are remembered with the digests. A hash of ``listed`` among the results
        settles the algorithm."""
        if parent is None:
            starts = [(a, self.none_hash[a]) for a in self.algorithms]
        else:
            found = self._entries.get(parent)
            if found is None:
                return None
            self._entries.move_to_end(parent)
            starts = [(found[2], found[0])]
        out: dict[int, int] = {}
        wanted = set(listed) if len(self.algorithms) > 1 else set()
        for algorithm, first in starts:
            fn, digest = ALGORITHMS[algorithm], first
            for i, start in enumerate(range(0, len(content_keys) * block_size, block_size)):
                digest = fn((digest, tuple(token_ids[start : start + block_size]), None))
                low = int.from_bytes(digest[-8:], "big")
                out[low] = content_keys[i]
                self._entries[low] = (digest, content_keys[i], algorithm)
                self._entries.move_to_end(low)
                if low in wanted:
                    self.algorithms = (algorithm,)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return out

    def __len__(self) -> int:
        return len(self._entries)
