"""KV-cache manager and hybrid coordinator (one shared ``BlockPool``, N groups).

Mirrors vLLM 0.33:
- ``kv_cache_coordinator.py`` ``HybridKVCacheCoordinator.find_longest_cache_hit`` (L806):
  start at ``num_tokens - 1`` (``get_computed_blocks``), full attention first, then each
  other group shrinks the hit until a fixed point; the result per group plus the
  "uncached common prefix" (longest single-group hit) used for junction retention.
- ``single_type_kv_cache_manager.py``: ``FullAttentionManager`` (L739, left-to-right scan),
  ``SlidingWindowManager`` (L946/L969: ``cdiv(W-1, bs)`` contiguous cached blocks ending at
  the hit, right-to-left; a shorter run starting at block 0 also counts), ``MambaManager``
  (L1428: the single state block at the boundary), ``remove_skipped_blocks`` (early free of
  blocks that left the window, tail first, not announced), ``reachable_block_mask`` (sparse
  retention with ``prefix_cache_retention_interval=0``).
- ``block_pool.cache_full_blocks`` (L230): one ``BlockStored`` per group per call, blocks
  ``[num_cached, num_full)``, masked/null blocks skipped from ``block_hashes`` while
  ``token_ids`` covers the whole range, parent = hash of block ``num_cached - 1``.
- ``KVCacheManager.free``: groups in order, each group's blocks in reverse order.
"""

from __future__ import annotations

from dataclasses import dataclass

from simulator.block_pool import BlockPool
from simulator.events import MEDIUM_GPU, BlockStored
from simulator.request import Request

FULL = "full_attention"
SWA = "sliding_window"
MAMBA = "mamba"


@dataclass(frozen=True)
class GroupSpec:
    kind: str
    sliding_window: int | None = None


