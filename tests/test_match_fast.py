"""The request path's matching (indexer/matching.py ``match_engines``, C loops in
indexer/_match.c) against the rules composed plainly (``match_engines_reference``).

Random residency tables over up to 130 engines (slots past bit 64 included), random group
layouts per engine (full attention alone or with sliding-window, mamba or chunked groups,
several full-attention groups, EAGLE), CPU tables, and prompts given as lists or uint64 arrays;
the layout memo is reused across matches while engines change their groups.
"""

from __future__ import annotations

import os
import random
from array import array

import pytest

from indexer import keys as keys_module
from indexer.engine_state import EngineState
from indexer.hit_rules import full_attention_run
from indexer.keys import _chain_keys_py, chain_keys, packed_keys, tokens_to_bytes
from indexer.matching import Layouts, full_runs, match_engines, match_engines_reference
from indexer.staggered import Table, new_table
from indexer.types import CHUNKED, CPU, FULL, GPU, MAMBA, SLIDING, GroupSpec

UNIT = 16
CHUNK = 64


def random_layout(rng: random.Random) -> dict[int, GroupSpec]:
    shape = rng.choice(("full", "full", "swa", "mamba", "chunked", "two_full", "none", "only"))
    full = GroupSpec(FULL, UNIT * rng.choice((1, 1, 2, 4)))
    if shape == "full":
        return {0: full}
    if shape == "none":
        return {}
    if shape == "two_full":
        return {0: full, 2: GroupSpec(FULL, UNIT * rng.choice((1, 2)))}
    if shape == "only":  # no full-attention group: the others' rules and CPU tables alone
        return {1: GroupSpec(SLIDING, UNIT, rng.choice((16, 40, 64)))}
    bs = UNIT * rng.choice((1, 2))
    other = {
        "swa": GroupSpec(SLIDING, bs, rng.choice((None, 16, 33, 64, 200))),
        "mamba": GroupSpec(MAMBA, bs),
        "chunked": GroupSpec(CHUNKED, bs, None, rng.choice((32, 64, 128))),
    }[shape]
    # The other group's index before or after full attention's: explanations are by index.
    return {0: other, 1: full} if rng.random() < 0.5 else {0: full, 1: other}


def random_table(rng: random.Random, keys: list[int], slots: list[int]) -> Table:
    """Each engine holds a prefix of the keys with a few holes; masks carry bits of engines
    outside the match too (slot 140)."""
    table = new_table()
    cuts = {s: rng.randrange(len(keys) + 1) for s in slots}
    for i, k in enumerate(keys):
        mask = 1 << 140 if rng.random() < 0.3 else 0
        for s in slots:
            if i < cuts[s] and rng.random() > 0.03:
                mask |= 1 << s
        if mask:
            table[k] = mask
    return table


def random_case(
    rng: random.Random,
) -> tuple[dict[tuple[int, str], Table], list[EngineState], list[int]]:
    n_keys = rng.randrange(0, 80)
    keys = [rng.getrandbits(64) for _ in range(n_keys)]
    n_engines = rng.choice((1, 3, 20, 64, 65, 130))
    slots = rng.sample(range(135), n_engines)
    layouts = [random_layout(rng) for _ in range(rng.choice((1, 2, 3)))]
    engines = [
        EngineState(
            (f"http://w{s}", 0),
            s,
            "m",
            bit=1 << s,
            groups=dict(rng.choice(layouts)),
            eagle=rng.random() < 0.2,
        )
        for s in slots
    ]
    tables: dict[tuple[int, str], Table] = {}
    for g in (0, 1, 2):
        for medium in (GPU, CPU):
            if rng.random() < (0.9 if medium == GPU else 0.5):
                tables[(g, medium)] = random_table(rng, keys, slots)
    return tables, engines, keys


