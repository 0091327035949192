"""Behaviour of the prefix index on hand-built vLLM event sequences (the hard cases first)."""

from __future__ import annotations

import itertools

import pytest

from indexer.index import GroupSpec, PrefixIndex
from indexer.keys import chain_keys
from indexer.wire import AllBlocksCleared, BlockRemoved, BlockStored

MODEL = "m"
W0: tuple[str, int] = ("http://w0", 0)
W1: tuple[str, int] = ("http://w1", 0)

_hash_counter = itertools.count(2**63)  # engine hashes >= 2**63, as vLLM often sends


def prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


class Engine:
    """Emits events the way one vLLM engine would, with its own (arbitrary) hash values."""

    def __init__(self) -> None:
        self.hash_of: dict[tuple[int, ...], int] = {}

    def h(self, prefix: list[int]) -> int:
        key = tuple(prefix)
        if key not in self.hash_of:
            self.hash_of[key] = next(_hash_counter)
        return self.hash_of[key]

    def stored(
        self,
        tokens: list[int],
        start: int,
        end: int,
        bs: int,
        group: int = 0,
        kind: str | None = "full_attention",
        window: int | None = None,
        medium: str = "GPU",
        listed: list[int] | None = None,
        lora: str | None = None,
        extra_keys: list | None = None,
    ) -> BlockStored:
        """BlockStored for blocks [start, end) of ``tokens``; ``listed`` = sparse block subset."""
        blocks = listed if listed is not None else list(range(start, end))
        return BlockStored(
            block_hashes=[self.h(tokens[: (b + 1) * bs]) for b in blocks],
            parent_block_hash=self.h(tokens[: start * bs]) if start else None,
            token_ids=tokens[start * bs : end * bs],
            block_size=bs,
            lora_id=None,
            medium=medium,
            lora_name=lora,
            extra_keys=extra_keys,
            group_idx=group,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window,
        )

    def removed(
        self, tokens: list[int], blocks: list[int], bs: int, group: int = 0, medium: str = "GPU"
    ) -> list[BlockRemoved]:
        return [
            BlockRemoved([self.h(tokens[: (b + 1) * bs])], medium=medium, group_idx=group)
            for b in blocks
        ]


def gpu(index: PrefixIndex, tokens: list[int], engine=W0, model: str = MODEL, salt=None) -> int:
    return index.match(tokens, index.root(model, salt))[engine].gpu_tokens


def test_dense_full_attention_hit_is_prefix_run_capped_at_n_minus_1() -> None:
    index, eng, p = PrefixIndex(), Engine(), prompt(64)
    index.add_engine(W0, MODEL)
    index.apply(W0, [eng.stored(p, 0, 4, 16)])
    assert gpu(index, [*p, 7]) == 64
    assert gpu(index, p) == 48  # 64 tokens: at most 63 usable, rounded down to a block
    assert gpu(index, p[:40] + [1] * 30) == 32
    assert gpu(index, prompt(64, start=5)) == 0
    index.apply(W0, eng.removed(p, [1], 16))  # a hole breaks the chain for full attention
    assert gpu(index, [*p, 7]) == 16


def test_hybrid_swa_eviction_keeps_prefix_partly_usable() -> None:
    """Full attention keeps every block; SWA (W=32, b=16 -> 2 tail blocks) loses early ones."""
    index, eng, p = PrefixIndex(), Engine(), prompt(128)
    index.add_engine(W0, MODEL)
    # vLLM order: one BlockStored per group per step, the SWA group may come first.
    index.apply(
        W0,
        [
            eng.stored(p, 0, 8, 16, group=1, kind="sliding_window", window=32),
            eng.stored(p, 0, 8, 16, group=0),
        ],
    )
    q = [*p, 5]
    assert gpu(index, q) == 128
    index.apply(W0, eng.removed(p, [0, 1, 2, 3], 16, group=1))  # SWA-only eviction of the head
    assert gpu(index, q) == 128, "the window tail is resident: the full prefix stays usable"
    assert gpu(index, [*p[:64], 5]) == 0, "at 64 the window needs blocks 2,3: gone"
    index.apply(W0, eng.removed(p, [7], 16, group=1))  # the tail's last block goes
    # Falls back to the last point with a full window tail (blocks 5,6 -> 112); never to zero,
    # never to the unusable 128.
    assert gpu(index, q) == 112
    groups = index.match(q, index.root(MODEL))[W0].groups
    assert [(g.group_idx, g.kind, g.hit_tokens) for g in groups] == [
        (0, "full_attention", 128),
        (1, "sliding_window", 112),
    ]


