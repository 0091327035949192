"""EAGLE / MTP speculative decoding: vLLM drops the last matched block so that the drafter gets
the hidden state of a recomputed block, and a sliding-window group needs one more contiguous
block (``single_type_kv_cache_manager.py``, ``use_eagle``)."""

from __future__ import annotations

import msgspec

from indexer.index import PrefixIndex
from indexer.types import FULL, SLIDING, GroupSpec
from router.speculative import SpeculativeCache
from tests.test_index import MODEL, W0, W1, Engine, gpu, prompt


def _with_lookahead(ev, n_lookahead: int = 1):
    """The event as vLLM sends it with EAGLE look-ahead hashing on."""
    return msgspec.structs.replace(
        ev, lookahead_token_ids=[[7] * n_lookahead] * len(ev.block_hashes)
    )


def test_lookahead_events_mark_the_engine_eagle_and_drop_the_last_block() -> None:
    index, p = PrefixIndex(), prompt(64)
    e0, e1 = Engine(), Engine()
    index.add_engine(W0, MODEL)
    index.add_engine(W1, MODEL)
    index.apply(W0, [_with_lookahead(e0.stored(p, 0, 4, 16))])
    index.apply(W1, [e1.stored(p, 0, 4, 16)])
    assert gpu(index, [*p, 1], W0) == 48
    assert gpu(index, [*p, 1], W1) == 64
    assert gpu(index, p[:17], W0) == 0, "one matched block, dropped"


def test_configured_eagle_applies_to_every_engine() -> None:
    index, eng, p = PrefixIndex(eagle=True), Engine(), prompt(64)
    index.add_engine(W0, MODEL)
    index.apply(W0, [eng.stored(p, 0, 4, 16)])
    assert gpu(index, [*p, 1]) == 48


def test_eagle_sliding_window_needs_one_more_block() -> None:
    """Window 32, blocks of 16: cdiv(31, 16) = 2 blocks, 3 with EAGLE, then the last dropped."""
    index, eng, p = PrefixIndex(eagle=True), Engine(), prompt(128)
    index.add_engine(W0, MODEL)
    index.apply(
        W0,
        [
            eng.stored(p, 0, 8, 16, group=0, kind="sliding_window", window=32, listed=[5, 6, 7]),
            eng.stored(p, 0, 8, 16, group=1),
        ],
    )
    # Full attention: 8 blocks, minus one = 112. Sliding: blocks 5..7 (3 contiguous) end at 128
    # but the lookup stops at 112; the run 4..6 is not cached (block 4 missing): no hit there,
    # and the shorter run from block 0 is empty.
    assert gpu(index, [*p, 1]) == 0
    index.apply(
        W0, [eng.stored(p, 0, 8, 16, group=0, kind="sliding_window", window=32, listed=[4])]
    )
    # Blocks 4..6 end at 112: hit 112 - 16 = 96.
    assert gpu(index, [*p, 1]) == 96


def test_a_speculative_entry_drops_the_block_an_eagle_engine_recomputes() -> None:
    """Before an EAGLE engine's events arrive, an entry for the prompt just sent there credits
    what the index will once they have: the covered run less its last block. On a model with
    sliding-window groups EAGLE also moves the boundaries vLLM keeps blocks at: no credit."""
    index, eng, p = PrefixIndex(), Engine(), prompt(64)
    index.add_engine(W0, MODEL)
    index.apply(W0, [_with_lookahead(eng.stored(prompt(32, 5000), 0, 2, 16))])  # learns EAGLE
    keys = index.prompt_keys([*p, 1], index.root(MODEL))
    spec = SpeculativeCache(ttl_s=2.0)
    spec.record(W0, keys[:4], now=0.0, n_tokens=64, groups=index.group_specs(W0))
    credit = spec.prompt_hits([W0], keys, 65, index.unit, 0.1, index.group_specs)[W0]
    index.apply(W0, [_with_lookahead(eng.stored(p, 0, 4, 16))])
    assert credit == gpu(index, [*p, 1]) == 48
    window = (GroupSpec(FULL, 16, eagle=True), GroupSpec(SLIDING, 16, 48, eagle=True))
    assert spec.prompt_hits([W0], keys, 65, index.unit, 0.1, lambda e: window) == {W0: 0}
