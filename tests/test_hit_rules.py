"""vLLM's hit rules (indexer/hit_rules.py) driven from hand-written residency tables.

Every table here is written as ``{token boundary: engines}``: ``{32: A | B}`` says engines A and
B hold the block that ends at token 32. The prompt's content keys are stand-ins (``KEYS[i]`` is
the key at token ``(i + 1) * UNIT``); the rules only look them up.
"""

from __future__ import annotations

import pytest

from indexer.engine_state import EngineState
from indexer.hit_rules import (
    alignment,
    best_point,
    cpu_extension,
    fit_point,
    full_attention_run,
    group_accepts,
    hit_limit,
)
from indexer.matching import GroupHit, match_engines
from indexer.staggered import Table
from indexer.types import CHUNKED, CPU, FULL, GPU, MAMBA, SLIDING, GroupSpec
from indexer.u64map import U64Map

UNIT = 16
KEYS = [10_000 + i for i in range(64)]  # a 1,024-token prompt
A, B, C = 0b001, 0b010, 0b100  # engines in slots 0, 1, 2


def at(tokens: int) -> int:
    """The content key of the boundary at ``tokens``."""
    assert tokens % UNIT == 0 and tokens > 0
    return KEYS[tokens // UNIT - 1]


def table(held: dict[int, int]) -> Table:
    """A residency table from ``{token boundary: engines mask}``."""
    return U64Map((at(t), mask) for t, mask in held.items())


def accepts(spec: GroupSpec, held: dict[int, int], point: int, bit: int = A) -> bool:
    return group_accepts(spec, table(held), bit, KEYS, point, UNIT)


# ------------------------------------------------------------------ alignment and the limit


@pytest.mark.parametrize(
    ("sizes", "want"),
    [((16,), 16), ((16, 32), 32), ((16, 48), 48), ((32, 48), 96), ((64, 64, 16), 64)],
)
def test_alignment_is_the_lcm_of_block_sizes(sizes: tuple[int, ...], want: int) -> None:
    assert alignment(GroupSpec(FULL, bs) for bs in sizes) == want


@pytest.mark.parametrize(
    ("n_tokens", "n_keys", "align", "want"),
    [
        (64, 4, 16, 48),  # at most n - 1 tokens: the last one is always computed
        (65, 4, 16, 64),
        (64, 4, 32, 32),  # 63 aligned down to 32
        (97, 6, 48, 96),
        (100, 2, 16, 32),  # keys for fewer tokens than the prompt: never past them
        (1, 0, 16, 0),
        (0, 0, 16, 0),
    ],
)
def test_hit_limit(n_tokens: int, n_keys: int, align: int, want: int) -> None:
    assert hit_limit(n_tokens, n_keys, UNIT, align) == want


# ------------------------------------------------------------------ full attention


def test_full_run_is_the_unbroken_run_from_token_0_per_engine() -> None:
    res = table({16: A | B | C, 32: A | B, 48: A, 64: A | C})
    # C holds blocks 0 and 3 but not 1: its run stops at 16.
    assert full_attention_run(res, KEYS, 16, UNIT, 64, A | B | C) == {0: 64, 1: 32, 2: 16}


def test_full_run_stops_at_the_limit_and_ignores_engines_not_asked() -> None:
    res = table({16: A | B, 32: A | B, 48: A | B, 64: A | B})
    assert full_attention_run(res, KEYS, 16, UNIT, 48, A) == {0: 48}


def test_full_run_of_an_engine_holding_nothing_is_0() -> None:
    assert full_attention_run(table({}), KEYS, 16, UNIT, 64, A | B) == {0: 0, 1: 0}


def test_full_run_with_blocks_of_several_units_looks_at_block_ends_only() -> None:
    # 32-token blocks end at 32 and 64; a key at 16 or 48 is another group's business.
    res = table({16: B, 32: A | B, 48: B, 64: A})
    assert full_attention_run(res, KEYS, 32, UNIT, 96, A | B) == {0: 64, 1: 32}


def test_full_run_with_blocks_smaller_than_the_unit_is_0() -> None:
    """Such blocks are never indexed (counted as unaligned), so nobody has a run."""
    res = table({16: A})
    assert full_attention_run(res, KEYS, 8, UNIT, 64, A | B) == {0: 0, 1: 0}


def test_full_run_beyond_64_engines() -> None:
    far = 1 << 70
    res = table({16: far | A, 32: far})
    assert full_attention_run(res, KEYS, 16, UNIT, 64, far | A) == {70: 32, 0: 16}


# ------------------------------------------------------------------ group rules at one point


def test_any_group_accepts_point_0_even_holding_nothing() -> None:
    for kind in (FULL, SLIDING, MAMBA, CHUNKED):
        assert group_accepts(GroupSpec(kind, 16, 32, 64), None, A, KEYS, 0, UNIT)


def test_a_group_with_no_table_accepts_no_point_above_0() -> None:
    for kind in (FULL, SLIDING, MAMBA, CHUNKED):
        assert not group_accepts(GroupSpec(kind, 16, 32, 64), None, A, KEYS, 64, UNIT)


def test_full_attention_needs_every_block_from_0() -> None:
    spec = GroupSpec(FULL, 16)
    assert accepts(spec, {16: A, 32: A, 48: A}, 48)
    assert not accepts(spec, {16: A, 48: A, 64: A}, 64)
    assert not accepts(spec, {16: B, 32: B}, 32)  # another engine's blocks count for nothing


def test_sliding_window_needs_the_blocks_covering_w_minus_1_tokens_before_the_point() -> None:
    spec = GroupSpec(SLIDING, 16, sliding_window=32)  # cdiv(31, 16) = 2 blocks
    assert accepts(spec, {48: A, 64: A}, 64)
    assert not accepts(spec, {64: A}, 64)
    assert not accepts(spec, {32: A, 48: A}, 64)


def test_sliding_window_not_a_multiple_of_the_block_size() -> None:
    spec = GroupSpec(SLIDING, 16, sliding_window=40)  # cdiv(39, 16) = 3 blocks
    assert accepts(spec, {32: A, 48: A, 64: A}, 64)
    assert not accepts(spec, {48: A, 64: A}, 64)
    one_more = GroupSpec(SLIDING, 16, sliding_window=17)  # cdiv(16, 16) = 1 block
    assert accepts(one_more, {64: A}, 64)
    exact = GroupSpec(SLIDING, 16, sliding_window=16)  # cdiv(15, 16) = 1 block
    assert accepts(exact, {64: A}, 64)
    assert not accepts(exact, {48: A}, 64)


def test_sliding_window_accepts_a_shorter_run_from_block_0() -> None:
    spec = GroupSpec(SLIDING, 16, sliding_window=64)  # 4 blocks, but the point is at block 2
    assert accepts(spec, {16: A, 32: A}, 32)
    assert not accepts(spec, {32: A}, 32)


def test_sliding_window_without_a_size_needs_the_last_block() -> None:
    spec = GroupSpec(SLIDING, 16)
    assert accepts(spec, {64: A}, 64)
    assert not accepts(spec, {48: A}, 64)


def test_mamba_needs_only_the_state_block_ending_at_the_point() -> None:
    spec = GroupSpec(MAMBA, 16)
    assert accepts(spec, {64: A}, 64)
    assert not accepts(spec, {16: A, 32: A, 48: A}, 64)


def test_mamba_state_block_of_several_units() -> None:
    spec = GroupSpec(MAMBA, 32)
    assert accepts(spec, {64: A}, 64)
    assert not accepts(spec, {48: A}, 64)  # 48 ends no 32-token block
    assert not accepts(spec, {64: A}, 96)


def test_chunked_local_attention_needs_the_blocks_of_the_points_chunk() -> None:
    spec = GroupSpec(CHUNKED, 16, attention_chunk=32)
    # Point 48 is inside the chunk [32, 64): block 2 (ending at 48) is needed, not 0 or 1.
    assert accepts(spec, {48: A}, 48)
    assert not accepts(spec, {16: A, 32: A}, 48)


def test_chunked_local_attention_at_a_chunk_boundary_needs_nothing() -> None:
    spec = GroupSpec(CHUNKED, 16, attention_chunk=32)
    assert accepts(spec, {}, 64)  # the next chunk starts at the point: no block of it yet


def test_chunked_local_attention_of_an_unknown_chunk_needs_every_block() -> None:
    # The chunk is not in vLLM's events: until told, the group is read as full attention,
    # never accepting a point vLLM would refuse whatever the chunk.
    no_chunk = GroupSpec(CHUNKED, 16)
    assert not accepts(no_chunk, {}, 48)
    assert not accepts(no_chunk, {32: A, 48: A}, 48)
    assert accepts(no_chunk, {16: A, 32: A, 48: A}, 48)


# ------------------------------------------------------------------ points across groups


def test_best_point_walks_down_to_the_first_accepted_aligned_point() -> None:
    spec = GroupSpec(SLIDING, 16, sliding_window=32)
    res = table({16: A, 32: A})
    assert best_point(spec, res, A, KEYS, 64, 16, UNIT) == 32
    assert best_point(spec, res, A, KEYS, 70, 16, UNIT) == 32  # start aligned down first
    assert best_point(spec, res, B, KEYS, 64, 16, UNIT) == 0
    assert best_point(spec, res, A, KEYS, -16, 16, UNIT) == 0


def test_fit_point_without_other_groups_is_the_start() -> None:
    assert fit_point([], A, KEYS, 64, 16, UNIT) == (64, [])


def test_fit_point_is_the_largest_point_every_group_accepts() -> None:
    swa = (GroupSpec(SLIDING, 16, sliding_window=32), table({16: A, 32: A, 48: A}))
    mamba = (GroupSpec(MAMBA, 16), table({32: A, 64: A}))
    # Alone, the window allows 48 and mamba 64; at 48 mamba has no state block, so both move
    # down to 32, where the window's run from 0 and mamba's state block are both resident.
    assert fit_point([swa, mamba], A, KEYS, 64, 16, UNIT) == (32, [48, 64])


def test_fit_point_can_end_at_0() -> None:
    mamba = (GroupSpec(MAMBA, 16), table({48: A}))
    swa = (GroupSpec(SLIDING, 16, sliding_window=32), table({64: A}))
    assert fit_point([mamba, swa], A, KEYS, 64, 16, UNIT) == (0, [48, 0])


# ------------------------------------------------------------------ CPU extension

CHUNK = 64  # tails at 64, 128, 192, ...


def cpu(held: dict[int, int], gpu_hit: int, n_tokens: int, bit: int = A) -> int:
    return cpu_extension([table(held)], bit, KEYS, gpu_hit, n_tokens, CHUNK, UNIT)


def test_cpu_extension_covers_the_whole_chunks_of_the_request() -> None:
    held = {64: A, 128: A, 192: A, 256: A}
    assert cpu(held, 0, 200) == 192  # 200 // 64 = 3 whole chunks; the 4th is not looked up


def test_cpu_extension_reaching_the_prompt_end_counts_in_full() -> None:
    assert cpu({64: A, 128: A, 192: A}, 0, 192) == 192
    assert cpu({64: A, 128: A, 192: A}, 64, 192) == 128


def test_cpu_extension_with_a_sliding_window_group_needs_its_window_and_stops_at_n_1() -> None:
    full = [table({64: A, 128: A, 192: A})]
    window = table({128: A, 192: A})  # a 64-token window: one chunk before the load's end
    assert cpu_extension(full, A, KEYS, 0, 192, CHUNK, UNIT, [(window, 1)]) == 191
    assert cpu_extension(full, A, KEYS, 0, 200, CHUNK, UNIT, [(window, 1)]) == 192
    # The window's chunk before the end is missing: the load stops where it is held.
    sparse = table({64: A, 128: A})
    assert cpu_extension(full, A, KEYS, 0, 200, CHUNK, UNIT, [(sparse, 1)]) == 128
    assert cpu_extension(full, A, KEYS, 0, 200, CHUNK, UNIT, [(table({}), 1)]) == 0


def test_cpu_extension_is_contiguous_from_the_gpu_hits_chunk() -> None:
    assert cpu({128: A, 192: A}, 64, 200) == 128
    assert cpu({64: A, 192: A}, 64, 200) == 0  # chunk 1 missing: chunk 2 is not reachable
    assert cpu({64: A, 128: A, 192: A}, 0, 200) == 192
    assert cpu({64: A, 192: A}, 0, 200) == 64  # stops at the hole


def test_cpu_extension_from_inside_a_chunk_counts_from_the_gpu_hit() -> None:
    # GPU hit 80 is inside chunk 1 [64, 128): the lookup starts there and loads up to 192.
    assert cpu({128: A, 192: A}, 80, 200) == 112


def test_cpu_extension_needs_at_least_one_whole_chunk() -> None:
    assert cpu({128: A}, 80, 200) == 0  # 48 tokens: less than a chunk, nothing is loaded
    assert cpu({64: A, 128: A, 192: A}, 144, 200) == 0  # 192 - 144 < 64 before any lookup


def test_cpu_extension_needs_the_chunk_in_every_group() -> None:
    tables = [table({64: A, 128: A}), table({64: A})]
    assert cpu_extension(tables, A, KEYS, 0, 200, CHUNK, UNIT) == 64
    assert cpu_extension([table({64: A}), None], A, KEYS, 0, 200, CHUNK, UNIT) == 0


def test_cpu_extension_of_another_engine_or_past_the_keys_is_0() -> None:
    assert cpu({64: B, 128: B}, 0, 200) == 0
    short = KEYS[: 128 // UNIT]  # keys for 128 tokens of a 200-token prompt
    got = cpu_extension([table({64: A, 128: A, 192: A})], A, short, 0, 200, CHUNK, UNIT)
    assert got == 128


# ------------------------------------------------------------------ all rules together


def test_match_engines_composes_full_attention_window_alignment_and_cpu() -> None:
    """A hybrid layout (32-token full attention, 16-token window of 32): full attention runs
    to 128 for A; the window holds only the blocks ending at 80 and 96, so the largest point
    aligned to 32 both accept is 96; CPU holds chunk [64, 128) and [128, 192) on A."""
    groups = {0: GroupSpec(FULL, 32), 1: GroupSpec(SLIDING, 16, sliding_window=32)}
    a = EngineState(("http://a", 0), 0, "m", bit=A, groups=groups)
    b = EngineState(("http://b", 0), 1, "m", bit=B, groups=groups)
    tables = {
        (0, GPU): table({32: A | B, 64: A | B, 96: A, 128: A}),
        (1, GPU): table({80: A, 96: A, 64: B}),
        (0, CPU): table({64: A, 128: A, 192: A}),
        (1, CPU): table({192: A}),  # the window group's chunk at the load's end
    }
    got = match_engines(tables, [a, b], KEYS, 200, UNIT, CHUNK)
    assert got[a.engine].gpu_tokens == 96
    assert got[a.engine].cpu_tokens == 96  # chunks 1 and 2 from the hit's chunk: 192 - 96
    del tables[(1, CPU)]  # without the window's chunk vLLM loads nothing
    assert match_engines(tables, [a], KEYS, 200, UNIT, CHUNK)[a.engine].cpu_tokens == 0
    assert got[a.engine].groups == [
        GroupHit(0, FULL, 32, 128),
        GroupHit(1, SLIDING, 16, 96, 32),
    ]
    # B: full attention to 64, the window holds the block ending at 64 but not 48: only a
    # shorter run from 0 would do, so B's point is 0. Its CPU holds nothing.
    assert got[b.engine].gpu_tokens == 0
    assert got[b.engine].cpu_tokens == 0
