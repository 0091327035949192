"""Prefix popularity and the credit for a new holder of a popular prefix.

Pure parts first (router/popularity.py, ``KvRouterPolicy.new_holder_credit``), then the router
over real HTTP in front of simulated workers, where ``/debug/route`` shows the credit.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from test_router_support import FAST, cand, config_for, serve_router, until, words

from router.policy import UTILIZATION_DECISIONS, Candidate, KvRouterPolicy, PolicyParams
from router.popularity import PrefixPopularity, PromptKeys
from router.speculative import SAMPLE_STRIDE
from simulator.testing import running_fleet

KEY_TOKENS = 16


def prompt(prefix: int, n_prefix: int, own: int, n_own: int = 8) -> list[int]:
    """Chained keys of a prompt: ``n_prefix`` keys of a shared prefix, then its own."""
    return [prefix * 10**6 + i for i in range(n_prefix)] + [own * 10**6 + i for i in range(n_own)]


# ------------------------------------------------------------------------------- measurement


def expected_share(shared: list[bool], window: float) -> float:
    """The share ``PrefixPopularity`` reports after requests that did (True) or did not open
    with the prefix: decayed counts, the count taken one Poisson standard error low."""
    n = len(shared)
    weights = [math.exp(-(n - 1 - j) / window) for j in range(n)]
    k = sum(w for w, s in zip(weights, shared, strict=True) if s)
    return max(k - math.sqrt(k), 0.0) / sum(weights)


def test_share_is_the_fraction_of_recent_requests_that_began_with_the_prefix():
    pop = PrefixPopularity(window=UTILIZATION_DECISIONS)
    for i in range(300):  # every third request starts with prefix 1, the rest with their own
        pop.count(prompt(1, 40, 1000 + i) if i % 3 == 0 else prompt(2000 + i, 40, 3000 + i))
    keys = prompt(1, 40, 9999)
    at, share = pop.share(keys, 40)
    assert at == 32  # the deepest sampled key inside the 40-key prefix
    assert share == pytest.approx(expected_share([i % 3 == 0 for i in range(300)], 256))
    assert 0.28 < share < 1 / 3  # a third of the requests, less one standard error
    assert pop.share(keys, 35) == (32, share)  # any depth with the same sampled key
    assert pop.share(keys, SAMPLE_STRIDE - 1) == (0, 0.0)  # no sampled key inside: unmeasured
    assert pop.share(prompt(5, 40, 5), 40) == (32, 0.0)  # never seen


def test_one_request_is_no_evidence_and_the_share_fades_with_the_window():
    pop = PrefixPopularity(window=100)
    assert pop.share(prompt(1, 16, 0), 16) == (0, 0.0)  # nothing counted yet
    pop.count(prompt(1, 16, 0))
    assert pop.share(prompt(1, 16, 1), 16) == (16, 0.0)  # one request of one: 1 - sqrt(1)
    history = [True]
    for _ in range(9):
        pop.count(prompt(1, 16, 0))
        history.append(True)
    assert pop.share(prompt(1, 16, 1), 16)[1] == pytest.approx(expected_share(history, 100))
    assert pop.share(prompt(1, 16, 1), 16)[1] == pytest.approx(1 - 1 / math.sqrt(10), abs=0.01)
    for i in range(300):  # three windows without it
        pop.count(prompt(3, 16, i))
    assert pop.share(prompt(1, 16, 1), 16)[1] < 0.01


def test_counts_stay_exact_across_a_rebase_of_the_stored_sums():
    pop = PrefixPopularity(window=1)  # the scale grows by e per request: rebased every ~345
    history = []
    for i in range(1000):
        shared = i % 2 == 0
        pop.count(prompt(1, 16, i) if shared else prompt(2, 16, i))
        history.append(shared)
    assert pop.share(prompt(1, 16, 0), 16)[1] == pytest.approx(expected_share(history, 1))
    others = [not x for x in history]
    assert pop.share(prompt(2, 16, 0), 16)[1] == pytest.approx(expected_share(others, 1))


def test_count_returns_what_one_cache_of_every_earlier_prompt_would_hit():
    pop = PrefixPopularity(window=64)
    head = list(range(4 * SAMPLE_STRIDE))
    assert pop.count(head) == 0
    assert pop.count(head) == 4 * SAMPLE_STRIDE
    # the same head, then a new tail: hit up to the last sampled key they share
    other = head[: 2 * SAMPLE_STRIDE] + [10**6 + k for k in range(2 * SAMPLE_STRIDE)]
    assert pop.count(other) == 2 * SAMPLE_STRIDE
    assert pop.count(head[: SAMPLE_STRIDE - 1]) == 0  # shorter than a sample
    # a key seen only after a gap does not extend the prefix
    gap = [10**7 + k for k in range(SAMPLE_STRIDE)] + head[SAMPLE_STRIDE:]
    assert pop.count(gap) == 0


def test_shares_are_of_the_pools_own_requests():
    """A system prompt every request of model A opens with is all of A's traffic, though A
    brings a quarter of the router's requests: the share is counted against A's requests."""
    pop = PrefixPopularity(window=UTILIZATION_DECISIONS)
    history = []
    for i in range(200):
        if i % 4 == 0:
            pop.count(prompt(1, 16, i), pool="model-a")
            history.append(True)
        else:
            pop.count(prompt(1000 + i, 16, i), pool="model-b")
    k = sum(math.exp(-(199 - i) / 256) for i in range(0, 200, 4))
    assert pop.share(prompt(1, 16, 0), 16, "model-a")[1] == pytest.approx((k - math.sqrt(k)) / k)
    assert pop.share(prompt(1, 16, 0), 16, "model-a")[1] > 0.8
    assert pop.share(prompt(1, 16, 0), 16, "unknown") == (0, 0.0)  # no request of that pool


def test_the_table_is_bounded_and_forgets_the_least_recently_seen_first():
    pop = PrefixPopularity(window=256, max_prefixes=4)
    for p in (1, 2, 3, 4):
        for _ in range(3):
            pop.count(prompt(p, 16, 0))
    pop.count(prompt(1, 16, 1))  # seen again: most recent
    pop.count(prompt(5, 16, 0))  # evicts 2, the least recently seen
    assert len(pop) == 4
    assert pop.share(prompt(2, 16, 9), 16)[1] == 0.0
    assert pop.share(prompt(3, 16, 9), 16)[1] > 0.0
    assert pop.share(prompt(1, 16, 9), 16)[1] > 0.0
    with pytest.raises(ValueError):
        PrefixPopularity(window=0)
    pools = PrefixPopularity(window=256, max_pools=2)
    for pool in ("a", "b", "c"):  # "a" forgotten: its share reads 0 until it is counted again
        pools.count(prompt(1, 16, 0), pool)
    assert pools.share(prompt(1, 16, 0), 16, "a") == (0, 0.0)
    assert pools.share(prompt(1, 16, 0), 16, "c")[1] > 0.0


# -------------------------------------------------------------------------------- the credit


ENGINES = [f"e{i}" for i in range(8)]
SYSTEM = 64  # keys: a 1,024-token system prompt


def warmed(share_every: int, holders: int, weight: float = 1.0) -> KvRouterPolicy:
    """A policy that has routed 200 requests, every ``share_every``-th one opening with the
    system prompt, whose holders are the first ``holders`` engines."""
    params = PolicyParams(near_tie_tokens=0, recompute_weight=2.0, new_holder_weight=weight)
    p = KvRouterPolicy(params, seed=0)
    for i in range(200):
        keys = prompt(1, SYSTEM, i) if i % share_every == 0 else prompt(1000 + i, SYSTEM, i)
        held = SYSTEM * KEY_TOKENS if i % share_every == 0 else 0
        cands = [cand(e, held if j < holders else 0) for j, e in enumerate(ENGINES)]
        p.choose(cands, len(keys) * KEY_TOKENS, i * 0.1, prompt=PromptKeys(keys, KEY_TOKENS))
    return p


def new_session(holders: int, queued: int) -> list[Candidate]:
    """A new session's first turn: the system prompt cached on the holders, queued there."""
    held = SYSTEM * KEY_TOKENS
    return [
        cand(e, held, queued_prefill_tokens=queued) if j < holders else cand(e)
        for j, e in enumerate(ENGINES)
    ]


