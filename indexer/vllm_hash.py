"""Locate sparse hashes by recomputing vLLM's default block hash chain -- a fallback only.

Sliding-window and mamba groups publish *sparse* ``BlockStored`` events: ``block_hashes`` lists
only the blocks that can serve a hit, while ``token_ids`` covers the whole range, so a listed
hash's position is not given. In hybrid models the full-attention group publishes the same hash
values densely and the engine map resolves them (docs/design.md). A model with *no*
full-attention group (e.g. all layers sliding window) has no dense group to learn from.

For that case only, this module recomputes vLLM's default chain (vLLM >= 0.25 default
``--prefix-caching-hash-algo sha256``: ``sha256(pickle((parent_digest, tokens, extra_keys)))``
with ``NONE_HASH = sha256(pickle(seed))``, seed ``"vllm-none-hash"`` or ``PYTHONHASHSEED``;
docs/vllm-reference.md) and places each listed hash where the recomputed low 64 bits equal it.
A match is an exact identification (a false match has probability ~2**-64). When the worker
uses another algorithm, a random seed, LoRA or a cache salt (whose internal keys carry data
events omit), no position matches and the hashes are counted as unresolved: never guessed.

Bounded: the digests of recently seen boundaries (needed to continue a chain from a parent) are
kept in an LRU of ``max_entries``.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["VllmHashLocator"]

_MASK64 = (1 << 64) - 1


def _sha256_pickle(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


class VllmHashLocator:
    def __init__(self, seed: str = "vllm-none-hash", max_entries: int = 100_000) -> None:
        self.none_hash = _sha256_pickle(seed)
        self.max_entries = max_entries
        # event hash (low 64 bits) -> (full digest, caller's content key) of recent boundaries,
        # so a later event can continue the chain from any of them as its parent.
        self._entries: OrderedDict[int, tuple[bytes, int]] = OrderedDict()

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
    ) -> list[int] | None:
        """Event hashes (low 64 bits) of every block in the range, or None if the parent's
        digest is unknown. ``content_keys`` (one per block) are remembered with the digests."""
        if parent is None:
            digest = self.none_hash
        else:
            found = self._entries.get(parent)
            if found is None:
                return None
            self._entries.move_to_end(parent)
            digest = found[0]
        out: list[int] = []
        for i, start in enumerate(range(0, len(content_keys) * block_size, block_size)):
            digest = _sha256_pickle((digest, tuple(token_ids[start : start + block_size]), None))
            low = int.from_bytes(digest[-8:], "big")
            out.append(low)
            self._entries[low] = (digest, content_keys[i])
            self._entries.move_to_end(low)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return out

    def __len__(self) -> int:
        return len(self._entries)
