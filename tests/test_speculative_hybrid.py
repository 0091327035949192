"""Speculative entries and junctions on hybrid models (sliding-window or Mamba groups).

vLLM, with its default ``prefix_cache_retention_interval`` of 0, keeps those groups' blocks only
at a prompt's replay boundary (``n - 1`` tokens, aligned) and at junctions (where a prompt's
full-attention hit went beyond its whole hit). A prediction made before the events arrive
credits only those points; the policy ranks a junction like the hit it becomes.
"""

from __future__ import annotations

from collections.abc import Callable

from indexer.matching import GroupHit, PrefixMatch
from indexer.types import FULL, MAMBA, SLIDING, GroupSpec
from router.candidates import build_candidates
from router.load import EngineLoad
from router.policy import Candidate, KvRouterPolicy, PolicyParams
from router.speculative import SpeculativeCache, extension_credit, junction_tokens, retained_hit

UNIT = 16
KEYS = list(range(1000, 1040))  # a 645-token prompt: 40 keys, 640 tokens
SIBLING = KEYS[:20] + list(range(5000, 5020))  # shares the first 320 tokens, then differs


FULL16 = GroupSpec(FULL, 16)
WINDOW64 = GroupSpec(SLIDING, 16, sliding_window=64)  # a hit needs the 4 blocks ending at it


def layout(*specs: GroupSpec) -> Callable[[str], tuple[GroupSpec, ...]]:
    """``groups`` for an engine "hybrid" with ``specs`` (full attention and a 64-token window
    by default); every other engine's groups are unknown."""
    specs = specs or (FULL16, WINDOW64)
    return lambda e: specs if e == "hybrid" else ()


def aligned(tokens: int) -> Callable[[str], tuple[GroupSpec, ...]]:
    """An engine "hybrid" of full attention and a Mamba group of ``tokens``-token blocks."""
    return layout(FULL16, GroupSpec(MAMBA, tokens))


def test_a_hybrid_engine_is_credited_whole_recorded_prompts_only():
    spec = SpeculativeCache(ttl_s=2.0)
    for e in ("dense", "hybrid"):
        spec.record(e, KEYS, now=0.0, n_tokens=645)
    reach: dict[str, int] = {}
    hits = spec.prompt_hits(["dense", "hybrid"], SIBLING, 700, UNIT, 0.5, layout(), reach)
    # Dense: the shared 320 tokens are cached once the first prompt is computed. Hybrid: the
    # window's blocks at 320 are not kept, vLLM computes the sibling whole; its full-attention
    # blocks are there all the same (a junction once the sibling is computed).
    assert hits == {"dense": 320, "hybrid": 0}
    assert reach == {"hybrid": 320}
    # A prompt extending the whole recorded one hits its replay boundary: 644 aligned to 16.
    longer = [*KEYS, 7000, 7001]
    assert spec.prompt_hits(["hybrid"], longer, 700, UNIT, 0.5, layout()) == {"hybrid": 640}
    # Aligned to the engine's hit alignment (a 64-token Mamba block, say): 640.
    assert spec.prompt_hits(["hybrid"], longer, 700, UNIT, 0.5, aligned(64)) == {"hybrid": 640}
    assert spec.prompt_hits(["hybrid"], longer, 700, UNIT, 0.5, aligned(96)) == {"hybrid": 576}


def test_a_prompt_whose_length_is_a_whole_number_of_blocks_replays_from_its_last_block():
    spec = SpeculativeCache(ttl_s=2.0)
    spec.record("hybrid", KEYS, now=0.0, n_tokens=640)  # the replay boundary is 639 -> 624
    longer = [*KEYS, 7000]
    assert spec.prompt_hits(["hybrid"], longer, 700, UNIT, 0.1, layout()) == {"hybrid": 624}
    # Another replica's record does not carry the length: the same conservative boundary.
    remote = SpeculativeCache(ttl_s=2.0)
    remote.record("hybrid", KEYS, now=0.0)
    assert remote.prompt_hits(["hybrid"], longer, 700, UNIT, 0.1, layout()) == {"hybrid": 624}


