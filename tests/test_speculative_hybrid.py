"""Speculative entries and junctions on hybrid models (sliding-window or Mamba groups).

vLLM, with its default ``prefix_cache_retention_interval`` of 0, keeps those groups' blocks only
at a prompt's replay boundary (``n - 1`` tokens, aligned) and at junctions (where a prompt's
full-attention hit went beyond its whole hit). A prediction made before the events arrive
credits only those points; the policy ranks a junction like the hit it becomes.
"""

from __future__ import annotations

from collections.abc import Callable

from indexer.matching import GroupHit, PrefixMatch
from router.candidates import build_candidates
from router.load import EngineLoad
from router.policy import Candidate, KvRouterPolicy, PolicyParams
from router.speculative import SpeculativeCache, junction_tokens

UNIT = 16
KEYS = list(range(1000, 1040))  # a 645-token prompt: 40 keys, 640 tokens
SIBLING = KEYS[:20] + list(range(5000, 5020))  # shares the first 320 tokens, then differs


def aligned(tokens: int) -> Callable[[str], int | None]:
    """``replay_align`` for an engine "hybrid" whose hits align to ``tokens``."""
    return {"hybrid": tokens}.get


def test_a_hybrid_engine_is_credited_whole_recorded_prompts_only():
    spec = SpeculativeCache(ttl_s=2.0)
    for e in ("dense", "hybrid"):
        spec.record(e, KEYS, now=0.0, n_tokens=645)
    reach: dict[str, int] = {}
    hits = spec.prompt_hits(["dense", "hybrid"], SIBLING, 700, UNIT, 0.5, aligned(16), reach)
    # Dense: the shared 320 tokens are cached once the first prompt is computed. Hybrid: the
    # window's blocks at 320 are not kept, vLLM computes the sibling whole; its full-attention
    # blocks are there all the same (a junction once the sibling is computed).
    assert hits == {"dense": 320, "hybrid": 0}
    assert reach == {"hybrid": 320}
    # A prompt extending the whole recorded one hits its replay boundary: 644 aligned to 16.
    longer = [*KEYS, 7000, 7001]
    assert spec.prompt_hits(["hybrid"], longer, 700, UNIT, 0.5, aligned(16)) == {"hybrid": 640}
    # Aligned to the engine's hit alignment (a 64-token Mamba block, say): 640.
    assert spec.prompt_hits(["hybrid"], longer, 700, UNIT, 0.5, aligned(64)) == {"hybrid": 640}
    assert spec.prompt_hits(["hybrid"], longer, 700, UNIT, 0.5, aligned(96)) == {"hybrid": 576}


def test_a_prompt_whose_length_is_a_whole_number_of_blocks_replays_from_its_last_block():
    spec = SpeculativeCache(ttl_s=2.0)
    spec.record("hybrid", KEYS, now=0.0, n_tokens=640)  # the replay boundary is 639 -> 624
    longer = [*KEYS, 7000]
    assert spec.prompt_hits(["hybrid"], longer, 700, UNIT, 0.1, aligned(16)) == {"hybrid": 624}
    # Another replica's record does not carry the length: the same conservative boundary.
    remote = SpeculativeCache(ttl_s=2.0)
    remote.record("hybrid", KEYS, now=0.0)
    assert remote.prompt_hits(["hybrid"], longer, 700, UNIT, 0.1, aligned(16)) == {"hybrid": 624}


def test_a_recorded_junction_is_credited_to_a_sibling_that_shares_it():
    spec = SpeculativeCache(ttl_s=2.0)
    # The first prompt's full-attention hit on the engine reached 160 tokens beyond its whole
    # hit: vLLM pins the window's blocks at 160 when it computes it.
    spec.record("hybrid", KEYS, now=0.0, n_tokens=645, junction=160, unit=UNIT)
    assert spec.prompt_hits(["hybrid"], SIBLING, 700, UNIT, 0.5, aligned(16)) == {"hybrid": 160}
    # Shorter than the junction: only the dense prefix would help, and the window is not there.
    short = [*KEYS[:5], 9000, 9001]
    assert spec.prompt_hits(["hybrid"], short, 120, UNIT, 0.5, aligned(16)) == {"hybrid": 0}


def test_boundaries_expire_and_are_withdrawn_with_their_record():
    spec = SpeculativeCache(ttl_s=2.0)
    spec.record("hybrid", KEYS, now=0.0, n_tokens=645, junction=160, unit=UNIT)
    longer = [*KEYS, 7000]
    assert spec.prompt_hits(["hybrid"], longer, 700, UNIT, 2.5, aligned(16)) == {"hybrid": 0}
    spec.record("hybrid", KEYS, now=3.0, n_tokens=645, junction=160, unit=UNIT)
    spec.withdraw("hybrid", KEYS)
    assert spec.prompt_hits(["hybrid"], SIBLING, 700, UNIT, 3.5, aligned(16)) == {"hybrid": 0}
    spec.expire(10.0)
    assert len(spec) == 0 and spec.prompt_hits(["hybrid"], longer, 700, UNIT, 10.0) == {"hybrid": 0}


def test_a_junction_is_where_one_group_alone_reaches_beyond_the_whole_hit():
    full = GroupHit(0, "full_attention", 16, 512)
    window = GroupHit(1, "sliding_window", 16, 0, 64)
    assert junction_tokens(PrefixMatch(0, 0, [full, window])) == 512
    assert (
        junction_tokens(PrefixMatch(512, 0, [full, GroupHit(1, "sliding_window", 16, 512, 64)]))
        == 0
    )
    assert junction_tokens(PrefixMatch(512, 0, [full])) == 0  # dense: the groups agree
    assert junction_tokens(None) == 0
    cands = build_candidates(
        [("a", EngineLoad()), ("b", EngineLoad()), ("c", EngineLoad())],  # type: ignore[list-item]
        {"a": PrefixMatch(0, 0, [full, window])},  # type: ignore[dict-item]
        block_size=16,
        reach={"b": 330},  # type: ignore[dict-item]
    )
    assert [c.junction_tokens for c in cands] == [512, 320, 0]


def test_a_junction_ranks_like_the_hit_it_becomes_and_costs_this_prompt_in_full():
    p = KvRouterPolicy(PolicyParams(recompute_weight=2.0, follow_on_weight=0), seed=0)
    junction = Candidate("j", load=EngineLoad(queued_prefill_tokens=300), junction_tokens=1024)  # type: ignore[arg-type]
    idle = Candidate("idle")  # type: ignore[arg-type]
    d = p.choose([idle, junction], 2000, 0.0)
    costs = {c.engine: c for c in d.costs}
    assert d.engine == "j"
    # The TTFT estimate is unchanged: this prompt computes all 2,000 tokens there.
    assert costs["j"].cost_tokens == 2000 + 300 and costs["j"].hit_tokens == 0
    assert costs["j"].junction_tokens == 1024
    assert costs["j"].rank_tokens == 2300 + 2000 - 2 * 1024
    assert costs["idle"].rank_tokens == 2000 + 2000 and costs["idle"].junction_tokens == 0
    # A junction no longer than the hit is no junction.
    held = Candidate("h", gpu_hit_tokens=1024, junction_tokens=1024)  # type: ignore[arg-type]
    assert p.cost(held, 2000).junction_tokens == 0