def test_sparse_swa_event_resolved_through_full_attention_group_in_same_batch() -> None:
    index, eng, p = PrefixIndex(), Engine(), prompt(96)
    index.add_engine(W0, MODEL)
    # The SWA group lists only its tail blocks 4 and 5 while token_ids covers all 6 blocks.
    sparse = eng.stored(p, 0, 6, 16, group=1, kind="sliding_window", window=32, listed=[4, 5])
    index.apply(W0, [sparse, eng.stored(p, 0, 6, 16, group=0)])
    assert index.engine_stats(W0).resident == {"0/GPU": 6, "1/GPU": 2}
    assert index.engine_stats(W0).counters["unresolved_hashes"] == 0
    assert gpu(index, [*p, 1]) == 96
    assert gpu(index, [*p[:64], 1]) == 0  # blocks 2,3 were never cached in the SWA group


def test_mamba_needs_the_state_block_at_the_hit_point() -> None:
    index, eng, p = PrefixIndex(), Engine(), prompt(128)
    index.add_engine(W0, MODEL)
    index.apply(
        W0,
        [
            eng.stored(p, 0, 8, 16, group=0),
            eng.stored(p, 0, 8, 16, group=1, kind="mamba", listed=[3, 7]),
        ],
    )
    assert gpu(index, [*p, 1]) == 128
    assert gpu(index, p[:100]) == 64  # state blocks only at 64 and 128
    index.apply(W0, eng.removed(p, [7], 16, group=1))
    assert gpu(index, [*p, 1]) == 64


def test_hit_aligned_to_lcm_of_group_block_sizes() -> None:
    index, eng, p = PrefixIndex(), Engine(), prompt(96)
    index.add_engine(W0, MODEL)
    index.apply(
        W0,
        [
            eng.stored(p, 0, 6, 16, group=0),
            eng.stored(p, 0, 2, 48, group=1, kind="sliding_window", window=48),
        ],
    )
    assert gpu(index, [*p, 1]) == 96
    assert gpu(index, p[:90]) == 48  # lcm(16, 48) = 48


def test_deepseek_v4_layout_gpu_and_self_describing_cpu_share_keys() -> None:
    """256-token full-attention group (vLLM hash unit 4 inside the engine): GPU events carry one
    tail hash per 256-token block; self-describing CPU events carry the same per-block tail
    hashes for a 512-token chunk (2 hashes). Both must name the same content keys."""
    eng, p = Engine(), prompt(1536)
    for chunk, cpu_blocks, expect in ((256, [2], 256), (512, [2, 3], 512)):
        index = PrefixIndex(unit=16, cpu_chunk_tokens=chunk)
        index.add_engine(W0, MODEL)
        index.apply(W0, [eng.stored(p, 0, 2, 256)])  # GPU: tokens 0..512
        start, end = cpu_blocks[0], cpu_blocks[-1] + 1
        # The CPU chunk right after the GPU hit: parent = the hash before the chunk.
        index.apply(W0, [eng.stored(p, start, end, 256, medium="CPU")])
        # And the same blocks 0..1 offloaded too: their keys must equal the GPU ones.
        index.apply(W0, [eng.stored(p, 0, 2, 256, medium="CPU")])
        m = index.match([*p, 1], index.root(MODEL))[W0]
        assert (m.gpu_tokens, m.cpu_tokens) == (512, expect)
        k512 = chain_keys(index.root(MODEL), p[:512], 16)[-1]
        assert index.holds(W0, 0, "GPU", k512) and index.holds(W0, 0, "CPU", k512)