def test_a_recorded_junction_is_credited_to_a_sibling_that_shares_it():
    spec = SpeculativeCache(ttl_s=2.0)
    # The first prompt's full-attention hit on the engine reached 160 tokens beyond its whole
    # hit: vLLM pins the window's blocks at 160 when it computes it.
    spec.record("hybrid", KEYS, now=0.0, n_tokens=645, junction=160, unit=UNIT)
    assert spec.prompt_hits(["hybrid"], SIBLING, 700, UNIT, 0.5, layout()) == {"hybrid": 160}
    # Shorter than the junction: only the dense prefix would help, and the window is not there.
    short = [*KEYS[:5], 9000, 9001]
    assert spec.prompt_hits(["hybrid"], short, 120, UNIT, 0.5, layout()) == {"hybrid": 0}


def test_boundaries_expire_and_are_withdrawn_with_their_record():
    spec = SpeculativeCache(ttl_s=2.0)
    spec.record("hybrid", KEYS, now=0.0, n_tokens=645, junction=160, unit=UNIT)
    longer = [*KEYS, 7000]
    assert spec.prompt_hits(["hybrid"], longer, 700, UNIT, 2.5, layout()) == {"hybrid": 0}
    spec.record("hybrid", KEYS, now=3.0, n_tokens=645, junction=160, unit=UNIT)
    spec.withdraw("hybrid", KEYS)
    assert spec.prompt_hits(["hybrid"], SIBLING, 700, UNIT, 3.5, layout()) == {"hybrid": 0}
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


def test_credit_is_a_multiple_of_the_block_the_engine_declared():
    """An engine whose events declared 32-token blocks caches whole 32-token blocks: a sibling
    sharing 240 tokens (15 keys of 16) hits 224 there. Before its events, the groups are
    unknown and the credit is left to the configured block size (build_candidates)."""
    spec = SpeculativeCache(ttl_s=2.0)
    spec.record("dense", KEYS, now=0.0, n_tokens=645)
    sibling = KEYS[:15] + list(range(6000, 6010))
    dense32 = lambda e: (GroupSpec(FULL, 32),)  # noqa: E731
    assert spec.prompt_hits(["dense"], sibling, 400, UNIT, 0.5, dense32) == {"dense": 224}
    assert spec.prompt_hits(["dense"], sibling, 400, UNIT, 0.5, lambda e: ()) == {"dense": 240}


def test_a_point_below_a_boundary_is_no_hit_where_the_groups_keep_only_the_boundary():
    """The first 640 tokens of a 645-token prompt again: the hit may end at 624 at most (the
    last token is computed). vLLM kept exactly the blocks a hit at 640 needs; a hit at 624
    needs the Mamba state ending at 624, or a window's blocks ending there, one of which lies
    below what was kept. Full attention alone keeps every block."""
    spec = SpeculativeCache(ttl_s=2.0)
    spec.record("hybrid", KEYS, now=0.0, n_tokens=645)

    def hit(*specs: GroupSpec) -> int:
        return spec.prompt_hits(["hybrid"], KEYS, 640, UNIT, 0.5, layout(*specs))["hybrid"]

    assert hit(FULL16, GroupSpec(MAMBA, 16)) == 0
    assert hit(FULL16, GroupSpec(SLIDING, 16, sliding_window=32)) == 0
    assert hit(FULL16, WINDOW64) == 0
    assert hit(FULL16) == 624


def test_blocks_kept_at_two_boundaries_combine():
    """A junction at 160 and the replay boundary of a prompt of 197 tokens (192): a 64-token
    window keeps the 4 blocks ending at each, 112-160 and 144-192, so a hit may end at 176
    too: the 4 blocks ending there (128-176) are all kept."""
    both = {160: 160, 192: 192}
    assert retained_hit([WINDOW64], both, 176, 16) == 176
    assert retained_hit([WINDOW64], both, 191, 16) == 176
    assert retained_hit([WINDOW64], {192: 192}, 176, 16) == 0
    assert retained_hit([WINDOW64, GroupSpec(MAMBA, 16)], both, 176, 16) == 160
    assert retained_hit([WINDOW64], {48: 48}, 48, 16) == 48  # a run from token 0 is enough
    assert retained_hit([WINDOW64], {}, 640, 16) == 0
    # A boundary whose prompt this one shares only up to 176: the blocks it kept above 176
    # are another prompt's.
    assert retained_hit([WINDOW64], {160: 160, 208: 176}, 208, 16) == 176
    assert retained_hit([WINDOW64], {208: 176}, 208, 16) == 0


