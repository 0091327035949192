"""GPU block pool with prefix caching, mirroring ``vllm/v1/core/block_pool.py`` (0.33).

- One pool shared by every KV-cache group (capacity shared); block 0 is the null block
  (``BlockPool.__init__``: ``self.null_block = self.free_block_queue.popleft()``).
- Free queue: freed blocks keep their hash and stay hit-able until reused. Hashed blocks are
  appended at the tail (LRU), unhashed ones go to the head (``free_blocks`` L816), so every
  unhashed free block is consumed before any cached one is evicted. We keep the two parts
  as separate containers, which is the same order.
- ``get_new_blocks`` (L706) pops from the head; a popped block that still has a hash is
  evicted by ``_maybe_evict_cached_block`` (L769): one ``BlockRemoved`` per hash key with
  a single-element list and the key's ``group_idx``.
- The cache does not de-duplicate (``BlockHashToBlockMap`` NOTE #1): the same hash may map
  to several blocks; a lookup returns the first one.
- ``reset_prefix_cache`` (L871) succeeds only when every block is free; then one
  ``AllBlocksCleared``.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from simulator.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, Event

Key = tuple[bytes, int]  # (digest, group_idx) == vLLM's BlockHashWithGroupId


class BlockPool:
    __slots__ = (
        "block_key",
        "cached",
        "events",
        "free_hashed",
        "free_unhashed",
        "num_blocks",
        "ref",
    )

    def __init__(self, num_blocks: int, n_groups: int = 1) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be >= 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.ref: list[int] = [0] * num_blocks
        self.block_key: list[Key | None] = [None] * num_blocks
        self.free_unhashed: deque[int] = deque(range(1, num_blocks))
        self.free_hashed: OrderedDict[int, None] = OrderedDict()
        # per group: digest -> block ids holding it (insertion order; duplicates allowed)
        self.cached: list[dict[bytes, dict[int, None]]] = [{} for _ in range(n_groups)]
        self.events: list[Event] = []

    # ---- queries -------------------------------------------------------------------------
    def num_free(self) -> int:
        return len(self.free_unhashed) + len(self.free_hashed)

    def usage(self) -> float:
        """``BlockPool.get_usage``: fraction of non-null blocks in use."""
        total = self.num_blocks - 1
        return 1.0 - self.num_free() / total if total else 0.0

    def num_cached_keys(self) -> int:
        return sum(len(c) for c in self.cached)

    def num_cached_blocks(self) -> int:
        return sum(len(v) for c in self.cached for v in c.values())

    def get_cached_block(self, key: Key) -> int | None:
        blocks = self.cached[key[1]].get(key[0])
        if not blocks:
            return None
        return next(iter(blocks))

    # ---- mutation ------------------------------------------------------------------------
    def touch(self, blocks: list[int]) -> None:
        """A hit takes cached blocks out of the free queue (``touch`` L790)."""
        ref = self.ref
        for b in blocks:
            if ref[b] == 0:
                self.free_hashed.pop(b, None)
            ref[b] += 1

    def get_new_blocks(self, n: int) -> list[int]:
        if n > self.num_free():
            raise ValueError(f"cannot get {n} free blocks")
        out: list[int] = []
        ref = self.ref
        for _ in range(n):
            if self.free_unhashed:
                b = self.free_unhashed.popleft()
            else:
                b, _ = self.free_hashed.popitem(last=False)
                self._evict(b)
            ref[b] = 1
            out.append(b)
        return out

    def _evict(self, b: int) -> None:
        key = self.block_key[b]
        if key is None:
            return
        self.block_key[b] = None
        cg = self.cached[key[1]]
        blocks = cg.get(key[0])
        if blocks is not None and b in blocks:
            del blocks[b]
            if not blocks:
                del cg[key[0]]
            self.events.append(
                BlockRemoved([int.from_bytes(key[0][-8:], "big")], MEDIUM_GPU, key[1])
            )

    def cache_block(self, b: int, key: Key) -> None:
        self.block_key[b] = key
        cg = self.cached[key[1]]
        blocks = cg.get(key[0])
        if blocks is None:
            cg[key[0]] = {b: None}
        else:
            blocks[b] = None

    def free_blocks(self, ordered: list[int]) -> None:
        """Blocks in eviction order (first = evicted first); null (0) is skipped."""
        ref = self.ref
        for b in ordered:
            if b == 0:
                continue
            ref[b] -= 1
            if ref[b] == 0:
                if self.block_key[b] is not None:
                    self.free_hashed[b] = None
                else:
                    self.free_unhashed.appendleft(b)

    def reset_prefix_cache(self) -> bool:
        if self.num_free() != self.num_blocks - 1:
            return False
        for b in list(self.free_hashed):
            self.block_key[b] = None
            self.free_unhashed.append(b)
        self.free_hashed.clear()
        for cg in self.cached:
            cg.clear()
        self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[Event]:
        ev, self.events = self.events, []
        return ev