def test_cpu_placeholder_events_resolve_through_gpu_hashes() -> None:
    index, eng, p = PrefixIndex(cpu_chunk_tokens=256), Engine(), prompt(600)
    index.add_engine(W0, MODEL)
    index.apply(W0, [eng.stored(p, 0, 32, 16)])  # 512 tokens on GPU
    # OffloadingConnector default: one chunk-tail hash per chunk, no tokens, block_size 0.
    placeholder = BlockStored(
        [eng.h(p[:256]), eng.h(p[:512])], None, [], 0, None, "CPU", None, group_idx=0
    )
    index.apply(W0, [placeholder])
    index.apply(W0, eng.removed(p, list(range(31, -1, -1)), 16))  # GPU evicts everything
    m = index.match(p, index.root(MODEL))[W0]
    assert (m.gpu_tokens, m.cpu_tokens) == (0, 512)
    index.apply(W0, [BlockRemoved([eng.h(p[:512])], medium="CPU", group_idx=0)])
    m = index.match(p, index.root(MODEL))[W0]
    assert (m.gpu_tokens, m.cpu_tokens) == (0, 256)
    assert index.engine_stats(W0).counters["unresolved_hashes"] == 0
    # A placeholder whose hash was never seen on the GPU cannot be placed: counted, dropped.
    index.apply(W0, [BlockStored([12345], None, [], 0, None, "CPU", None, group_idx=0)])
    assert index.engine_stats(W0).counters["unresolved_hashes"] == 1


def test_cpu_extension_follows_offloading_connector_rules() -> None:
    """vLLM's OffloadingConnector loads whole chunks, contiguous from chunk gpu_hit // chunk,
    only if at least one whole chunk's worth of tokens is gained."""
    index, eng, p = PrefixIndex(cpu_chunk_tokens=256), Engine(), prompt(1100)
    index.add_engine(W0, MODEL)
    index.apply(W0, [eng.stored(p, 0, 20, 16)])  # GPU 320 tokens (mid chunk 1)
    index.apply(W0, [eng.stored(p, 16, 32, 16, medium="CPU")])  # chunk 1: 256..512
    index.apply(W0, [eng.stored(p, 48, 64, 16, medium="CPU")])  # chunk 3: not contiguous
    m = index.match(p, index.root(MODEL))[W0]
    assert (m.gpu_tokens, m.cpu_tokens) == (320, 0), "512 - 320 < one chunk: nothing loaded"
    index.apply(W0, [eng.stored(p, 32, 48, 16, medium="CPU")])  # chunk 2: now 1..3 contiguous
    m = index.match(p, index.root(MODEL))[W0]
    assert (m.gpu_tokens, m.cpu_tokens) == (320, 704)  # up to 1024 = chunk 3's end
    m = index.match(p[:1024], index.root(MODEL))[W0]
    # The whole prompt is loadable, and reported cached in full (the last token is recomputed
    # after admission, which cached_tokens does not see).
    assert (m.gpu_tokens, m.cpu_tokens) == (320, 704)
    m = index.match(p[:1000], index.root(MODEL))[W0]
    assert (m.gpu_tokens, m.cpu_tokens) == (320, 448)  # only 3 whole chunks in 1000 tokens


def test_one_engines_eviction_never_changes_another() -> None:
    index, p = PrefixIndex(), prompt(128)
    e0, e1 = Engine(), Engine()
    for w, e in ((W0, e0), (W1, e1)):
        index.add_engine(w, MODEL)
        index.apply(w, [e.stored(p, 0, 8, 16)])
    index.apply(W0, e0.removed(p, [3], 16))
    index.apply(W0, [AllBlocksCleared()])
    assert gpu(index, [*p, 1], W0) == 0
    assert gpu(index, [*p, 1], W1) == 128
    index.remove_engine(W0)
    assert gpu(index, [*p, 1], W1) == 128
    # A new engine reusing the freed slot inherits nothing.
    index.add_engine(("http://w2", 0), MODEL)
    assert gpu(index, [*p, 1], ("http://w2", 0)) == 0


def test_duplicate_stores_are_reference_counted() -> None:
    index, eng, p = PrefixIndex(), Engine(), prompt(64)
    index.add_engine(W0, MODEL)
    index.apply(W0, [eng.stored(p, 0, 2, 16)])
    # Two requests compute blocks 2-3 concurrently (vLLM does not de-duplicate).
    index.apply(W0, [eng.stored(p, 2, 4, 16), eng.stored(p, 2, 4, 16)])
    index.apply(W0, eng.removed(p, [3], 16))
    assert gpu(index, [*p, 1]) == 64, "one copy of block 3 is still cached"
    index.apply(W0, eng.removed(p, [3], 16))
    assert gpu(index, [*p, 1]) == 48
    assert index.engine_stats(W0).counters["duplicates"] == 2