def test_a_copy_of_a_prefix_half_the_traffic_shares_ranks_partly_like_a_hit():
    """Half the requests open with a system prompt one of eight engines holds: an even spread
    needs four holders, so one more is worth about 1 - 1 / (8 * 0.5) = 3/4 of a hit (the share
    measured one standard error low). With the holder 2,000 tokens deep, the new session goes
    elsewhere; without the credit it queues there."""
    keys = prompt(1, SYSTEM, 777)
    n = len(keys) * KEY_TOKENS
    p = warmed(share_every=2, holders=1)
    _, share = p.popularity.share(keys, SYSTEM)
    assert share == pytest.approx(expected_share([i % 2 == 0 for i in range(200)], 256))
    assert 0.4 < share < 0.5
    d = p.choose(new_session(1, 2000), n, 30.0, prompt=PromptKeys(keys, KEY_TOKENS))
    worth = 1 - 1 / (8 * share)
    credited = {c.engine: c.new_holder_tokens for c in d.costs}
    assert credited["e0"] == 0.0
    assert all(credited[e] == pytest.approx(worth * SYSTEM * KEY_TOKENS) for e in ENGINES[1:])
    other = next(c for c in d.costs if c.engine == "e1")
    assert other.rank_tokens == pytest.approx(
        other.cost_tokens + (2.0 - 1) * other.uncached_tokens - 2.0 * other.new_holder_tokens
    )
    assert other.cost_tokens == n  # the request still computes the whole prompt there
    assert d.engine != "e0"  # 2,000 + 128 * 2 against 1,152 * 2 - about 700 * 2
    off = warmed(share_every=2, holders=1, weight=0.0)
    d = off.choose(new_session(1, 2000), n, 30.0, prompt=PromptKeys(keys, KEY_TOKENS))
    assert d.engine == "e0" and all(c.new_holder_tokens == 0 for c in d.costs)