def parse_groups(spec: str) -> list[GroupSpec]:
    """``"full"``, ``"full,swa:64"``, ``"swa:64,full"``, ``"full,mamba"``."""
    out: list[GroupSpec] = []
    for part in spec.split(","):
        p = part.strip().lower()
        if not p:
            continue
        if p in ("full", "full_attention", "fa"):
            out.append(GroupSpec(FULL))
        elif p.startswith(("swa", "sliding_window")):
            _, _, w = p.partition(":")
            if not w.isdigit() or int(w) < 2:
                raise ValueError(f"sliding window group needs a window, e.g. swa:64 (got {part!r})")
            out.append(GroupSpec(SWA, int(w)))
        elif p == "mamba":
            out.append(GroupSpec(MAMBA))
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
    ) -> None:
        self.groups = groups
        self.pool = BlockPool(num_blocks)
        self.bs = block_size
        self.retention = retention_interval
        self.event_bs = event_block_size or block_size
        self.fa = [g for g, s in enumerate(groups) if s.kind == FULL]
        self.other = [g for g, s in enumerate(groups) if s.kind != FULL]
        # cdiv(W-1, bs) blocks needed at the hit boundary (SWA); 1 state block for mamba.
        self.needed = [
            _cdiv(s.sliding_window - 1, block_size) if s.kind == SWA else 1 for s in groups
        ]

    # ---- hits ---------------------------------------------------------------------------
    def _group_hit(self, g: int, digests: list[bytes], limit: int) -> int:
        cached = self.pool.cached
        if self.groups[g].kind == MAMBA:
            for i in range(limit - 1, -1, -1):
                if (digests[i], g) in cached:
                    return i + 1
            return 0
        need = self.needed[g]
        run = 0
        for i in range(limit - 1, -1, -1):
            if (digests[i], g) in cached:
                run += 1
                if run >= need:
                    return i + need
            else:
                run = 0
        return run  # a shorter run that starts at block 0 still counts

    def find_hit(self, req: Request) -> tuple[int, list[list[int]], int]:
        """(hit blocks, per-group blocks with 0 = null, longest single-group hit blocks)."""
        n_hashes = req.hasher.extend(req.all_token_ids)
        digests = req.hasher.digests
        limit = min((len(req.all_token_ids) - 1) // self.bs, n_hashes)
        cached = self.pool.cached
        hit = limit
        fa_blocks: dict[int, list[int]] = {}
        for g in self.fa:  # left-to-right scan, collecting the first cached block per hash
            found: list[int] = []
            append = found.append
            for n in range(hit):
                blocks = cached.get((digests[n], g))
                if not blocks:
                    break
                append(next(iter(blocks)))
            hit = len(found)
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
            if hit == 0:
                per_group.append([])
            elif spec.kind == FULL:
                per_group.append(fa_blocks[g][:hit])
            else:
                keep = 1 if spec.kind == MAMBA else self.needed[g]
                start = max(0, hit - keep)
                tail = [get((digests[i], g)) or 0 for i in range(start, hit)]
                per_group.append([0] * start + tail)
        return hit, per_group, longest

    # ---- allocation -------------------------------------------------------------------------
    def remove_skipped_blocks(self, req: Request, total_computed: int) -> None:
        for g in self.other:
            spec = self.groups[g]
            if spec.kind == SWA:
                skipped = total_computed - spec.sliding_window + 1
            else:  # mamba keeps only the state of the last computed block
                skipped = total_computed - 1
            if skipped <= 0:
                continue
            blocks = req.blocks[g]
            n = min(skipped // self.bs, len(blocks))
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
        n_need_blocks = _cdiv(need_slots, self.bs)
        to_alloc: list[int] = []
        n_touch_free = 0
        ref = self.pool.ref
        for g in range(len(self.groups)):
            have = len(req.blocks[g]) + (len(new_computed[g]) if new_computed else 0)
            to_alloc.append(max(0, n_need_blocks - have))
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

    def _mask_fn(self, req: Request, g: int):  # type: ignore[no-untyped-def]
        spec = self.groups[g]
        if spec.kind == FULL or self.retention is None:
            return None
        bounds = set(req.reachable or ())
        if self.retention and self.retention > 0:
            step = max(1, self.retention // self.bs)
            top = len(req.all_token_ids) // self.bs
            bounds.update(range(step, top + 1, step))
        keep = 1 if spec.kind == MAMBA else self.needed[g]
        allowed: set[int] = set()
        for b in bounds:
            allowed.update(range(max(0, b - keep), b))
        return allowed

    def cache_blocks(self, req: Request, num_tokens: int) -> None:
        num_full = num_tokens // self.bs
        hasher = req.hasher
        n_hashes = hasher.extend(req.all_token_ids)
        num_full = min(num_full, n_hashes)
        digests = hasher.digests
        ev_hashes_all = hasher.event_hashes
        pool = self.pool
        for g, spec in enumerate(self.groups):
            nc = req.num_cached[g]
            if num_full <= nc:
                continue
            blocks = req.blocks[g]
            allowed = self._mask_fn(req, g)
            ev_hashes: list[int] = []
            extra: list[tuple | None] = []
            for i in range(nc, num_full):
                b = blocks[i]
                if b == 0 or (allowed is not None and i not in allowed):
                    continue
                pool.cache_block(b, (digests[i], g))
                ev_hashes.append(ev_hashes_all[i])
                extra.append(hasher.event_extra_keys(i))
            pool.events.append(
                BlockStored(
                    block_hashes=ev_hashes,
                    parent_block_hash=ev_hashes_all[nc - 1] if nc > 0 else None,
                    token_ids=req.all_token_ids[nc * self.bs : num_full * self.bs],
                    block_size=self.event_bs,
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

    def emit_cached_block_events(self, req: Request, hit_blocks: int) -> None:
        """``block_pool.emit_cached_block_events`` (L405): a request sent with
        ``kv_cache_report_mode="full"`` re-announces its prefix hit, parent None, tokens
        ``[0, hit)``, every hash of the hit in every group (not a new copy: no matching
        BlockRemoved will follow)."""
        h = req.hasher
        n = hit_blocks
        for g, spec in enumerate(self.groups):
            self.pool.events.append(BlockStored(
                block_hashes=h.event_hashes[:n], parent_block_hash=None,
                token_ids=req.all_token_ids[: n * self.bs], block_size=self.event_bs,
                lora_id=req.lora_id, medium=MEDIUM_GPU, lora_name=req.lora_name,
                extra_keys=[h.event_extra_keys(i) for i in range(n)], group_idx=g,
                kv_cache_spec_kind=spec.kind, kv_cache_spec_sliding_window=spec.sliding_window,
                session_id=req.session_id))

    def free(self, req: Request) -> None:
        for g in range(len(self.groups)):
            blocks = req.blocks[g]
            self.pool.free_blocks(blocks[::-1])
            req.blocks[g] = []
            req.num_cached[g] = 0