def test_report_mode_full_reannounce_adds_no_reference() -> None:
    """kv_cache_report_mode=full re-sends a cache hit from token 0 (parent None)."""
    index, eng, p = PrefixIndex(), Engine(), prompt(64)
    index.add_engine(W0, MODEL)
    index.apply(W0, [eng.stored(p, 0, 4, 16)])
    index.apply(W0, [eng.stored(p, 0, 4, 16)])  # re-announce
    index.apply(W0, eng.removed(p, [3], 16))
    assert gpu(index, [*p, 1]) == 48, "no phantom copy left behind"
    assert index.engine_stats(W0).counters["reannounced"] == 1


def test_all_blocks_cleared_drops_every_medium() -> None:
    index, eng, p = PrefixIndex(), Engine(), prompt(600)
    index.add_engine(W0, MODEL)
    index.apply(W0, [eng.stored(p, 0, 32, 16), eng.stored(p, 0, 32, 16, medium="CPU")])
    assert index.resident_blocks(W0) == 64
    index.apply(W0, [AllBlocksCleared()])
    assert index.resident_blocks(W0) == 0
    m = index.match(p, index.root(MODEL))[W0]
    assert (m.gpu_tokens, m.cpu_tokens) == (0, 0)
    assert index.total_entries == 0


def test_unknown_parent_waits_for_replay_then_expires() -> None:
    index, eng, p = PrefixIndex(pending_batches=2), Engine(), prompt(96)
    index.add_engine(W0, MODEL)
    child = eng.stored(p, 2, 4, 16)
    index.apply(W0, [child])  # the parent's batch was lost
    assert index.engine_stats(W0).counters["unknown_parent"] == 1
    index.apply(W0, [eng.stored(p, 0, 2, 16)])  # replay brings it
    assert gpu(index, [*p, 1]) == 64
    assert index.engine_stats(W0).counters["pending_applied"] == 1
    # A child whose parent never comes is dropped after the bound.
    orphan = eng.stored(p, 5, 6, 16)
    index.apply(W0, [orphan])
    index.apply(W0, [])
    index.apply(W0, [])
    assert index.engine_stats(W0).counters["pending_expired"] == 1
    index.apply(W0, [eng.stored(p, 4, 5, 16)])
    assert gpu(index, [*p, 1]) == 80, "the expired orphan is not applied late"


def test_pending_event_evicted_meanwhile_is_not_applied() -> None:
    index, eng, p = PrefixIndex(), Engine(), prompt(64)
    index.add_engine(W0, MODEL)
    index.apply(W0, [eng.stored(p, 2, 4, 16)])  # parent lost
    index.apply(W0, eng.removed(p, [3], 16))  # ...and the block is evicted before replay
    index.apply(W0, [eng.stored(p, 0, 2, 16)])
    assert gpu(index, [*p, 1]) == 32, "no phantom blocks 2-3"


def test_namespaces_lora_and_cache_salt_never_share_keys() -> None:
    index, eng, p = PrefixIndex(), Engine(), prompt(64)
    index.add_engine(W0, MODEL)
    index.apply(W0, [eng.stored(p, 0, 4, 16, lora="sql-lora", extra_keys=[("sql-lora",)] * 4)])
    assert gpu(index, [*p, 1]) == 0
    assert gpu(index, [*p, 1], model="sql-lora") == 64
    eng2 = Engine()
    salted = eng2.stored(p, 0, 4, 16, extra_keys=["tenant-a", None, None, None])
    index.apply(W0, [salted])
    assert gpu(index, [*p, 1], salt="tenant-a") == 64
    assert gpu(index, [*p, 1], salt="tenant-b") == 0
    assert gpu(index, [*p, 1]) == 0


def test_multimodal_extra_keys_never_predict_a_text_hit() -> None:
    index, eng, p = PrefixIndex(), Engine(), prompt(64)
    index.add_engine(W0, MODEL)
    index.apply(W0, [eng.stored(p, 0, 4, 16, extra_keys=[None, (("img-1", 0),), None, None])])
    assert gpu(index, [*p, 1]) == 16  # the image block and everything after it are not text


def test_bytes_block_hashes_work() -> None:
    index, p = PrefixIndex(), prompt(32)
    index.add_engine(W0, MODEL)
    h0, h1 = b"\x01" * 32, b"\x02" * 32
    index.apply(W0, [BlockStored([h0, h1], None, p, 16, None, "GPU", None, group_idx=0)])
    assert gpu(index, [*p, 1]) == 32
    index.apply(W0, [BlockRemoved([h1], "GPU", 0)])
    assert gpu(index, [*p, 1]) == 16