@pytest.mark.parametrize("seed", range(60))
def test_request_path_matches_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    tables, engines, keys = random_case(rng)
    layouts = Layouts()
    for _ in range(4):
        n_tokens = rng.choice((len(keys) * UNIT, len(keys) * UNIT + rng.randrange(1, 40), 1))
        chosen = rng.sample(engines, rng.randrange(len(engines) + 1))
        want = match_engines_reference(tables, chosen, keys, n_tokens, UNIT, CHUNK)
        for ks in (keys, array("Q", keys)):
            got = match_engines(tables, chosen, ks, n_tokens, UNIT, CHUNK, layouts)
            assert got == want
        # An engine learns another layout (in place, as ingest does): the memo notices.
        e = rng.choice(engines)
        e.groups[rng.choice((0, 1, 3))] = GroupSpec(rng.choice((FULL, SLIDING)), UNIT)
        if rng.random() < 0.3:
            e.eagle = not e.eagle


def test_full_runs_equal_full_attention_run_past_64_engines() -> None:
    rng = random.Random(5)
    keys = [rng.getrandbits(64) for _ in range(50)]
    slots = [0, 3, 63, 64, 65, 100, 127]
    res = random_table(rng, keys, slots)
    alive = sum(1 << s for s in slots)
    for bs in (8, 16, 32, 48):
        for limit in (0, 16, 400, 800, 2000):
            for ks in (keys, array("Q", keys), tuple(keys), keys[:7]):
                want = full_attention_run(res, ks, bs, UNIT, limit, alive)
                got = full_runs(res, ks, bs, UNIT, limit, alive)
                assert {s: got[s] for s in slots} == want


def test_keys_from_a_token_list_equal_keys_from_its_bytes() -> None:
    rng = random.Random(3)
    for n in (0, 15, 16, 17, 1000):
        tokens = [rng.randrange(2**32) for _ in range(n)]
        for unit in (1, 16, 48, 10**20):
            for limit in (None, 0, 5, 10**20):
                want = _chain_keys_py(9, tokens_to_bytes(tokens), unit, limit)
                assert chain_keys(9, tokens, unit, limit) == want
                assert chain_keys(9, tuple(tokens), unit, limit) == want
        assert list(packed_keys(9, tokens, 16)) == _chain_keys_py(
            9, tokens_to_bytes(tokens), 16, None
        )


@pytest.mark.parametrize("bad", [[1, -1], [2**32], [1, 2.5], [1, "a"]])
def test_keys_from_a_token_list_refuse_what_tokens_to_bytes_refuses(bad: list[object]) -> None:
    with pytest.raises((ValueError, TypeError)) as want:
        tokens_to_bytes(bad)  # type: ignore[arg-type]
    with pytest.raises(want.type):
        chain_keys(1, bad)  # type: ignore[arg-type]
    with pytest.raises(want.type):
        packed_keys(1, bad)  # type: ignore[arg-type]


def test_keys_from_a_long_token_list_equal_keys_from_its_bytes() -> None:
    # Longer than the C loop's packing chunk (4,096 ids): units that divide it, that do not,
    # and that are longer than it.
    rng = random.Random(5)
    tokens = [rng.randrange(2**32) for _ in range(3 * 4096 + 37)]
    data = tokens_to_bytes(tokens)
    for unit in (1, 3, 16, 4095, 4097, 5000):
        for limit in (None, 2, 300):
            want = _chain_keys_py(11, data, unit, limit)
            assert chain_keys(11, tokens, unit, limit) == want
        assert list(packed_keys(11, tokens, unit)) == _chain_keys_py(11, data, unit, None)


@pytest.mark.parametrize("bad", [-1, 2**32, 2.5, "a"])
def test_a_bad_token_past_the_first_chunk_and_the_limit_is_refused(bad: object) -> None:
    tokens: list[object] = [7] * 9000
    tokens[8999] = bad
    with pytest.raises((ValueError, TypeError)) as want:
        tokens_to_bytes(tokens)  # type: ignore[arg-type]
    with pytest.raises(want.type):
        chain_keys(1, tokens, 16, 1)  # type: ignore[arg-type]
    with pytest.raises(want.type):
        packed_keys(1, tokens)  # type: ignore[arg-type]
    # The tokens are checked before the unit, as tokens_to_bytes comes first.
    with pytest.raises(want.type):
        chain_keys(1, tokens, 0)  # type: ignore[arg-type]


def test_c_match_path_is_built_when_native_is_required() -> None:
    if os.environ.get("KVROUTER_REQUIRE_NATIVE") == "1":
        assert keys_module._match is not None, "KVROUTER_REQUIRE_NATIVE=1: build the extension"
