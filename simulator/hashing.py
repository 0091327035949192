"""vLLM 0.33 prefix-cache block hashing (default algorithm ``sha256``).

Mirrors ``vllm/v1/core/kv_cache_utils.py``:
- ``init_none_hash`` (L146): with no PYTHONHASHSEED, sha256 uses the fixed seed
  ``"vllm-none-hash"`` and ``NONE_HASH = sha256(pickle(seed))``.
- ``hash_block_tokens`` (L707): ``H((parent or NONE_HASH, tuple(tokens), extra_keys))``
  where H = sha256 over pickle protocol 5 (``HIGHEST_PROTOCOL``).
- ``maybe_convert_block_hash`` (L82): event hash = low 64 bits of the digest, big-endian.
- ``generate_block_hash_extra_keys`` (L637) / ``to_event_extra_keys`` (L678): the hashed
  extra keys are tagged (``("lora", name, path)``, ``("cache_salt", salt)``), the event
  carries the untagged form (lora name, salt string).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Sequence
from typing import Any

_PROTO = pickle.HIGHEST_PROTOCOL  # 5 on Python 3.8+, as vLLM's sha256()


def sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=_PROTO)).digest()


def make_none_hash(seed: str | None = None) -> bytes:
    """NONE_HASH as vLLM 0.33 computes it for the sha256 algorithm."""
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED") or "vllm-none-hash"
    return sha256_pickle(seed)


NONE_HASH: bytes = make_none_hash("vllm-none-hash")


def hash_block_tokens(
    parent: bytes | None, tokens: Sequence[int], extra_keys: tuple[Any, ...] | None = None
) -> bytes:
    if not parent:
        parent = NONE_HASH
    return sha256_pickle((parent, tuple(tokens), extra_keys))


def to_event_hash(digest: bytes) -> int:
    """``maybe_convert_block_hash`` with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 (default)."""
    return int.from_bytes(digest[-8:], "big")


def lora_path(name: str) -> str:
    """The simulator's fake adapter path; it is part of the hashed key as in vLLM 0.33."""
    return f"/sim/lora/{name}"


class RequestHasher:
    """Incremental block-hash chain for one request.

    Hashes are computed once per full block (``Request.block_hashes`` in vLLM is
    appended by ``get_request_block_hasher`` L953 as tokens arrive); never rehash.
    """

    __slots__ = (
        "block_size",
        "digests",
        "event_hashes",
        "lora_name",
        "none_hash",
        "salt",
        "tokens_ref",
    )

    def __init__(
        self,
        block_size: int,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        none_hash: bytes = NONE_HASH,
    ) -> None:
        self.block_size = block_size
        self.lora_name = lora_name
        self.salt = cache_salt
        self.none_hash = none_hash
        self.digests: list[bytes] = []
        self.event_hashes: list[int] = []
        self.tokens_ref: Sequence[int] | None = None

    def extra_keys(self, block_idx: int) -> tuple[Any, ...] | None:
        keys: list[Any] = []
        if self.lora_name is not None:
            keys.append(("lora", self.lora_name, lora_path(self.lora_name)))
        if self.salt is not None and block_idx == 0:
            keys.append(("cache_salt", self.salt))
        return tuple(keys) if keys else None

    def event_extra_keys(self, block_idx: int) -> tuple[Any, ...] | None:
        keys: list[Any] = []
        if self.lora_name is not None:
            keys.append(self.lora_name)
        if self.salt is not None and block_idx == 0:
            keys.append(self.salt)
        return tuple(keys) if keys else None

    def extend(self, tokens: Sequence[int]) -> int:
        """Hash every newly full block of ``tokens``; returns the number of hashed blocks."""
        bs = self.block_size
        digests = self.digests
        n_full = len(tokens) // bs
        i = len(digests)
        if i >= n_full:
            return i
        ev = self.event_hashes
        if i == 0:
            i = self._adopt_shared_prefix(tokens, n_full)
        parent = digests[-1] if digests else self.none_hash
        plain = self.lora_name is None and self.salt is None
        memo = _MEMO
        dumps, sha = pickle.dumps, hashlib.sha256
        while i < n_full:
            tup = tuple(tokens[i * bs : (i + 1) * bs])
            key = (parent, tup) if plain or (self.lora_name is None and i > 0) else None
            d = memo.get(key) if key is not None else None
            if d is None:
                extra = None if plain else self.extra_keys(i)
                d = sha(dumps((parent, tup, extra), protocol=_PROTO)).digest()
                if key is not None:
                    if len(memo) >= _MEMO_CAP:
                        memo.clear()
                    memo[key] = d
            digests.append(d)
            ev.append(int.from_bytes(d[-8:], "big"))
            parent = d
            i += 1
        return i

    def _adopt_shared_prefix(self, tokens: Sequence[int], n_full: int) -> int:
        """Copy the digests of the longest block-aligned prefix shared with the most recent
        request that had the same first block (same LoRA/salt): token lists are compared
        with C-level slice equality, so a shared 100k-token prefix costs microseconds
        instead of thousands of pickle+sha256 calls. Returns the blocks adopted."""
        bs = self.block_size
        key = (self.lora_name, self.salt, bs, self.none_hash, tuple(tokens[:bs]))
        cand = _PREFIX.get(key)
        self.tokens_ref = tokens
        if len(_PREFIX) >= _PREFIX_CAP and key not in _PREFIX:
            del _PREFIX[next(iter(_PREFIX))]  # oldest first block goes
        _PREFIX.pop(key, None)
        _PREFIX[key] = self
        if cand is None or cand is self or cand.tokens_ref is None:
            return 0
        ct = cand.tokens_ref
        maxn = min(n_full, len(cand.digests), len(ct) // bs)
        n, chunk = 0, 64
        while n < maxn:
            hi = min(maxn, n + chunk)
            if tokens[n * bs : hi * bs] == ct[n * bs : hi * bs]:
                n, chunk = hi, chunk * 2
                continue
            while n < hi and tokens[n * bs : (n + 1) * bs] == ct[n * bs : (n + 1) * bs]:
                n += 1
            break
        if n:
            self.digests.extend(cand.digests[:n])
            self.event_hashes.extend(cand.event_hashes[:n])
        return n


# Most recent hasher per first block (bounded): source of shared-prefix digests.
_PREFIX_CAP = 256
_PREFIX: dict[tuple[Any, ...], RequestHasher] = {}

# Process-wide memo (parent digest, block tokens) -> digest for blocks without extra keys:
# requests sharing a prefix (system prompts, multi-turn chats) skip pickle+sha256. Keys are
# exact (no collision risk); bounded by clearing when full.
_MEMO_CAP = 400_000
_MEMO: dict[tuple[bytes, tuple[int, ...]], bytes] = {}