def test_configured_groups_for_events_without_spec_kind() -> None:
    """vLLM < 0.24 sends no kv_cache_spec_kind: group facts come from configuration."""
    index, eng, p = PrefixIndex(), Engine(), prompt(128)
    index.add_engine(W0, MODEL, groups={1: GroupSpec("sliding_window", 16, 32)})
    index.apply(W0, [eng.stored(p, 0, 8, 16, kind=None), eng.stored(p, 0, 8, 16, 1, kind=None)])
    index.apply(W0, eng.removed(p, [7], 16, group=1))
    assert gpu(index, [*p, 1]) == 112


def test_unaligned_block_size_is_counted_not_guessed() -> None:
    index, eng, p = PrefixIndex(unit=16), Engine(), prompt(40)
    index.add_engine(W0, MODEL)
    index.apply(W0, [eng.stored(p, 0, 5, 8)])
    assert index.engine_stats(W0).counters["unaligned_blocks"] == 5
    assert gpu(index, [*p, 1]) == 0


def test_cap_resets_the_largest_engine_and_reports_it() -> None:
    index, p = PrefixIndex(max_entries=100), prompt(2000)
    e0, e1 = Engine(), Engine()
    index.add_engine(W0, MODEL)
    index.add_engine(W1, MODEL)
    index.apply(W1, [e1.stored(p, 0, 10, 16)])
    index.apply(W0, [e0.stored(p, 0, 95, 16)])
    assert index.total_entries <= 100
    assert index.overflowed == [W0]
    assert index.resident_blocks(W0) == 0 and index.resident_blocks(W1) == 10
    assert index.engine_stats(W0).counters["overflow_resets"] == 1


def test_dp_ranks_are_separate_engines() -> None:
    index, eng, p = PrefixIndex(), Engine(), prompt(64)
    r0, r1 = ("http://w0", 0), ("http://w0", 1)
    index.add_engine(r0, MODEL)
    index.add_engine(r1, MODEL)
    index.apply(r1, [eng.stored(p, 0, 4, 16)])
    result = index.match([*p, 1], index.root(MODEL))
    assert result[r0].gpu_tokens == 0 and result[r1].gpu_tokens == 64


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17])
def test_tiny_prompts(n: int) -> None:
    index, eng, p = PrefixIndex(), Engine(), prompt(64)
    index.add_engine(W0, MODEL)
    index.apply(W0, [eng.stored(p, 0, 4, 16)])
    assert gpu(index, p[:n]) == (16 if n == 17 else 0)


def test_sliding_window_needs_cdiv_w_minus_1_blocks() -> None:
    """W = 33, b = 16: vLLM needs cdiv(32, 16) = 2 tail blocks, not cdiv(33, 16) = 3."""
    index, eng, p = PrefixIndex(), Engine(), prompt(128)
    index.add_engine(W0, MODEL)
    index.apply(
        W0,
        [
            eng.stored(p, 0, 8, 16, group=0),
            eng.stored(p, 0, 8, 16, group=1, kind="sliding_window", window=33),
        ],
    )
    index.apply(W0, eng.removed(p, [5], 16, group=1))
    assert gpu(index, [*p, 1]) == 128  # blocks 6, 7 suffice
    index.apply(W0, eng.removed(p, [6], 16, group=1))
    assert gpu(index, [*p, 1]) == 80  # blocks 3, 4 end at 80; 96 needs 4, 5 (5 is gone)


def test_hybrid_reannounce_adds_no_phantom_sliding_window_blocks() -> None:
    """The re-announce lists every position on the SWA group, cached there or not."""
    index, eng, p = PrefixIndex(), Engine(), prompt(192)
    index.add_engine(W0, MODEL)
    swa = {"group": 1, "kind": "sliding_window", "window": 32}
    index.apply(W0, [eng.stored(p, 0, 12, 16, **swa, listed=[10, 11]), eng.stored(p, 0, 12, 16)])
    index.apply(W0, [eng.stored(p, 0, 12, 16, **swa), eng.stored(p, 0, 12, 16)])  # re-announce
    assert index.engine_stats(W0).resident == {"0/GPU": 12, "1/GPU": 2}
    assert gpu(index, [*p[:128], 1]) == 0, "blocks 6-7 were never cached in the SWA group"


