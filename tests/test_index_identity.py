"""The engine hash is a block's identity: events that re-send a known hash (CPU offload of a
salted or multimodal prompt, full-report re-announces) must land on the key the engine map
already holds, and must never leave an entry that no removal or reset can reach."""

from __future__ import annotations

from indexer.index import PrefixIndex
from indexer.wire import AllBlocksCleared, BlockRemoved, BlockStored
from tests.test_index import MODEL, W0, Engine, gpu, prompt


def _cpu(index: PrefixIndex, tokens: list[int], salt: str | None = None) -> int:
    return index.match(tokens, index.root(MODEL, salt))[W0].cpu_tokens


def _offload(eng: Engine, p: list[int]) -> list[BlockStored]:
    """Self-describing CPU stores of two 256-token chunks (``extra_keys`` nil, as vLLM sends)."""
    return [eng.stored(p, 0, 16, 16, medium="CPU"), eng.stored(p, 16, 32, 16, medium="CPU")]


def _salted_with_cpu_copy() -> tuple[PrefixIndex, Engine, list[int]]:
    """A salted 512-token prompt on GPU, then offloaded in two self-describing CPU chunks.

    vLLM's CPU events carry ``extra_keys=None``: the first chunk (parent None) does not say that
    the request was salted, so keys recomputed from it would sit in the unsalted namespace."""
    index, eng, p = PrefixIndex(cpu_chunk_tokens=256), Engine(), prompt(600)
    index.add_engine(W0, MODEL)
    extras = ["tenant-a"] + [None] * 31
    index.apply(W0, [eng.stored(p, 0, 32, 16, extra_keys=extras)])
    index.apply(W0, _offload(eng, p))
    return index, eng, p


def test_cpu_copy_of_a_salted_prompt_stays_in_its_namespace() -> None:
    index, eng, p = _salted_with_cpu_copy()
    assert _cpu(index, p) == 0, "another tenant gets no CPU hit"
    assert gpu(index, p) == 0
    # GPU evicts everything: the salted tenant still loads both chunks from CPU.
    index.apply(W0, eng.removed(p, list(range(31, -1, -1)), 16))
    m = index.match(p, index.root(MODEL, "tenant-a"))[W0]
    assert (m.gpu_tokens, m.cpu_tokens) == (0, 512)
    assert _cpu(index, p) == 0
    assert index.engine_stats(W0).counters["key_mismatch"] == 16, "the first chunk only"


def test_cpu_copy_of_a_salted_prompt_is_removed_by_block_removed() -> None:
    index, eng, p = _salted_with_cpu_copy()
    index.apply(W0, eng.removed(p, list(range(31, -1, -1)), 16))
    index.apply(W0, eng.removed(p, list(range(32)), 16, medium="CPU"))
    assert index.resident_blocks(W0) == 0
    assert index.total_entries == 0
    assert index.engine_stats(W0).counters["unknown_removes"] == 0
    assert _cpu(index, p, "tenant-a") == 0 and _cpu(index, p) == 0


def test_cpu_copy_of_a_salted_prompt_is_dropped_by_all_blocks_cleared() -> None:
    index, _eng, p = _salted_with_cpu_copy()
    index.apply(W0, [AllBlocksCleared()])
    assert index.total_entries == 0
    assert _cpu(index, p) == 0 and _cpu(index, p, "tenant-a") == 0


def test_cpu_copy_of_a_multimodal_prompt_uses_the_gpu_keys() -> None:
    index, eng, p = PrefixIndex(cpu_chunk_tokens=256), Engine(), prompt(600)
    index.add_engine(W0, MODEL)
    extras: list = [None] * 32
    extras[1] = (("img-1", 0),)
    index.apply(W0, [eng.stored(p, 0, 32, 16, extra_keys=extras)])
    index.apply(W0, _offload(eng, p))
    index.apply(W0, eng.removed(p, list(range(31, -1, -1)), 16))
    assert _cpu(index, p) == 0, "the image blocks are not text: no CPU hit for a text prompt"
    assert index.engine_stats(W0).counters["key_mismatch"] == 15
    index.apply(W0, [BlockRemoved([eng.h(p[: (b + 1) * 16])], "CPU", 0) for b in range(32)])
    assert index.total_entries == 0


def test_multimodal_reannounce_is_recognised() -> None:
    """kv_cache_report_mode=full re-sends a multimodal hit from token 0 with its extras."""
    index, eng, p = PrefixIndex(), Engine(), prompt(64)
    index.add_engine(W0, MODEL)
    extras = [None, (("img-1", 0),), None, None]
    index.apply(W0, [eng.stored(p, 0, 4, 16, extra_keys=extras)])
    index.apply(W0, [eng.stored(p, 0, 4, 16, extra_keys=extras)])  # re-announce
    c = index.engine_stats(W0).counters
    assert (c["reannounced"], c["duplicates"]) == (1, 0)
    index.apply(W0, eng.removed(p, [3, 2, 1, 0], 16))
    assert index.total_entries == 0, "nothing left that no removal matches"


def test_salted_reannounce_is_recognised() -> None:
    index, eng, p = PrefixIndex(), Engine(), prompt(64)
    index.add_engine(W0, MODEL)
    extras = ["tenant-a", None, None, None]
    index.apply(W0, [eng.stored(p, 0, 4, 16, extra_keys=extras)] * 2)
    assert index.engine_stats(W0).counters["reannounced"] == 1
    index.apply(W0, eng.removed(p, [3, 2, 1, 0], 16))
    assert index.total_entries == 0


def test_event_hash_stored_again_with_other_tokens_keeps_its_first_key() -> None:
    """A hash names one block for as long as the engine holds it (64-bit collisions aside)."""
    index, eng, p = PrefixIndex(), Engine(), prompt(64)
    index.add_engine(W0, MODEL)
    index.apply(W0, [eng.stored(p, 0, 4, 16)])
    other = BlockStored([eng.h(p[:16])], None, prompt(16, 5000), 16, None, "GPU", None, group_idx=1)
    index.apply(W0, [other])
    assert index.engine_stats(W0).counters["key_mismatch"] == 1
    index.apply(W0, [BlockRemoved([eng.h(p[:16])], "GPU", 1)])
    index.apply(W0, eng.removed(p, [3, 2, 1, 0], 16))
    assert index.total_entries == 0
