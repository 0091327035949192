"""CPU offload tier, modelled on vLLM's ``OffloadingConnector`` (scheduler side).

- Chunks of ``chunk_tokens`` (a multiple of the GPU block size); a chunk's key is the GPU
  tail hash of its last block (``offloading/scheduler.py`` ``update_offload_keys`` L412).
- Prompt-only (``offload_prompt_only`` default True): full prompt chunks are offloaded when
  the step that computes them is scheduled (``prepare_store``: CPU LRU evicts here, one
  ``BlockRemoved`` per call with all evicted hashes), and announced as ``BlockStored`` at
  ``complete_store`` = the next engine step (``cpu/manager.py`` L375ff).
- Events: placeholder (default: one chunk-tail hash, ``token_ids`` [], ``block_size`` 0,
  no parent, no spec kind) or self-describing (``self_describing_kv_events``: the chunk's
  per-GPU-block hashes, its tokens, the GPU block size, parent = hash before the chunk).
- Hit rule (``get_num_new_matched_tokens``): from chunk ``gpu_hit // chunk``, contiguous
  present chunks among the request's whole chunks, a load of at least one whole chunk,
  aligned to the chunk size; a load reaching the prompt's end leaves the last token to
  recompute (the engine backs off one token, as vLLM's ``_update_waiting_for_remote_kv``).
- ``reset`` is silent (``OffloadingConnector.reset_cache`` emits nothing).

Full-attention group 0 only: the simulator offloads the first full-attention group.
"""

from __future__ import annotations

from collections import OrderedDict

from simulator.events import MEDIUM_CPU, BlockRemoved, BlockStored, Event
from simulator.request import Request


class _Chunk:
    __slots__ = ("block_hashes", "key", "parent", "ready", "tail", "tokens")

    def __init__(
        self, key: bytes, tail: int, block_hashes: list[int], parent: int | None, tokens: list[int]
    ) -> None:
        self.key = key
        self.tail = tail
        self.block_hashes = block_hashes
        self.parent = parent
        self.tokens = tokens
        self.ready = False


class CpuTier:
    def __init__(
        self,
        capacity_chunks: int,
        chunk_tokens: int,
        block_size: int,
        self_describing: bool,
        group_idx: int = 0,
    ) -> None:
        if chunk_tokens % block_size:
            raise ValueError("cpu chunk tokens must be a multiple of the GPU block size")
        self.capacity = capacity_chunks
        self.chunk_tokens = chunk_tokens
        self.bs = block_size
        self.per_chunk = chunk_tokens // block_size
        self.self_describing = self_describing
        self.group_idx = group_idx
        self.lru: OrderedDict[bytes, _Chunk] = OrderedDict()  # first = evicted first
        self.pending: list[_Chunk] = []  # stores submitted by the current step
        self.inflight: list[_Chunk] = []  # stores submitted by the previous step
        self.events: list[Event] = []

    def usage(self) -> float:
        return len(self.lru) / self.capacity if self.capacity else 0.0

    def reset(self) -> None:
        self.lru.clear()
        self.pending.clear()
        self.inflight.clear()

    def busy(self) -> bool:
        return bool(self.pending or self.inflight)

    # ---- lookup / load --------------------------------------------------------------------
    def lookup(self, req: Request, gpu_hit_tokens: int) -> int:
        """Extra tokens a CPU load would add beyond the GPU hit (0 if none).

        Mirrors ``OffloadingConnectorScheduler.get_num_new_matched_tokens`` (non-hybrid): the
        lookup covers the request's whole chunks (``num_tokens // chunk``, not ``- 1``), starts
        at chunk ``gpu_hit // chunk``, needs contiguous present chunks, and refuses a load of
        less than one whole chunk (``min_hit_tokens = offloaded_block_size``).
        """
        c = self.chunk_tokens
        digests = req.hasher.digests
        whole = min(len(req.all_token_ids) // c, len(digests) // self.per_chunk)
        if whole * c - gpu_hit_tokens < c:
            return 0
        k = gpu_hit_tokens // c
        while k < whole:
            ch = self.lru.get(digests[(k + 1) * self.per_chunk - 1])
            if ch is None or not ch.ready:
                break
            k += 1
        loaded = k * c - gpu_hit_tokens
        return loaded if loaded >= c else 0

    def touch(self, req: Request, upto_tokens: int) -> None:
        digests = req.hasher.digests
        n = upto_tokens // self.chunk_tokens
        keys = [digests[(k + 1) * self.per_chunk - 1] for k in range(n)]
        for key in reversed(keys):  # head chunk ends up most recent, as GPU frees tail first
            if key in self.lru:
                self.lru.move_to_end(key)

    # ---- store ------------------------------------------------------------------------------
    def prepare_store(self, req: Request, computed_after_step: int) -> None:
        c = self.chunk_tokens
        n_chunks = min(computed_after_step, req.num_prompt) // c
        if n_chunks <= req.offloaded_chunks:
            return
        hasher = req.hasher
        hasher.extend(req.all_token_ids)
        digests, ev = hasher.digests, hasher.event_hashes
        new: list[tuple[bytes, _Chunk]] = []
        for k in range(req.offloaded_chunks, n_chunks):
            lo, hi = k * self.per_chunk, (k + 1) * self.per_chunk
            key = digests[hi - 1]
            if key in self.lru:
                continue
            new.append(
                (
                    key,
                    _Chunk(
                        key,
                        ev[hi - 1],
                        ev[lo:hi],
                        ev[lo - 1] if lo else None,
                        req.all_token_ids[k * c : (k + 1) * c],
                    ),
                )
            )
        req.offloaded_chunks = n_chunks
        if not new or self.capacity <= 0:
            return
        new = new[-self.capacity :]
        evicted: list[_Chunk] = []
        while len(self.lru) + len(new) > self.capacity:
            _, old = self.lru.popitem(last=False)
            if old.ready:
                evicted.append(old)
        if evicted:
            hashes: list[int] = []
            for ch in evicted:
                hashes.extend(ch.block_hashes if self.self_describing else [ch.tail])
            self.events.append(BlockRemoved(hashes, MEDIUM_CPU, self.group_idx))
        for key, ch in reversed(new):
            self.lru[key] = ch
            self.pending.append(ch)

    def end_step(self) -> None:
        """Complete the previous step's stores (``complete_store``), then move on."""
        done, self.inflight, self.pending = self.inflight, self.pending, []
        for ch in done:
            if self.lru.get(ch.key) is not ch:
                continue  # evicted before its store completed: never announced
            ch.ready = True
            if self.self_describing:
                self.events.append(
                    BlockStored(
                        block_hashes=ch.block_hashes,
                        parent_block_hash=ch.parent,
                        token_ids=ch.tokens,
                        block_size=self.bs,
                        lora_id=None,
                        medium=MEDIUM_CPU,
                        lora_name=None,
                        group_idx=self.group_idx,
                        kv_cache_spec_kind="full_attention",
                    )
                )
            else:
                self.events.append(
                    BlockStored(
                        block_hashes=[ch.tail],
                        parent_block_hash=None,
                        token_ids=[],
                        block_size=0,
                        lora_id=None,
                        medium=MEDIUM_CPU,
                        lora_name=None,
                        group_idx=self.group_idx,
                    )
                )

    def take_events(self) -> list[Event]:
        ev, self.events = self.events, []
        return ev