def test_recompute_after_sliding_window_eviction_is_stored_and_ref_counted() -> None:
    """Window tail evicted, full attention kept: vLLM's hit is 0 so it recomputes from token 0;
    the full-attention blocks become genuine duplicates, each removed separately later."""
    index, eng, p = PrefixIndex(), Engine(), prompt(64)
    index.add_engine(W0, MODEL)
    swa = {"group": 1, "kind": "sliding_window", "window": 32}
    index.apply(W0, [eng.stored(p, 0, 4, 16, **swa), eng.stored(p, 0, 4, 16)])
    index.apply(W0, eng.removed(p, [3, 2, 1, 0], 16, group=1))
    assert gpu(index, [*p, 1]) == 0
    index.apply(W0, [eng.stored(p, 0, 4, 16, **swa), eng.stored(p, 0, 4, 16)])  # recompute
    assert gpu(index, [*p, 1]) == 64
    assert index.engine_stats(W0).counters["reannounced"] == 0
    index.apply(W0, eng.removed(p, [3], 16, group=0))  # one of the two full-attention copies
    assert gpu(index, [*p, 1]) == 64


@pytest.mark.parametrize("gone", ["cleared", "evicted"])
def test_a_hybrid_prompt_stored_again_after_its_blocks_went_is_not_a_reannounce(gone: str) -> None:
    """vLLM announces a reset at the head of its next step's batch, and an eviction may share
    a batch with the prompt's recompute: the prompt stored again from token 0 after them is a
    new copy, judged on the state where it stands (it was judged on the state before the batch,
    which still held it, and dropped as a re-announce: the index then lost the prompt)."""
    index, eng, p = PrefixIndex(), Engine(), prompt(192)
    index.add_engine(W0, MODEL)
    swa = {"group": 1, "kind": "sliding_window", "window": 32}
    index.apply(W0, [eng.stored(p, 0, 12, 16, **swa, listed=[10, 11]), eng.stored(p, 0, 12, 16)])
    assert gpu(index, [*p, 1]) == 192
    if gone == "cleared":
        head = [AllBlocksCleared()]
    else:
        head = [*eng.removed(p, [11, 10], 16, group=1), *eng.removed(p, range(11, -1, -1), 16)]
    again = [eng.stored(p, 0, 12, 16, **swa, listed=[10, 11]), eng.stored(p, 0, 12, 16)]
    index.apply(W0, [*head, *again])
    assert index.engine_stats(W0).counters["reannounced"] == 0
    assert gpu(index, [*p, 1]) == 192


def test_snapshot_round_trip_restores_exact_state() -> None:
    index, eng, p = PrefixIndex(), Engine(), prompt(600)
    index.add_engine(W0, MODEL)
    swa = {"group": 1, "kind": "sliding_window", "window": 32}
    index.apply(W0, [eng.stored(p, 0, 12, 16, **swa, listed=[10, 11]), eng.stored(p, 0, 12, 16)])
    index.apply(W0, [eng.stored(p, 12, 14, 16), eng.stored(p, 12, 14, 16)])  # a duplicate
    index.apply(W0, [eng.stored(p, 0, 32, 16, medium="CPU")])
    blob = index.export_engine(W0)
    other = PrefixIndex()
    other.add_engine(W1, MODEL)
    other.import_engine(W0, blob)
    for q in ([*p, 1], p[:200], p[:180] + [3] * 20):
        assert other.match(q, other.root(MODEL))[W0] == index.match(q, index.root(MODEL))[W0]
    assert other.engine_stats(W0).resident == index.engine_stats(W0).resident

    # Events continue to apply on the imported state, duplicates included: block 13 has two
    # copies, so one removal keeps the full-attention run at 224 (the SWA tail caps the hit).
    def full_run(ix: PrefixIndex) -> int:
        return ix.match([*p, 1], ix.root(MODEL))[W0].groups[0].hit_tokens

    for ix in (index, other):
        ix.apply(W0, eng.removed(p, [13], 16))
    assert full_run(other) == full_run(index) == 224
    for ix in (index, other):
        ix.apply(W0, eng.removed(p, [13], 16))
    assert full_run(other) == full_run(index) == 208
    with pytest.raises(ValueError):
        other.import_engine(W0, b"\x00garbage")
    assert other.resident_blocks(W0) == 0


