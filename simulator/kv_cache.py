"""KV-cache manager and hybrid coordinator (one shared ``BlockPool``, N groups).

Mirrors vLLM 0.33:
- ``kv_cache_coordinator.py`` ``HybridKVCacheCoordinator.find_longest_cache_hit`` (L806):
  start at ``num_tokens - 1`` (``get_computed_blocks``), full attention first, then each
  other group shrinks the hit until a fixed point; the result per group plus the
  "uncached common prefix" (longest single-group hit) used for junction retention.
- ``single_type_kv_cache_manager.py``: ``FullAttentionManager`` (L739, left-to-right scan),
  ``SlidingWindowManager`` (L946/L969: ``cdiv(W-1, bs)`` contiguous cached blocks ending at
  the hit, right-to-left; a shorter run starting at block 0 also counts), ``MambaManager``
  (L1428: the single state block at the boundary), ``ChunkedLocalAttentionManager`` (the
  blocks from the start of the hit's chunk, left to right; earlier ones count as computed),
  ``remove_skipped_blocks`` (early free of
  blocks that left the window, tail first, not announced), ``reachable_block_mask`` (sparse
  retention with ``prefix_cache_retention_interval=0``).
- ``block_pool.cache_full_blocks`` (L230): one ``BlockStored`` per group per call, blocks
  ``[num_cached, num_full)``, masked/null blocks skipped from ``block_hashes`` while
  ``token_ids`` covers the whole range, parent = hash of block ``num_cached - 1``.
- ``KVCacheManager.free``: groups in order, each group's blocks in reverse order.

Groups may have their own block sizes (``resolve_kv_cache_block_sizes``, kv_cache_utils.py
L816): request hashes are computed at ``hash_block_size = gcd(group block sizes)``; a group
block's hash is the tail hash at its last hash boundary (``BlockHashListWithBlockSize``);
hits are aligned to ``lcm(group block sizes)`` (the scheduler block size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from simulator.block_pool import BlockPool
from simulator.events import MEDIUM_GPU, BlockStored
from simulator.request import Request

FULL = "full_attention"
SWA = "sliding_window"
MAMBA = "mamba"
CHUNKED = "chunked_local_attention"


@dataclass(frozen=True)
class GroupSpec:
    kind: str
    sliding_window: int | None = None
    block_size: int | None = None  # None: the engine's block size
    attention_chunk: int | None = None  # tokens per chunk, chunked local attention


def parse_groups(spec: str) -> list[GroupSpec]:
    """``"full"``, ``"full,swa:64"``, ``"swa:64,full"``, ``"full,mamba"``, ``"chunked:128,full"``
    (Llama 4's chunked local attention, chunks of 128 tokens); an optional ``@N`` gives a group
    its own block size: ``"full@16,mamba@64"``, ``"swa:64@32"``."""
    out: list[GroupSpec] = []
    for part in spec.split(","):
        p = part.strip().lower()
        if not p:
            continue
        p, at, bs_s = p.partition("@")
        bs: int | None = None
        if at:
            if not bs_s.isdigit() or int(bs_s) < 1:
                raise ValueError(f"bad group block size in {part!r}")
            bs = int(bs_s)
        if p in ("full", "full_attention", "fa"):
            out.append(GroupSpec(FULL, None, bs))
        elif p.startswith(("swa", "sliding_window")):
            _, _, w = p.partition(":")
            if not w.isdigit() or int(w) < 2:
                raise ValueError(f"sliding window group needs a window, e.g. swa:64 (got {part!r})")
            out.append(GroupSpec(SWA, int(w), bs))
        elif p == "mamba":
            out.append(GroupSpec(MAMBA, None, bs))
        elif p.startswith("chunked"):
            _, _, c = p.partition(":")
            if not c.isdigit() or int(c) < 1:
                raise ValueError(f"chunked group needs a chunk, e.g. chunked:128 (got {part!r})")
            out.append(GroupSpec(CHUNKED, None, bs, int(c)))
        else:
            raise ValueError(f"unknown KV-cache group kind {part!r}")
    if not out:
        raise ValueError("at least one KV-cache group is required")
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        groups: list[GroupSpec],
        num_blocks: int,
        block_size: int,
        retention_interval: int | None = 0,
        event_block_size: int | None = None,
        enable_caching: bool = True,
    ) -> None:
        self.groups = groups
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, len(groups))
        self.gbs = [s.block_size or block_size for s in groups]
        self.hbs = math.gcd(*self.gbs)  # hash_block_size (prefix-match unit)
        self.align = math.lcm(*self.gbs)  # scheduler block size: hits land on multiples
        self.scale = [b // self.hbs for b in self.gbs]
        self.retention = retention_interval
        self.event_bs = event_block_size
        self.fa = [g for g, s in enumerate(groups) if s.kind == FULL]
        self.other = [g for g, s in enumerate(groups) if s.kind != FULL]
        # cdiv(W-1, bs) blocks needed at the hit boundary (SWA); 1 state block for mamba.
        self.needed = [
            _cdiv(s.sliding_window - 1, self.gbs[g]) if s.kind == SWA else 1
            for g, s in enumerate(groups)
        ]

    def blocks_for_tokens(self, n_tokens: int) -> int:
        return sum(_cdiv(n_tokens, b) for b in self.gbs)

    # ---- hits ---------------------------------------------------------------------------
    def _gkey(self, digests: list[bytes], g: int, i: int) -> tuple[bytes, int]:
        return (digests[(i + 1) * self.scale[g] - 1], g)

    def _group_hit(self, g: int, digests: list[bytes], limit: int) -> int:
        """Hit of one non-full group in tokens, <= limit, aligned to ``self.align``."""
        cached = self.pool.cached[g]
        bs, s, a = self.gbs[g], self.scale[g], self.align
        max_blocks = limit // bs
        if self.groups[g].kind == CHUNKED:
            # Blocks before the chunk of ``limit`` count as computed; those from its start on
            # must be cached, left to right (vLLM asserts the group's blocks are the alignment).
            first = self._chunk_start(g, limit) // bs
            run = first
            while run < max_blocks and digests[(run + 1) * s - 1] in cached:
                run += 1
            return run * bs // a * a
        if self.groups[g].kind == MAMBA:
            for i in range(max_blocks - 1, -1, -1):
                if ((i + 1) * bs) % a == 0 and digests[(i + 1) * s - 1] in cached:
                    return (i + 1) * bs
            return 0
        need = self.needed[g]
        run = 0
        right = 0  # exclusive right edge (in blocks) of the current run
        for i in range(max_blocks - 1, -1, -1):
            if digests[(i + 1) * s - 1] in cached:
                if run == 0:
                    right = i + 1
                run += 1
                while run and (right * bs) % a:  # the run's right edge must be aligned
                    right -= 1
                    run -= 1
                if run >= need:
                    return right * bs
            else:
                run = 0
        return (run * bs) // a * a if run and right == run else 0

    def find_hit(self, req: Request) -> tuple[int, list[list[int]], int]:
        """(hit tokens, per-group blocks with 0 = null, longest single-group hit tokens)."""
        n_hashes = req.hasher.extend(req.all_token_ids)
        digests = req.hasher.digests
        a = self.align
        hit = min(len(req.all_token_ids) - 1, n_hashes * self.hbs) // a * a
        fa_blocks: dict[int, list[int]] = {}
        for g in self.fa:  # left-to-right scan, collecting the first cached block per hash
            bs, s = self.gbs[g], self.scale[g]
            get_g = self.pool.cached[g].get
            found: list[int] = []
            append = found.append
            for d in digests[s - 1 : (hit // bs) * s : s]:
                blocks = get_g(d)
                if not blocks:
                    break
                append(next(iter(blocks)))
            hit = len(found) * bs // a * a
            fa_blocks[g] = found
        longest = hit if self.fa else -1
        while True:
            changed = False
            for g in self.other:
                n = self._group_hit(g, digests, hit)
                if longest < 0:
                    longest = n
                if n < hit:
                    hit, changed = n, True
            if not changed:
                break
        longest = max(longest, hit)
        get = self.pool.get_cached_block
        per_group: list[list[int]] = []
        for g, spec in enumerate(self.groups):
            nb = hit // self.gbs[g]
            if nb == 0:
                per_group.append([])
            elif spec.kind == FULL:
                per_group.append(fa_blocks[g][:nb])
            else:
                if spec.kind == CHUNKED:  # the blocks from the hit's chunk on
                    start = self._chunk_start(g, hit) // self.gbs[g]
                else:
                    start = max(0, nb - (1 if spec.kind == MAMBA else self.needed[g]))
                tail = [get(self._gkey(digests, g, i)) or 0 for i in range(start, nb)]
                per_group.append([0] * start + tail)
        return hit, per_group, longest

    def _chunk_start(self, g: int, tokens: int) -> int:
        chunk = self.groups[g].attention_chunk or 1
        return tokens // chunk * chunk

    def set_reachable(self, req: Request, hit: int, longest: int) -> None:
        """Token boundaries at which sparse SWA/mamba groups keep blocks: the replay
        boundary ``num_prompt_tokens - 1`` (aligned) and the shared-prefix junction."""
        a = self.align
        req.reachable = {(req.num_prompt - 1) // a * a} | ({longest} if longest > hit else set())

    # ---- allocation -------------------------------------------------------------------------
    def remove_skipped_blocks(self, req: Request, total_computed: int) -> None:
        for g in self.other:
            spec = self.groups[g]
            if spec.kind == SWA:
                skipped = total_computed - spec.sliding_window + 1
            elif spec.kind == CHUNKED:  # the chunks before the current one
                skipped = self._chunk_start(g, total_computed)
            else:  # mamba keeps only the state of the last computed block
                skipped = total_computed - 1
            if skipped <= 0:
                continue
            blocks = req.blocks[g]
            n = min(skipped // self.gbs[g], len(blocks))
            removed: list[int] = []
            for i in range(n - 1, -1, -1):
                if blocks[i] == 0:
                    break
                removed.append(blocks[i])
                blocks[i] = 0
            if removed:
                self.pool.free_blocks(removed)

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        new_computed: list[list[int]] | None = None,
        num_new_computed_tokens: int = 0,
        num_external_tokens: int = 0,
    ) -> bool:
        total_computed = req.num_computed + num_new_computed_tokens
        self.remove_skipped_blocks(req, total_computed)
        need_slots = total_computed + num_new_tokens + num_external_tokens
        to_alloc: list[int] = []
        n_touch_free = 0
        ref = self.pool.ref
        for g in range(len(self.groups)):
            have = len(req.blocks[g]) + (len(new_computed[g]) if new_computed else 0)
            to_alloc.append(max(0, _cdiv(need_slots, self.gbs[g]) - have))
            if new_computed:
                n_touch_free += sum(1 for b in new_computed[g] if b and ref[b] == 0)
        if sum(to_alloc) + n_touch_free > self.pool.num_free():
            return False
        if new_computed:
            for g in range(len(self.groups)):
                blocks = [b for b in new_computed[g] if b]
                self.pool.touch(blocks)
                req.blocks[g].extend(new_computed[g])
                req.num_cached[g] = len(new_computed[g])
        for g, k in enumerate(to_alloc):
            if k:
                req.blocks[g].extend(self.pool.get_new_blocks(k))
        self.cache_blocks(req, min(total_computed + num_new_tokens, len(req.all_token_ids)))
        return True

    def _allowed(self, req: Request, g: int) -> set[int] | None:
        """``reachable_block_mask``: group blocks that may be cached (None = all)."""
        spec = self.groups[g]
        if spec.kind in (FULL, CHUNKED) or self.retention is None:
            return None  # chunked local attention caches every block, as full attention does
        bs = self.gbs[g]
        bounds = set(req.reachable or ())
        if self.retention and self.retention > 0:  # one tail per N tokens
            step = max(self.align, self.retention // self.align * self.align)
            bounds.update(range(step, len(req.all_token_ids) + 1, step))
        keep = 1 if spec.kind == MAMBA else self.needed[g]
        allowed: set[int] = set()
        for b in bounds:
            nb = b // bs
            allowed.update(range(max(0, nb - keep), nb))
        return allowed

    def cache_blocks(self, req: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        hasher = req.hasher
        n_hashes = hasher.extend(req.all_token_ids)
        digests = hasher.digests
        ev_all = hasher.event_hashes
        pool = self.pool
        for g, spec in enumerate(self.groups):
            bs, s = self.gbs[g], self.scale[g]
            num_full = min(num_tokens // bs, n_hashes // s)
            nc = req.num_cached[g]
            if num_full <= nc:
                continue
            blocks = req.blocks[g]
            allowed = self._allowed(req, g)
            ev_hashes: list[int] = []
            extra: list[tuple | None] = []
            for i in range(nc, num_full):
                b = blocks[i]
                if b == 0 or (allowed is not None and i not in allowed):
                    continue
                j = (i + 1) * s - 1
                pool.cache_block(b, (digests[j], g))
                ev_hashes.append(ev_all[j])
                extra.append(hasher.event_extra_keys(i * s))
            pool.events.append(
                BlockStored(
                    block_hashes=ev_hashes,
                    parent_block_hash=ev_all[nc * s - 1] if nc > 0 else None,
                    token_ids=req.all_token_ids[nc * bs : num_full * bs],
                    block_size=self.event_bs or bs,
                    lora_id=req.lora_id,
                    medium=MEDIUM_GPU,
                    lora_name=req.lora_name,
                    extra_keys=extra,
                    group_idx=g,
                    kv_cache_spec_kind=spec.kind,
                    kv_cache_spec_sliding_window=spec.sliding_window,
                    session_id=req.session_id,
                )
            )
            req.num_cached[g] = num_full

    def emit_cached_block_events(self, req: Request, hit_tokens: int) -> None:
        """``block_pool.emit_cached_block_events`` (L405): a request sent with
        ``kv_cache_report_mode="full"`` re-announces its prefix hit, parent None, tokens
        ``[0, hit)``, every hash of the hit in every group (not a new copy: no matching
        BlockRemoved will follow)."""
        h = req.hasher
        for g, spec in enumerate(self.groups):
            bs, s = self.gbs[g], self.scale[g]
            n = hit_tokens // bs
            self.pool.events.append(
                BlockStored(
                    block_hashes=[h.event_hashes[(i + 1) * s - 1] for i in range(n)],
                    parent_block_hash=None,
                    token_ids=req.all_token_ids[: n * bs],
                    block_size=self.event_bs or bs,
                    lora_id=req.lora_id,
                    medium=MEDIUM_GPU,
                    lora_name=req.lora_name,
                    extra_keys=[h.event_extra_keys(i * s) for i in range(n)],
                    group_idx=g,
                    kv_cache_spec_kind=spec.kind,
                    kv_cache_spec_sliding_window=spec.sliding_window,
                    session_id=req.session_id,
                )
            )

    def free(self, req: Request) -> None:
        for g in range(len(self.groups)):
            blocks = req.blocks[g]
            self.pool.free_blocks(blocks[::-1])
            req.blocks[g] = []
            req.num_cached[g] = 0
