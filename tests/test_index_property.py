"""Property tests: PrefixIndex against a brute-force reference model written from the rules.

A tiny vLLM-like simulator drives random event streams for 3-4 engines into both the index and
a reference. The reference never calls index internals: it names every block by its true
identity, the *token prefix it ends at* ``(model, tokens[:T])``, learned by replaying each
``BlockStored`` the way vLLM means it (the parent's prefix + ``token_ids``), and keeps, per engine
and per ``(group, medium)``, a multiset of such prefixes. Its hit rule is written from
docs/design.md "Cache hit rules" and docs/vllm-reference.md §5 / §4.3, by brute force (one
residency probe per block).

Engines differ in layout (single full-attention group with 16- or 32-token blocks, or a hybrid
full-attention + sliding-window pair in either group order, dense or sparse SWA events), in CPU
offload mode (none, self-describing, placeholder) and in engine-hash style (64-bit ints, often
>= 2**63, or 32-byte digests) and seed (two engines may share a seed, as vLLM with a fixed
PYTHONHASHSEED does).

Generation follows what vLLM does: a request hits the engine's current cached prefix and stores
each group's blocks from its hit point (so blocks between the hybrid hit and the full-attention
run are stored again: real duplicates with a parent); evictions remove one resident block (any
group, so sliding-window-only removals happen); CPU chunks are offloaded from GPU-resident
blocks; ``AllBlocksCleared`` resets an engine. One documented special case is modelled exactly
like the index does (indexer/ingest.py, ``_is_reannounce``): a GPU ``BlockStored`` with parent
``None`` that the engine would already hit as a whole is vLLM's ``kv_cache_report_mode=full``
re-announce and adds no reference; on a hybrid engine every such store of a batch is judged on
the state before the batch.
"""

from __future__ import annotations

import hashlib
import math
import random
from array import array
from collections import Counter
from dataclasses import dataclass, field

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from indexer.index import PrefixIndex
from indexer.wire import AllBlocksCleared, BlockRemoved, BlockStored
from tests.ingest_impls import IMPLS, as_impl

UNIT = 16
CHUNK = 256
GPU = "GPU"
CPU = "CPU"
FA = "full_attention"
SWA = "sliding_window"
MODEL = "m"
OTHER_MODEL = "other"
MAX_SEQ = 560  # two whole CPU chunks plus a partial one

Prefix = tuple[str, tuple[int, ...]]
STATS: Counter = Counter()


# --------------------------------------------------------------------------- engines


@dataclass
class Group:
    idx: int
    kind: str
    bs: int
    window: int | None = None


@dataclass
class EngineCfg:
    eid: tuple[str, int]
    model: str
    groups: list[Group]  # in group_idx order
    sparse_swa: bool
    cpu_mode: str | None  # None | "sd" (self-describing) | "ph" (placeholder)
    seed: int
    hash_bytes: bool
    _memo: dict[Prefix, int | bytes] = field(default_factory=dict)

    @property
    def fa(self) -> Group:
        return next(g for g in self.groups if g.kind == FA)

    def h(self, tokens: tuple[int, ...]) -> int | bytes:
        """The engine's own hash of the block ending at len(tokens): salted per engine."""
        key = (self.model, tokens)
        v = self._memo.get(key)
        if v is None:
            data = self.model.encode() + b"\0" + array("I", tokens).tobytes()
            if self.hash_bytes:
                v = hashlib.sha256(self.seed.to_bytes(8, "big") + data).digest()
            else:
                v = xxhash.xxh3_64_intdigest(data, self.seed)
            self._memo[key] = v
        return v


# --------------------------------------------------------------------------- reference