@pytest.mark.parametrize(
    ("share_every", "holders"),
    [(20, 1), (2, 4)],
    ids=["a prefix one request in twenty shares", "half the traffic on four holders"],
)
def test_no_credit_where_the_holders_can_take_the_prefixs_traffic(share_every, holders):
    keys = prompt(1, SYSTEM, 777)
    p = warmed(share_every=share_every, holders=holders)
    d = p.choose(
        new_session(holders, 2000),
        len(keys) * KEY_TOKENS,
        30.0,
        prompt=PromptKeys(keys, KEY_TOKENS),
    )
    assert all(c.new_holder_tokens == 0 for c in d.costs)
    assert d.engine in ENGINES[:holders]


def test_asking_why_counts_nothing():
    keys = prompt(1, SYSTEM, 777)
    p = warmed(share_every=2, holders=1)
    before = p.popularity.share(keys, SYSTEM)
    for _ in range(5):
        p.choose(
            new_session(1, 2000), 1152, 30.0, prompt=PromptKeys(keys, KEY_TOKENS), dry_run=True
        )
    assert p.popularity.share(keys, SYSTEM) == before
    p.choose(new_session(1, 2000), 1152, 30.0, prompt=PromptKeys(keys, KEY_TOKENS))
    assert p.popularity.share(keys, SYSTEM)[1] > before[1]


# --------------------------------------------------------------------------- through the router


@pytest.fixture(scope="module")
def fleet() -> Iterator[list[Any]]:
    with running_fleet(3, num_gpu_blocks=512, **FAST) as workers:
        yield workers


@pytest.mark.timeout(120)
async def test_debug_route_shows_the_credit_for_a_new_holder_of_a_shared_system_prompt(fleet):
    """Every request the router has routed opened with one system prompt, held by one of three
    workers: after four, its share measured one standard error low is about a half, so a copy
    on either other worker is worth 1 - 1 / (3 * share) of a hit on the 256 tokens of the
    prompt the router measures (its deepest sampled key), and /debug/route says so. After the
    first request alone it is no evidence: no credit."""
    system = {"role": "system", "content": words(300, "popular-system-prompt")}

    def chat(user: str) -> dict[str, Any]:
        return {"model": "sim-model", "messages": [system, {"role": "user", "content": user}]}

    cfg = config_for(fleet)
    async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
        await until(lambda: all(w.subscribed for w in router.registry.workers.values()), 20)
        holders = set()
        for k in range(4):
            r = await c.post(base + "/v1/chat/completions", json={**chat(f"q{k}"), "max_tokens": 2})
            assert r.status_code == 200, r.text
            holders.add(r.headers["x-kvrouter-worker"])
            if k == 0:
                r = await c.post(base + "/debug/route", json=chat("after one"))
                assert all(w["cost"]["new_holder_tokens"] == 0 for w in r.json()["workers"])
        assert len(holders) == 1  # each took the cached prompt: the credit is below the recompute
        (holder,) = holders
        r = await c.post(base + "/debug/route", json=chat("after four"))
        assert r.status_code == 200, r.text
        costs = {w["url"]: w["cost"] for w in r.json()["workers"]}
        assert costs[holder]["new_holder_tokens"] == 0
        others = [u for u in costs if u != holder]
        assert len(others) == 2
        worth = 1 - 1 / (3 * expected_share([True] * 4, UTILIZATION_DECISIONS))
        for u in others:
            assert costs[u]["new_holder_tokens"] == pytest.approx(worth * 256, abs=1e-3)
