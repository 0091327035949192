"""Hybrid mamba models in "align" mode may cache *partial* blocks (``cache_partial_block``):
one hash at a hash-unit boundary inside a larger group block, with ``block_size`` the hash unit.
The group's block size is learned from full-block events only."""

from __future__ import annotations

from indexer.index import PrefixIndex
from indexer.wire import BlockStored
from tests.test_index import MODEL, W0, Engine, gpu, prompt


def test_partial_block_event_does_not_change_the_mamba_block_size() -> None:
    index, eng, p = PrefixIndex(), Engine(), prompt(256)
    index.add_engine(W0, MODEL)
    index.apply(
        W0,
        [
            eng.stored(p, 0, 16, 16, group=0),
            eng.stored(p, 0, 4, 64, group=1, kind="mamba", listed=[1, 3]),
        ],
    )
    assert gpu(index, [*p, 1]) == 256
    partial = BlockStored(
        [eng.h(p[:208])], eng.h(p[:192]), p[192:208], 16, None, "GPU", None,
        group_idx=1, kv_cache_spec_kind="mamba",
    )  # fmt: skip
    index.apply(W0, [partial])
    assert index.engine_stats(W0).groups[1]["block_size"] == 64
    assert gpu(index, [*p, 1]) == 256
    assert gpu(index, p[:200]) == 128, "state blocks at 128 and 256: aligned to 64"
