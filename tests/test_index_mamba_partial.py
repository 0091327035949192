"""Hybrid mamba models in "align" mode whose hash unit (``--prefix-match-unit``) is finer than
their blocks cache *partial* blocks (``cache_partial_block``): one hash at a hash-unit boundary
inside a larger group block, with ``block_size`` the hash unit, on the mamba group and on the
full-attention group alike. The groups' block sizes are learned from full-block events only."""

from __future__ import annotations

import pytest

from indexer.index import PrefixIndex
from indexer.wire import BlockStored
from tests.test_index import MODEL, W0, Engine, gpu, prompt


def partial(eng: Engine, p: list[int], end: int, group: int, kind: str) -> BlockStored:
    """vLLM's partial entry at ``end``: one 16-token unit, its parent the hash one unit back."""
    return BlockStored(
        [eng.h(p[:end])], eng.h(p[: end - 16]), p[end - 16 : end], 16, None, "GPU", None,
        group_idx=group, kv_cache_spec_kind=kind,
    )  # fmt: skip


@pytest.mark.parametrize(("group", "kind"), [(1, "mamba"), (0, "full_attention")])
def test_a_partial_block_event_changes_no_block_size_and_no_prediction(
    group: int, kind: str
) -> None:
    index, eng, p = PrefixIndex(), Engine(), prompt(256)
    index.add_engine(W0, MODEL)
    index.apply(
        W0,
        [
            eng.stored(p, 0, 4, 64, group=0),
            eng.stored(p, 0, 4, 64, group=1, kind="mamba", listed=[1, 3]),
        ],
    )
    assert gpu(index, [*p, 1]) == 256
    partials = [partial(eng, p, end, group, kind) for end in (208, 224)]
    index.apply(W0, partials)
    groups = index.engine_stats(W0).groups
    assert (groups[0]["block_size"], groups[1]["block_size"]) == (64, 64)
    counters = index.engine_stats(W0).counters
    assert counters["partial_blocks"] == 2
    # The entry at 208 chains from the block end at 192; the one at 224 from it.
    assert (counters["partial_unplaced"], counters["unknown_parent"]) == (0, 0)
    assert gpu(index, [*p, 1]) == 256
    assert gpu(index, p[:230]) == 128, "state blocks at 128 and 256: aligned to 64"


def test_a_partial_entry_whose_parent_was_never_published_is_counted_not_kept_waiting() -> None:
    """vLLM publishes the hash one unit before a partial entry only where that is a block end
    (or another partial entry): an entry two units into a block can never be placed."""
    index, eng, p = PrefixIndex(), Engine(), prompt(256)
    index.add_engine(W0, MODEL)
    index.apply(
        W0,
        [
            eng.stored(p, 0, 3, 64, group=0),
            eng.stored(p, 0, 3, 64, group=1, kind="mamba", listed=[2]),
        ],
    )
    index.apply(W0, [partial(eng, p, 224, 1, "mamba")])
    stats = index.engine_stats(W0)
    assert stats.counters["partial_unplaced"] == 1
    assert stats.counters["unknown_parent"] == 0, "nothing waits for a parent that never comes"
    assert stats.hashes == 3, "the three blocks, one hash each in both groups"
    assert gpu(index, [*p[:224], 1]) == 192