def test_the_blocks_two_recorded_prompts_kept_combine_into_a_hit():
    """A model of one 64-token window over 32-token blocks (a hit reads the 2 blocks ending at
    it), as a real vLLM served it: a 320-token prompt keeps the blocks ending at 256 and 288
    (its replay boundary, 319 aligned); its extension to 370 tokens keeps those ending at 320
    and 352. A third prompt sharing only the first 320 tokens hits 320: the block ending at
    288 from the first, the one ending at 320 from the extension."""
    window = (GroupSpec(SLIDING, 32, sliding_window=64),)
    first = list(range(100, 120))  # 20 keys of 16 tokens
    extension = [*first, 7000, 7001, 7002]
    third = [*first, 8000, 8001]
    spec = SpeculativeCache(ttl_s=2.0)
    spec.record("w", first, now=0.0, n_tokens=320, groups=window)
    assert spec.prompt_hits(["w"], third, 360, UNIT, 0.1, lambda e: window) == {"w": 288}
    spec.record("w", extension, now=0.2, n_tokens=370, groups=window)
    assert spec.prompt_hits(["w"], third, 360, UNIT, 0.3, lambda e: window) == {"w": 320}
    # Without the groups at record time (another replica's record), only the boundaries.
    remote = SpeculativeCache(ttl_s=2.0)
    remote.record("w", first, now=0.0, n_tokens=320)
    remote.record("w", extension, now=0.2, n_tokens=370)
    assert remote.prompt_hits(["w"], third, 360, UNIT, 0.3, lambda e: window) == {"w": 288}


def test_a_session_turn_extending_the_last_one_is_credited_its_kept_blocks():
    """What a conversation's next turn is credited on the engine its session is bound to
    (the last turn's length is known, its events may not have arrived): the last turn's whole
    blocks on a dense engine, its replay boundary where sparse groups keep only that."""
    hybrid = (FULL16, WINDOW64)
    assert extension_credit((FULL16,), 320, 400) == 320
    assert extension_credit(hybrid, 320, 400) == 304  # 319, aligned
    assert extension_credit(hybrid, 330, 400) == 320  # 329, aligned
    assert extension_credit((FULL16, GroupSpec(MAMBA, 64)), 330, 400) == 320
    assert extension_credit((), 330, 400) == 330  # groups unknown: the caller floors it
    assert extension_credit(hybrid, 330, 300) == 0  # shorter than the boundary: nothing kept
    assert extension_credit((GroupSpec(FULL, 16, eagle=True),), 330, 400) == 304


def test_credit_follows_the_retention_interval_the_workers_run_with():
    """``--prefix-cache-retention-interval``: null keeps every block (a sibling sharing 320
    tokens hits them all); 128 also keeps the blocks a hit at every 128 tokens needs (the
    sibling hits 256); an interval no longer than the window's run keeps every block too."""
    sibling_n = 700
    for retention, expected in ((None, 320), (128, 256), (64, 320), (0, 0)):
        spec = SpeculativeCache(ttl_s=2.0)
        spec.retention = retention
        spec.record("hybrid", KEYS, now=0.0, n_tokens=645, groups=(FULL16, WINDOW64))
        got = spec.prompt_hits(["hybrid"], SIBLING, sibling_n, UNIT, 0.5, layout())
        assert got == {"hybrid": expected}, retention
        assert extension_credit((FULL16, WINDOW64), 320, 400, retention) == (
            320 if retention in (None, 64) else 304
        ), retention
