"""What the router reports describes what happened: /debug/route asks without deciding, its
TTFT estimate uses what each engine was seen to do, and the TTFT metric holds first tokens only."""

from __future__ import annotations

import copy

import httpx
from test_router_support import config_for, serve_router, until, words

from router.load import EngineLoad
from router.policy import Candidate, KvRouterPolicy, PolicyParams, RoundRobinPolicy, make_policy
from simulator.testing import running_fleet


def _busy(
    engine: tuple[str, int], queued: int, prefilled: int = 0, seconds: float = 0.0
) -> Candidate:
    load = EngineLoad(
        queued_prefill_tokens=queued,
        head_tokens=queued,
        prefilled_tokens=prefilled,
        prefill_seconds=seconds,
    )
    return Candidate(engine, load=load)


def test_a_dry_run_leaves_the_policy_as_it_was() -> None:
    p = KvRouterPolicy(PolicyParams(), seed=1)
    a, b = ("http://a", 0), ("http://b", 0)
    for t, q in enumerate([40_000, 36_000, 32_000, 28_000]):
        p.choose([_busy(a, q, 4000 * t, 1.0 * t), _busy(b, 0)], 1000, float(t))
    before = copy.deepcopy(p._rates)
    dry = p.choose([_busy(a, 20_000, 30_000, 5.0), _busy(b, 5)], 1000, 10.0, dry_run=True)
    assert p._rates == before, "a dry run changed the learned rates"
    real = p.choose([_busy(a, 20_000, 30_000, 5.0), _busy(b, 5)], 1000, 10.0)
    assert [c.cost_tokens for c in dry.costs] == [c.cost_tokens for c in real.costs]
    assert p._rates != before

    rr = RoundRobinPolicy()
    cands = [_busy(a, 0), _busy(b, 0)]
    assert rr.choose(cands, 10, 0.0, dry_run=True).engine == a
    assert [rr.choose(cands, 10, 0.0).engine for _ in range(2)] == [a, b]


def test_a_dry_run_leaves_later_tie_breaks_as_they_were() -> None:
    """Ties among equal engines are broken at random; asking why (a dry run) between two
    decisions must not change which engine the next tie goes to."""
    engines = [(f"http://{n}", 0) for n in "abcd"]
    for policy in ("kvrouter", "least_loaded", "random"):
        asked, quiet = make_policy(policy, seed=3), make_policy(policy, seed=3)
        cands = [Candidate(e) for e in engines]
        picks = []
        for t in range(20):
            asked.choose(cands, 100, float(t), dry_run=True)
            picks.append(asked.choose(cands, 100, float(t)).engine)
        assert picks == [quiet.choose(cands, 100, float(t)).engine for t in range(20)], policy
        assert len(set(picks)) > 1, policy


def test_expected_ttft_uses_the_engines_learned_prefill_rate() -> None:
    p = KvRouterPolicy(PolicyParams(prefill_tokens_per_s=8000.0), seed=1)
    a = ("http://a", 0)
    # Its requests took 4 s to prefill 16,000 tokens from heading its queue to first token.
    for t in range(5):
        d = p.choose([_busy(a, 40_000 - 4000 * t, 4000 * t, 1.0 * t)], 1000, float(t))
    (cost,) = d.costs
    assert cost.rate_learned and abs(cost.prefill_tokens_per_s - 4000.0) < 1.0
    assert abs(cost.expected_ttft_s - cost.cost_tokens / 4000.0) < 1e-9
    fresh = KvRouterPolicy(PolicyParams(prefill_tokens_per_s=8000.0), seed=1)
    (cost,) = fresh.choose([_busy(a, 0)], 1000, 0.0).costs
    assert not cost.rate_learned and cost.expected_ttft_s == cost.cost_tokens / 8000.0


async def test_debug_route_does_not_take_a_round_robin_turn() -> None:
    with running_fleet(2, decode_ms=1, prefill_tps=400000) as ws:
        cfg = config_for(ws, policy={"name": "round_robin"})
        async with serve_router(cfg) as (base, _router), httpx.AsyncClient(timeout=30) as c:
            body = {"model": "sim-model", "prompt": words(20, "rr"), "max_tokens": 1}
            first = (await c.post(base + "/debug/route", json=body)).json()["chosen"]
            for _ in range(3):
                assert (await c.post(base + "/debug/route", json=body)).json()["chosen"] == first
            r = await c.post(base + "/v1/completions", json=body)
            assert r.headers["x-kvrouter-worker"] == first


def _count(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


async def test_ttft_metric_holds_streamed_first_tokens_only() -> None:
    with running_fleet(1, decode_ms=1, prefill_tps=400000) as ws:
        async with (
            serve_router(config_for(ws)) as (base, router),
            httpx.AsyncClient(timeout=30) as c,
        ):
            await until(lambda: all(w.subscribed for w in router.registry.workers.values()), 20)
            body = {"model": "sim-model", "prompt": words(40, "ttft"), "max_tokens": 4}

            async def counts() -> tuple[float, float]:
                m = (await c.get(base + "/metrics")).text
                return (
                    _count(m, "kvrouter_ttft_seconds_count"),
                    _count(m, "kvrouter_request_duration_seconds_count"),
                )

            assert await counts() == (0, 0)
            assert (await c.post(base + "/v1/completions", json=body)).status_code == 200
            await until(lambda: _eq(counts(), (0, 1)), 5, "a buffered answer has no TTFT")
            async with c.stream(
                "POST", base + "/v1/completions", json={**body, "stream": True}
            ) as r:
                assert r.status_code == 200
                await r.aread()
            await until(lambda: _eq(counts(), (1, 2)), 5, "a stream's first token counted")


async def _eq(got: object, want: tuple[float, float]) -> bool:
    return await got == want  # type: ignore[misc]