class RefEngine:
    """What a correct router knows about one engine, learned only from its events."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.hmap: dict[int | bytes, Prefix] = {}
        self.res: dict[tuple[int, str], Counter[Prefix]] = {}
        self.total: Counter[Prefix] = Counter()  # references over every (group, medium)
        self.groups: dict[int, tuple[str, int, int | None]] = {}
        self._memo: dict[tuple[int, str, int], bool] = {}

    # -- state
    def count(self, g: int, medium: str, p: Prefix) -> int:
        c = self.res.get((g, medium))
        return c[p] if c else 0

    def known(self, h: int | bytes) -> Prefix | None:
        """A hash resolves while the engine holds that block somewhere (any group, medium)."""
        p = self.hmap.get(h)
        return p if p is not None and self.total[p] > 0 else None

    def _inc(self, g: int, medium: str, p: Prefix) -> None:
        self.res.setdefault((g, medium), Counter())[p] += 1
        self.total[p] += 1

    def _dec(self, g: int, medium: str, p: Prefix) -> None:
        c = self.res[(g, medium)]
        c[p] -= 1
        if not c[p]:
            del c[p]
        self.total[p] -= 1
        if not self.total[p]:
            del self.total[p]

    def clear(self) -> None:
        self.res.clear()
        self.total.clear()
        self.hmap.clear()

    # -- replay
    def _dense_prefixes(self, ev: BlockStored, ahead: dict) -> list[Prefix] | None:
        if ev.parent_block_hash is None:
            base: tuple[int, ...] = ()
        else:
            p = self.known(ev.parent_block_hash) or ahead.get(ev.parent_block_hash)
            if p is None:
                return None
            base = p[1]
        bs = ev.block_size
        toks = tuple(ev.token_ids)
        model = ev.lora_name or self.model
        return [(model, base + toks[: (i + 1) * bs]) for i in range(len(toks) // bs)]

    def _ahead(self, batch: list, start: int) -> dict:
        """Hash -> prefix for the dense stores later in this batch (vLLM group order may put a
        sparse group's event before the dense group's event of the same step)."""
        out: dict = {}
        for ev in batch[start:]:
            if not isinstance(ev, BlockStored) or ev.block_size <= 0 or not ev.token_ids:
                continue
            if len(ev.block_hashes) != len(ev.token_ids) // ev.block_size:
                continue
            ps = self._dense_prefixes(ev, out)
            if ps is not None:
                out.update(zip(ev.block_hashes, ps, strict=True))
        return out

    def apply(self, batch: list) -> None:
        decided: dict[Prefix, bool] = {}
        if len(self.groups) > 1:
            # Hybrid engines: every from-root GPU store of the batch is judged on the state
            # before the batch, so one group's store applied first cannot make another
            # group's real store look like a re-announce (the real gemma3 captures show it).
            for ev in batch:
                if (
                    isinstance(ev, BlockStored)
                    and ev.parent_block_hash is None
                    and (ev.medium or GPU) == GPU
                    and ev.block_size > 0
                    and ev.token_ids
                    and ev.block_hashes
                    and any(self.res.values())
                ):
                    self._reannounce(ev, decided)
        for i, ev in enumerate(batch):
            if isinstance(ev, AllBlocksCleared):
                self.clear()
            elif isinstance(ev, BlockRemoved):
                g, medium = ev.group_idx or 0, ev.medium or GPU
                for h in ev.block_hashes:
                    p = self.known(h)
                    if p is not None and self.count(g, medium, p) > 0:
                        self._dec(g, medium, p)
            else:
                self._store(ev, batch, i, decided)

    def _store(self, ev: BlockStored, batch: list, i: int, decided: dict) -> None:
        g, medium = ev.group_idx or 0, ev.medium or GPU
        if medium == GPU and ev.block_size > 0:
            # Group facts come from every GPU BlockStored, even a sparse one listing no block
            # (test_group_learned_from_empty_sparse_event).
            kind = SWA if "sliding" in (ev.kv_cache_spec_kind or "") else FA
            self.groups[g] = (kind, ev.block_size, ev.kv_cache_spec_sliding_window)
        if not ev.block_hashes:
            return
        if ev.block_size <= 0 or not ev.token_ids:  # CPU placeholder: resolve through the map
            for h in ev.block_hashes:
                p = self.known(h)
                if p is not None:
                    self._inc(g, medium, p)
            return
        nblocks = len(ev.token_ids) // ev.block_size
        if len(ev.block_hashes) < nblocks:  # sparse: resolve each listed hash
            ahead = self._ahead(batch, i + 1)
            for h in ev.block_hashes:
                p = self.known(h) or ahead.get(h)
                if p is not None:
                    self.hmap[h] = p
                    self._inc(g, medium, p)
            return
        prefixes = self._dense_prefixes(ev, {})
        assert prefixes is not None, "generator bug: store with an unknown parent"
        if ev.parent_block_hash is None and medium == GPU and self._reannounce(ev, decided):
            return
        for h, p in zip(ev.block_hashes, prefixes, strict=True):
            self.hmap[h] = p
            self._inc(g, medium, p)

    def _reannounce(self, ev: BlockStored, decided: dict[Prefix, bool]) -> bool:
        """vLLM's ``kv_cache_report_mode=full`` re-announce: a GPU store from token 0 that the
        engine, by the hit rules over all its groups, would already hit as a whole (aligned to
        the LCM of the group block sizes). It adds no reference. Decided once per prefix per
        batch: the per-group events of one request step are judged alike (indexer/ingest.py
        ``_is_reannounce``, the documented special case)."""
        if not self.groups:
            return False
        align = math.lcm(*(bs for _, bs, _ in self.groups.values()))
        point = len(ev.token_ids) // align * align
        if point == 0:
            return False
        model = ev.lora_name or self.model
        prompt = tuple(ev.token_ids[:point])
        key = (model, prompt)
        if key not in decided:
            self._memo = {}
            decided[key] = all(self.group_ok(g, point, model, prompt) for g in self.groups)
        return decided[key]

    # -- the hit rules, by brute force (one residency probe per block)
    def has(self, g: int, medium: str, model: str, prompt: tuple[int, ...], t: int) -> bool:
        memo_key = (g, medium, t)
        v = self._memo.get(memo_key)
        if v is None:
            v = self._memo[memo_key] = self.count(g, medium, (model, prompt[:t])) > 0
        return v

    def group_ok(self, g: int, point: int, model: str, prompt: tuple[int, ...]) -> bool:
        """Does group g accept a hit of exactly ``point`` tokens?"""
        kind, bs, window = self.groups[g]
        end = point // bs
        # Full attention: the unbroken run from token 0. Sliding window: the cdiv(W - 1, bs)
        # blocks ending at the point, or all of them if there are fewer.
        first = 0 if kind == FA else max(end - (-(-((window or bs) - 1) // bs)), 0)
        return all(self.has(g, GPU, model, prompt, (j + 1) * bs) for j in range(first, end))

    def match(self, prompt: tuple[int, ...], model: str) -> tuple[int, int]:
        self._memo = {}  # residency probes of this one prompt
        n = len(prompt)
        if not self.groups:
            return 0, 0
        align = math.lcm(*(bs for _, bs, _ in self.groups.values()))
        # The largest aligned point <= n - 1 that every group accepts: start from the
        # full-attention run (downward-closed) and try every aligned point right to left.
        point = max(n - 1, 0)
        for g, (kind, bs, _) in self.groups.items():
            if kind == FA:
                run = 0
                while run + bs <= point and self.has(g, GPU, model, prompt, run + bs):
                    run += bs
                point = run
        point = point // align * align
        while point > 0 and not all(self.group_ok(g, point, model, prompt) for g in self.groups):
            point -= align
        return point, self.cpu_extension(prompt, model, point)

    def cpu_extension(self, prompt: tuple[int, ...], model: str, gpu: int) -> int:
        """vLLM's OffloadingConnectorScheduler._lookup_complete_chunks: the lookup covers the
        request's whole chunks (n // chunk), ending at n - 1 when a sliding-window group sits
        beside full attention; chunks count when present on CPU contiguously from chunk
        gpu // chunk in every full-attention group; each sliding-window group needs the
        cdiv(W, chunk) chunks before the load's end (or all of them from that start chunk),
        so the load ends at the largest such point; it must gain at least one whole chunk;
        a load reaching the prompt's end counts in full (cached_tokens is taken at admission)."""
        n = len(prompt)
        fa = [g for g, (k, _, _) in self.groups.items() if k == FA]
        swa = [(g, -(-(w or 1) // CHUNK)) for g, (k, _, w) in self.groups.items() if k == SWA]
        if not fa:
            fa, swa = list(self.groups), []
        whole = n // CHUNK
        end = min(n - 1, whole * CHUNK) if swa else whole * CHUNK
        if end - gpu < CHUNK:
            return 0
        start = k = gpu // CHUNK
        while k < whole and all(self.has(g, CPU, model, prompt, (k + 1) * CHUNK) for g in fa):
            k += 1

        def windows_held(kk: int) -> bool:
            return all(
                self.has(g, CPU, model, prompt, (c + 1) * CHUNK)
                for g, need in swa
                for c in range(max(kk - need, start), kk)
            )

        while k > start and not windows_held(k):
            k -= 1
        loaded = min(k * CHUNK, end) - gpu
        return loaded if loaded >= CHUNK else 0


# --------------------------------------------------------------------------- generation helpers

SEQ_LEN = st.one_of(
    st.integers(0, MAX_SEQ),
    st.builds(
        lambda b, d: min(max(b + d, 0), MAX_SEQ),
        st.sampled_from([16, 32, 48, 64, 96, 128, 240, 256, 272, 288, 512]),
        st.sampled_from([-1, 0, 1]),
    ),
)


def rand_tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(1, 4) for _ in range(n))


def draw_cut(data: st.DataObject, length: int) -> int:
    """A length in [0, length], biased to block and chunk boundaries +-1."""
    boundaries = sorted(
        {
            min(max(b + d, 0), length)
            for b in (0, 16, 32, 48, 64, 96, 256, 272, 512, length)
            for d in (-1, 0, 1)
        }
    )
    return data.draw(st.one_of(st.integers(0, length), st.sampled_from(boundaries)))


def make_index() -> PrefixIndex:
    return PrefixIndex(unit=UNIT, cpu_chunk_tokens=CHUNK)


ENGINE_IDS = [("w0", 0), ("w0", 1), ("w1", 0), ("w2", 3)]


@st.composite
def engine_cfgs(draw: st.DrawFn, n: int) -> list[EngineCfg]:
    out = []
    for i in range(n):
        if draw(st.booleans()):
            groups = [Group(0, FA, draw(st.sampled_from([16, 32])))]
            sparse = False
        else:
            fa_idx = draw(st.sampled_from([0, 1]))
            fa = Group(fa_idx, FA, draw(st.sampled_from([16, 32])))
            swa = Group(
                1 - fa_idx,
                SWA,
                draw(st.sampled_from([16, 32])),
                draw(st.sampled_from([32, 48, 64, 17, 33])),
            )
            groups = sorted([fa, swa], key=lambda g: g.idx)
            sparse = draw(st.booleans())
        out.append(
            EngineCfg(
                eid=ENGINE_IDS[i],
                model=OTHER_MODEL if i == 3 and draw(st.booleans()) else MODEL,
                groups=groups,
                sparse_swa=sparse,
                cpu_mode=draw(st.sampled_from([None, "sd", "ph"])),
                seed=draw(st.sampled_from([0, 1, 2**63 + 5])),
                hash_bytes=draw(st.booleans()),
            )
        )
    return out


def stored(
    cfg: EngineCfg,
    g: Group,
    seq: tuple[int, ...],
    s: int,
    t: int,
    hashes_mask: list[bool] | None = None,
) -> BlockStored:
    """vLLM's BlockStored for blocks [s, t) of group g of the sequence seq."""
    bs = g.bs
    hashes = [cfg.h(seq[: (j + 1) * bs]) for j in range(s, t)]
    if hashes_mask is not None:
        hashes = [h for h, keep in zip(hashes, hashes_mask, strict=True) if keep]
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=cfg.h(seq[: s * bs]) if s else None,
        token_ids=list(seq[s * bs : t * bs]),
        block_size=bs,
        lora_id=None,
        medium=GPU,
        lora_name=None,
        group_idx=g.idx,
        kv_cache_spec_kind=g.kind,
        kv_cache_spec_sliding_window=g.window,
    )


# --------------------------------------------------------------------------- the state machine


class IndexVsReference(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = make_index()
        self.cfgs: list[EngineCfg] = []
        self.refs: dict[tuple[str, int], RefEngine] = {}
        self.seqs: list[tuple[int, ...]] = []
        self.chunks: dict[tuple[str, int], list[list[int | bytes]]] = {}  # sd CPU chunks stored
        self.rng = random.Random(0)

    @initialize(data=st.data(), n=st.integers(3, 4), seed=st.integers(0, 2**32))
    def setup(self, data: st.DataObject, n: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.cfgs = data.draw(engine_cfgs(n))
        for cfg in self.cfgs:
            self.index.add_engine(cfg.eid, cfg.model)
            self.refs[cfg.eid] = RefEngine(cfg.model)
            self.chunks[cfg.eid] = []
        root = rand_tokens(self.rng, MAX_SEQ)
        self.seqs = [root, root[:300] + rand_tokens(self.rng, 200), rand_tokens(self.rng, 100)]

    # -- helpers
    def _engine(self, data: st.DataObject) -> tuple[EngineCfg, RefEngine]:
        cfg = data.draw(st.sampled_from(self.cfgs))
        return cfg, self.refs[cfg.eid]

    def _apply(self, cfg: EngineCfg, batch: list) -> None:
        if batch:
            self.index.apply(cfg.eid, batch)
            self.refs[cfg.eid].apply(batch)

    def _check(self, prompt: tuple[int, ...], model: str = MODEL) -> None:
        got = self.index.match(list(prompt), self.index.root(model))
        for cfg in self.cfgs:
            want = self.refs[cfg.eid].match(prompt, model)
            m = got[cfg.eid]
            STATS[(want[0] > 0, want[1] > 0, len(cfg.groups), cfg.sparse_swa)] += 1
            assert (m.gpu_tokens, m.cpu_tokens) == want, (
                f"{cfg.eid} layout={cfg.groups} cpu={cfg.cpu_mode} n={len(prompt)}: "
                f"index=({m.gpu_tokens}, {m.cpu_tokens}) reference={want}"
            )

    def _cpu_events(
        self, cfg: EngineCfg, seq: tuple[int, ...], k0: int, k1: int, ref: RefEngine | None
    ) -> list[BlockStored]:
        """CPU BlockStored for chunks k0..k1 of seq (stops at the first chunk whose tail is not
        GPU-resident; ``ref=None``: the caller guarantees residency)."""
        g = cfg.fa
        out: list[BlockStored] = []
        for k in range(k0, k1 + 1):
            tail = seq[: (k + 1) * CHUNK]
            if ref is not None and not ref.count(g.idx, GPU, (cfg.model, tail)):
                break
            if cfg.cpu_mode == "ph":
                out.append(
                    BlockStored([cfg.h(tail)], None, [], 0, None, CPU, None, group_idx=g.idx)
                )
            else:
                hashes = [cfg.h(seq[: k * CHUNK + (j + 1) * g.bs]) for j in range(CHUNK // g.bs)]
                out.append(
                    BlockStored(
                        hashes,
                        cfg.h(seq[: k * CHUNK]) if k else None,
                        list(seq[k * CHUNK : (k + 1) * CHUNK]),
                        g.bs,
                        None,
                        CPU,
                        None,
                        group_idx=g.idx,
                        kv_cache_spec_kind=FA,
                    )
                )
                self.chunks[cfg.eid].append(hashes)
        return out

    def _store_events(
        self, cfg: EngineCfg, prompt: tuple[int, ...], start: int, offload_from: int | None
    ) -> list[BlockStored]:
        """One vLLM step for a prompt computed from token ``start`` (a multiple of every group's
        block size): each group's BlockStored in group order (sparse on SWA groups of sparse
        engines), then the connector's CPU events for chunks ``offload_from``.. if given."""
        batch: list[BlockStored] = []
        for g in cfg.groups:
            s, t = start // g.bs, len(prompt) // g.bs
            if t <= s:
                continue
            mask = None
            if g.kind == SWA and cfg.sparse_swa:
                mask = [self.rng.random() < 0.5 for _ in range(s, t)]
            batch.append(stored(cfg, g, prompt, s, t, mask))
        nchunks = len(prompt) // CHUNK
        if cfg.cpu_mode and offload_from is not None and offload_from < nchunks:
            # Every chunk tail up to the prompt's last full block is GPU-resident after this
            # batch's full-attention store, and each chunk's parent is the previous tail.
            batch += self._cpu_events(cfg, prompt, offload_from, nchunks - 1, None)
        return batch

    def _evict_events(
        self, cfg: EngineCfg, seq: tuple[int, ...], start: int, swa_too: bool
    ) -> list[BlockRemoved]:
        """Every resident GPU copy of seq's blocks ending after ``start``, tail first (vLLM
        frees a request's blocks in reverse order), one single-hash BlockRemoved each."""
        ref = self.refs[cfg.eid]
        batch: list[BlockRemoved] = []
        for g in cfg.groups:
            if g.kind == SWA and not swa_too:
                continue
            for j in reversed(range(-(-start // g.bs), len(seq) // g.bs)):
                p = (cfg.model, seq[: (j + 1) * g.bs])
                n = ref.count(g.idx, GPU, p)
                batch += [BlockRemoved([cfg.h(p[1])], medium=GPU, group_idx=g.idx)] * n
        return batch

    # -- rules
    @rule(data=st.data(), length=SEQ_LEN)
    def new_sequence(self, data: st.DataObject, length: int) -> None:
        if len(self.seqs) >= 8:
            return
        base = data.draw(st.sampled_from(self.seqs))
        cut = draw_cut(data, min(len(base), length))
        self.seqs.append(base[:cut] + rand_tokens(self.rng, length - cut))

    @rule(data=st.data())
    def request(self, data: st.DataObject) -> None:
        """A prompt is scheduled: every group stores its full blocks from the engine's hit (so
        blocks between that hit and the full-attention run are stored again: duplicates)."""
        cfg, ref = self._engine(data)
        seq = data.draw(st.sampled_from(self.seqs))
        prompt = seq[: draw_cut(data, len(seq))]
        hit, _ = ref.match(prompt, cfg.model)
        nchunks = len(prompt) // CHUNK
        offload = None
        if cfg.cpu_mode and nchunks and data.draw(st.booleans()):
            offload = data.draw(st.integers(0, nchunks - 1))
        self._apply(cfg, self._store_events(cfg, prompt, hit, offload))

    @rule(data=st.data())
    def restore(self, data: st.DataObject) -> None:
        """Blocks stored again from an earlier aligned point than the engine's hit: duplicates
        with a parent, or from token 0 (parent None: the re-announce shape)."""
        cfg, ref = self._engine(data)
        seq = data.draw(st.sampled_from(self.seqs))
        align = math.lcm(*(g.bs for g in cfg.groups))
        g = cfg.fa
        run = 0
        while run + g.bs <= len(seq) and ref.count(g.idx, GPU, (cfg.model, seq[: run + g.bs])):
            run += g.bs
        start = data.draw(st.integers(0, run // align)) * align
        end = data.draw(st.integers(start, len(seq)))
        self._apply(cfg, self._store_events(cfg, seq[:end], start, None))

    @rule(data=st.data())
    def offload_then_lose_gpu(self, data: st.DataObject) -> None:
        """The CPU tier's reason to exist: a long prompt is offloaded, then its GPU blocks are
        evicted from some point on while the CPU chunks stay."""
        cfgs = [c for c in self.cfgs if c.cpu_mode]
        seqs = [s for s in self.seqs if len(s) >= CHUNK]
        if not cfgs or not seqs:
            return
        cfg = data.draw(st.sampled_from(cfgs))
        seq = data.draw(st.sampled_from(seqs))
        hit, _ = self.refs[cfg.eid].match(seq, cfg.model)
        self._apply(cfg, self._store_events(cfg, seq, hit, data.draw(st.sampled_from([0, 1]))))
        start = data.draw(st.sampled_from([0, 16, 32, 64, 128, 240, 256, 272, 320]))
        self._apply(cfg, self._evict_events(cfg, seq, start, data.draw(st.booleans())))
        for cut in (CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK - 1, 2 * CHUNK, 2 * CHUNK + 1):
            if cut <= len(seq):  # chunk-boundary prompts: the last-token cap matters there
                self._check(seq[:cut])

    @rule(data=st.data(), k=st.integers(1, 3))
    def evict(self, data: st.DataObject, k: int) -> None:
        """GPU eviction: one BlockRemoved with a single hash per removed block, any group."""
        cfg, ref = self._engine(data)
        pool = Counter()
        for (g, medium), c in ref.res.items():
            if medium == GPU:
                for p, n in c.items():
                    pool[(g, p)] = n
        batch = []
        for _ in range(k):
            live = sorted(x for x, n in pool.items() if n > 0)
            if not live:
                break
            g, p = data.draw(st.sampled_from(live))
            pool[(g, p)] -= 1
            batch.append(BlockRemoved([cfg.h(p[1])], medium=GPU, group_idx=g))
        self._apply(cfg, batch)

    @rule(data=st.data())
    def evict_tail(self, data: st.DataObject) -> None:
        """LRU-like eviction of a sequence's tail, in full attention and (or not) in SWA."""
        cfg, _ = self._engine(data)
        seq = data.draw(st.sampled_from(self.seqs))
        start = min(data.draw(st.sampled_from([0, 16, 32, 64, 256])), len(seq))
        if data.draw(st.booleans()):
            start = draw_cut(data, len(seq))
        self._apply(cfg, self._evict_events(cfg, seq, start, data.draw(st.booleans())))

    @rule(data=st.data())
    def evict_swa_only(self, data: st.DataObject) -> None:
        """Sliding-window-only eviction: full attention keeps the prefix, the window goes."""
        hybrid = [c for c in self.cfgs if len(c.groups) > 1]
        if not hybrid:
            return
        cfg = data.draw(st.sampled_from(hybrid))
        seq = data.draw(st.sampled_from(self.seqs))
        ref = self.refs[cfg.eid]
        swa = next(g for g in cfg.groups if g.kind == SWA)
        live = [
            j
            for j in range(len(seq) // swa.bs)
            if ref.count(swa.idx, GPU, (cfg.model, seq[: (j + 1) * swa.bs]))
        ]
        if not live:
            return
        picks = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=3, unique=True))
        self._apply(
            cfg, [BlockRemoved([cfg.h(seq[: (j + 1) * swa.bs])], GPU, swa.idx) for j in picks]
        )

    @rule(data=st.data())
    def restart(self, data: st.DataObject) -> None:
        """The worker restarts (sequence number went back): the engine is dropped whole and
        registered again, possibly reusing its slot."""
        cfg, _ = self._engine(data)
        self.index.remove_engine(cfg.eid)
        self.index.add_engine(cfg.eid, cfg.model)
        self.refs[cfg.eid] = RefEngine(cfg.model)
        self.chunks[cfg.eid].clear()

    @rule(data=st.data())
    def clear(self, data: st.DataObject) -> None:
        cfg, _ = self._engine(data)
        self.chunks[cfg.eid].clear()
        self._apply(cfg, [AllBlocksCleared()])

    @rule(data=st.data())
    def offload(self, data: st.DataObject) -> None:
        """CPU offload of consecutive 256-token chunks whose tail blocks are GPU-resident."""
        cfgs = [c for c in self.cfgs if c.cpu_mode]
        if not cfgs:
            return
        cfg = data.draw(st.sampled_from(cfgs))
        ref = self.refs[cfg.eid]
        seqs = [s for s in self.seqs if len(s) >= CHUNK]
        if not seqs:
            return
        seq = data.draw(st.sampled_from(seqs))
        nchunks = len(seq) // CHUNK
        k0 = data.draw(st.integers(0, nchunks - 1))
        k1 = data.draw(st.integers(k0, nchunks - 1))
        if k0 and ref.known(cfg.h(seq[: k0 * CHUNK])) is None:
            return  # the parent must be known: vLLM offloads blocks it just computed
        self._apply(cfg, self._cpu_events(cfg, seq, k0, k1, ref))

    @rule(data=st.data())
    def cpu_evict(self, data: st.DataObject) -> None:
        cfgs = [c for c in self.cfgs if c.cpu_mode]
        if not cfgs:
            return
        cfg = data.draw(st.sampled_from(cfgs))
        ref = self.refs[cfg.eid]
        g = cfg.fa.idx
        if cfg.cpu_mode == "sd":
            chunks = self.chunks[cfg.eid]
            if not chunks:
                return
            hashes = chunks.pop(data.draw(st.integers(0, len(chunks) - 1)))
        else:
            live = sorted(ref.res.get((g, CPU), {}))
            if not live:
                return
            hashes = [cfg.h(data.draw(st.sampled_from(live))[1])]
        self._apply(cfg, [BlockRemoved(hashes, medium=CPU, group_idx=g)])

    @rule(data=st.data())
    def noise(self, data: st.DataObject) -> None:
        """Events a router must tolerate without effect: a placeholder for a hash never seen,
        a removal of an unknown hash, a removal on a medium/group that does not hold it."""
        cfg, ref = self._engine(data)
        bogus = cfg.h((99,) * 16)
        batch: list = [
            BlockStored([bogus], None, [], 0, None, CPU, None, group_idx=cfg.fa.idx),
            BlockRemoved([bogus], medium=GPU, group_idx=cfg.fa.idx),
        ]
        if ref.total:
            p = data.draw(st.sampled_from(sorted(ref.total)))
            for g in cfg.groups:
                for medium in (GPU, CPU):
                    if not ref.count(g.idx, medium, p):
                        batch.append(BlockRemoved([cfg.h(p[1])], medium=medium, group_idx=g.idx))
        self._apply(cfg, batch)

    @rule(data=st.data())
    def check_prompt(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        kind = data.draw(st.sampled_from(["prefix", "extension", "unrelated", "tiny"]))
        if kind == "prefix":
            prompt = seq[: draw_cut(data, len(seq))]
        elif kind == "extension":
            prompt = seq + rand_tokens(self.rng, data.draw(st.integers(1, 40)))
        elif kind == "unrelated":
            prompt = rand_tokens(self.rng, data.draw(st.integers(0, MAX_SEQ)))
        else:
            prompt = seq[: data.draw(st.integers(0, 2))]
        self._check(prompt)
        self._check(prompt, OTHER_MODEL)

    @precondition(lambda self: bool(self.seqs))
    @invariant()
    def full_sequences_agree(self) -> None:
        for seq in self.seqs:
            self._check(seq)


IndexVsReference.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestIndexVsReference = IndexVsReference.TestCase


# --------------------------------------------------------------------------- isolation


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    bs=st.sampled_from([16, 32]),
    same_hashes=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_eviction_on_one_engine_never_changes_another(
    data: st.DataObject, bs: int, same_hashes: bool, seed: int, impl: str
) -> None:
    """Two engines hold overlapping prefixes (with identical engine hashes when they share a
    hash seed). Whatever engine A loses -- single GPU blocks, CPU chunks, AllBlocksCleared,
    clear_engine, remove_engine -- engine B's match must not move."""
    rng = random.Random(seed)
    idx = make_index()
    g = Group(0, FA, bs)
    a = EngineCfg(("a", 0), MODEL, [g], False, "ph", 7, False)
    b = EngineCfg(("b", 0), MODEL, [g], False, "ph", 7 if same_hashes else 8, False)
    idx.add_engine(a.eid, MODEL)
    idx.add_engine(b.eid, MODEL)
    base = rand_tokens(rng, 520)
    seqs = [base, base[:272] + rand_tokens(rng, 250), rand_tokens(rng, 300)]
    blocks_a: list[tuple[int, ...]] = []
    for cfg in (a, b):
        for seq in seqs:
            if cfg is b and seq is not seqs[0] and not data.draw(st.booleans()):
                continue
            n = len(seq) // bs
            idx.apply(cfg.eid, as_impl([stored(cfg, g, seq, 0, n)], impl))
            if cfg is a:
                blocks_a += [seq[: (j + 1) * bs] for j in range(n)]
            for k in range(len(seq) // CHUNK):
                tail = seq[: (k + 1) * CHUNK]
                idx.apply(
                    cfg.eid,
                    as_impl([BlockStored([cfg.h(tail)], None, [], 0, None, CPU, None)], impl),
                )
    prompts = [s[:cut] for s in seqs for cut in (1, 17, 33, 257, 300, len(s))] + [
        (*s, 2) for s in seqs
    ]

    def b_view() -> list[tuple[int, int]]:
        root = idx.root(MODEL)
        return [
            (m.gpu_tokens, m.cpu_tokens)
            for m in (idx.match(list(p), root, [b.eid])[b.eid] for p in prompts)
        ]

    before = b_view()
    assert any(x != (0, 0) for x in before)
    for _ in range(data.draw(st.integers(1, 12))):
        p = data.draw(st.sampled_from(blocks_a))
        medium = data.draw(st.sampled_from([GPU, CPU]))
        idx.apply(a.eid, as_impl([BlockRemoved([a.h(p)], medium=medium, group_idx=0)], impl))
        assert b_view() == before
    end = data.draw(st.sampled_from(["cleared", "clear_engine", "remove_engine"]))
    if end == "cleared":
        idx.apply(a.eid, as_impl([AllBlocksCleared()], impl))
    elif end == "clear_engine":
        idx.clear_engine(a.eid)
    else:
        idx.remove_engine(a.eid)
        # A newcomer reusing A's slot must start empty and must not disturb B either.
        c = EngineCfg(("c", 0), MODEL, [g], False, None, 9, False)
        idx.add_engine(c.eid, MODEL)
        other = rand_tokens(rng, 64)
        idx.apply(c.eid, as_impl([stored(c, g, other, 0, len(other) // bs)], impl))
        root = idx.root(MODEL)
        assert all(
            (m.gpu_tokens, m.cpu_tokens) == (0, 0)
            for p in prompts
            for m in [idx.match(list(p), root, [("c", 0)])[("c", 0)]]
        )
    assert b_view() == before


# --------------------------------------------------------------------------- single cases


def test_group_learned_from_empty_sparse_event() -> None:
    """vLLM emits a sparse SWA BlockStored even when it lists no block (docs/vllm-reference.md
    §3.1: "can even be empty: the event is still emitted"), e.g. the first chunked-prefill step
    of a long prompt, where no block of the chunk lies at a semantic boundary. Its kind, block
    size and window are still facts about the group (docs/design.md: learn them from
    BlockStored)."""
    idx = make_index()
    cfg = EngineCfg(
        ("w0", 0), MODEL, [Group(0, FA, 16), Group(1, SWA, 16, 32)], True, None, 0, False
    )
    idx.add_engine(cfg.eid, MODEL)
    seq = tuple(range(1, 66))
    fa, swa = cfg.groups
    idx.apply(cfg.eid, [stored(cfg, fa, seq, 0, 4), stored(cfg, swa, seq, 0, 4, [False] * 4)])
    m = idx.match(list(seq), idx.root(MODEL))[cfg.eid]
    # Full attention holds [0, 64); the sliding-window group holds nothing, so no point > 0
    # has the window's blocks resident: vLLM's hybrid hit is 0.
    assert (m.gpu_tokens, m.cpu_tokens) == (0, 0)


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