def test_one_reannounce_decision_per_step_across_block_sizes() -> None:
    """A recompute from token 0 sends one event per group; with block sizes 16 and 32 they cover
    48 and 32 tokens. Storing the full-attention event first must not make the sliding-window
    event look like a re-announced hit: its still-resident block gets a second reference."""
    index, eng, p = PrefixIndex(), Engine(), prompt(64)
    index.add_engine(W0, MODEL)
    swa = {"group": 1, "kind": "sliding_window", "window": 32}
    index.apply(W0, [eng.stored(p, 0, 4, 16), eng.stored(p, 0, 2, 32, **swa)])
    index.apply(W0, eng.removed(p, [3, 2, 1, 0], 16))  # full attention evicted, SWA kept
    index.apply(W0, [eng.stored(p, 0, 3, 16), eng.stored(p, 0, 1, 32, **swa)])  # recompute
    assert index.engine_stats(W0).counters["reannounced"] == 0
    index.apply(W0, eng.removed(p, [0], 32, group=1))  # one of block 0's two SWA copies
    assert gpu(index, [*p[:32], 7]) == 32


def test_residency_is_split_into_staggered_shards():
    """No residency dict holds more than a small share of the blocks, and the shares differ
    (about 1:2 smallest to largest), so the dicts do not all grow -- a stop of the event loop
    proportional to their size in CPython -- at the same moment. Matching is unaffected."""
    idx = PrefixIndex()
    idx.add_engine(W0, MODEL)
    eng = Engine()
    prompts = [prompt(16 * 64, start=100_000 * i) for i in range(100)]  # 6,400 blocks
    for p in prompts:
        idx.apply(W0, [eng.stored(p, 0, 64, 16)])
    sizes = sorted(n for n, _bytes in idx._residency.tables[(0, "GPU")].segment_sizes())
    assert sum(sizes) == 6400 == idx.total_entries
    assert sizes[-1] <= 0.12 * 6400
    assert 1.5 <= sizes[-1] / sizes[0] <= 2.6
    assert all(gpu(idx, p) == 16 * 63 for p in prompts)


def test_split_engine_hash_maps_change_nothing_stored_or_matched():
    """Engine hash maps are split into staggered shards (tests/test_staggered.py says why);
    16 engines storing and evicting the same hashes keep exact, separate state."""
    idx = PrefixIndex()
    engines = [(f"http://w{i}", 0) for i in range(16)]
    eng = Engine()
    p = prompt(16 * 40)
    for en in engines:
        idx.add_engine(en, MODEL)
        idx.apply(en, [eng.stored(p, 0, 40, 16)])
    assert all(len(idx._engines[en].hashes) == 40 for en in engines)
    assert all(gpu(idx, p, en) == 16 * 39 for en in engines)
    for en in engines[:8]:
        idx.apply(en, eng.removed(p, list(range(39, 19, -1)), 16))
    assert [gpu(idx, p, en) for en in engines] == [16 * 20] * 8 + [16 * 39] * 8
    assert [len(idx._engines[en].hashes) for en in engines] == [20] * 8 + [40] * 8


def test_full_run_across_many_engines_and_chunk_boundaries_matches_block_by_block() -> None:
    """One pass over the prompt serves every engine of a layout at once (a bitmask of members
    still running): holes at many positions, one per engine, give each engine exactly the run
    it holds, and no engine's hole shortens another's run."""
    bs, nblocks = 16, 300
    p = prompt(nblocks * bs)
    holes = [None, 0, 1, 7, 8, 9, 39, 40, 41, 167, 168, 299]  # None: holds every block
    engines = [(f"http://w{i}", 0) for i in range(len(holes))]
    index = PrefixIndex(unit=16)
    for e, hole in zip(engines, holes, strict=True):
        eng = Engine()
        index.add_engine(e, MODEL)
        index.apply(e, [eng.stored(p, 0, nblocks, bs)])
        if hole is not None:
            index.apply(e, eng.removed(p, [hole], bs))
    got = index.match([*p, 1], index.root(MODEL, None))
    for e, hole in zip(engines, holes, strict=True):
        want = nblocks * bs if hole is None else hole * bs
        assert got[e].gpu_tokens == want, (e, hole)
    # A prompt nobody holds: every engine at 0.
    other = index.match(prompt(nblocks * bs, start=9), index.root(MODEL, None))
    assert all(other[e].gpu_tokens == 0 for e in engines)
