"""Config contract (errors name the key, env overrides) and the pure routing policy."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from test_router_support import cand

from router.config import ConfigError, load_config, parse_config, parse_worker_arg
from router.load import EngineLoad
from router.policy import (
    LEARNED_WEIGHT_FLOOR,
    UTILIZATION_DECISIONS,
    Candidate,
    KvRouterPolicy,
    PolicyParams,
    RoundRobinPolicy,
    SpeculativeCache,
    make_policy,
)
from router.popularity import PromptKeys

# ------------------------------------------------------------------------------------ config


def test_defaults_and_full_contract_parse(tmp_path):
    text = """
server: {host: 127.0.0.1, port: 8001, admin_port: null, admin_token: null, api_keys: [],
         forward_authorization: false, max_body_bytes: 1000, cors_origins: [], log_level: info}
model: {name: null, block_size: null, cpu_chunk_tokens: 256}
tokenizer: {mode: remote, path: null, cache_entries: 16}
policy: {name: round_robin, cpu_transfer_discount: 0.25, speculative_ttl_s: 2, near_tie_tokens: 64}
workers:
  - url: http://10.0.0.5:8000/
    events: tcp://10.0.0.5:5557
    replay: tcp://10.0.0.5:5558
    dp_size: 2
    topic: ""
events: {bind: null, queue_depth: 10, replay_timeout_s: 2.0, replay_concurrency: 4}
index: {max_blocks: 100}
discovery:
  kubernetes: {enabled: false, namespace: default, label_selector: app=vllm, port: 8000,
               events_port_annotation: a, replay_port_annotation: b, dp_size_annotation: c}
redis: {url: "redis://r:6379/0", key_prefix: "{kvrouter}", heartbeat_ttl_s: 10,
        snapshot_interval_s: 30}
"""
    p = tmp_path / "k.yaml"
    p.write_text(text)
    cfg = load_config(str(p), env={})
    assert cfg.server.port == 8001 and cfg.policy.name == "round_robin"
    assert cfg.workers[0].url == "http://10.0.0.5:8000" and cfg.workers[0].dp_size == 2
    assert cfg.policy.speculative_ttl_s == 2.0 and cfg.redis.url == "redis://r:6379/0"


@pytest.mark.parametrize(
    ("data", "env", "needle"),
    [
        ({"server": {"prot": 1}}, {}, "server.prot"),
        ({"servre": {}}, {}, "servre"),
        ({"policy": {"name": "fastest"}}, {}, "policy.name"),
        ({"policy": {"near_tie_tokens": "x"}}, {}, "policy.near_tie_tokens"),
        ({"workers": [{"url": "http://a:1", "evnts": "tcp://a:2"}]}, {}, "workers[0].evnts"),
        ({"workers": [{"url": "ftp://a"}]}, {}, "workers[0].url"),
        ({"workers": [{"events": "tcp://a:2"}]}, {}, "workers[0].url"),
        ({"redis": {"urll": "redis://x"}}, {}, "redis.urll"),
        ({"discovery": {"kubernetes": {"enabledd": True}}}, {}, "discovery.kubernetes.enabledd"),
        ({"tokenizer": {"mode": "local"}}, {}, "tokenizer.path"),
        ({"server": {"worker_stall_s": -1}}, {}, "server.worker_stall_s"),
        ({}, {"KVROUTER_SERVER_PROT": "1"}, "KVROUTER_SERVER_PROT"),
        ({}, {"KVROUTER_SERVER_PORT": "eighty"}, "server.port"),
        ({}, {"KVROUTER_REDIS_URL": "http://nope"}, "redis.url"),
    ],
)
def test_config_errors_name_the_key(data, env, needle):
    with pytest.raises(ConfigError) as exc:
        parse_config(data, env=env)
    assert needle in str(exc.value)


def test_env_overrides():
    cfg = parse_config(
        {"server": {"port": 1}},
        env={
            "KVROUTER_SERVER_PORT": "9000",
            "KVROUTER_SERVER_API_KEYS": "a,b",
            "KVROUTER_POLICY_NAME": "least_loaded",
            "KVROUTER_REDIS_URL": "redis://redis:6379/0",
            "KVROUTER_DISCOVERY_KUBERNETES_ENABLED": "true",
            "KVROUTER_SERVER_ADMIN_PORT": "null",
            "KVROUTER_REAL_VLLM": "1",  # other tools' variables are ignored
        },
    )
    assert cfg.server.port == 9000 and cfg.server.api_keys == ["a", "b"]
    assert cfg.policy.name == "least_loaded" and cfg.discovery.kubernetes.enabled is True
    assert cfg.redis.url == "redis://redis:6379/0" and cfg.server.admin_port is None


def test_policy_knobs_reach_the_policy_and_default_to_its_own_defaults():
    from router.core import Router

    assert parse_config({}, env={}).policy == PolicyParams()
    cfg = parse_config(
        {"workers": [{"url": "http://a:1"}], "policy": {"recompute_weight": 2, "queue_drain": 0}},
        env={"KVROUTER_POLICY_KV_PRESSURE_TOKENS": "512"},
    )
    params = Router(cfg).policy.params  # type: ignore[attr-defined]
    assert (params.recompute_weight, params.queue_drain) == (2.0, 0.0)
    assert params.kv_pressure_tokens == 512.0
    with pytest.raises(ConfigError, match=r"policy\.recompute_weight"):
        parse_config({"workers": [{"url": "http://a:1"}], "policy": {"recompute_weight": 0.5}})
    with pytest.raises(ConfigError, match=r"policy\.follow_on_weight"):
        parse_config({"workers": [{"url": "http://a:1"}], "policy": {"follow_on_weight": -1}})
    with pytest.raises(ConfigError, match=r"policy\.new_holder_weight"):
        parse_config({"workers": [{"url": "http://a:1"}], "policy": {"new_holder_weight": -1}})
    for budget in (-0.1, 1.5):
        with pytest.raises(ConfigError, match=r"policy\.hit_loss_budget"):
            parse_config(
                {"workers": [{"url": "http://a:1"}], "policy": {"hit_loss_budget": budget}}
            )
    for wait in (0, -1, float("inf")):
        with pytest.raises(ConfigError, match=r"policy\.prefill_priority_max_wait_s"):
            parse_config(
                {
                    "workers": [{"url": "http://a:1"}],
                    "policy": {"prefill_priority": True, "prefill_priority_max_wait_s": wait},
                }
            )
    with pytest.raises(ConfigError, match=r"redis\.op_timeout_s"):
        parse_config({"workers": [{"url": "http://a:1"}], "redis": {"op_timeout_s": 0}})
    slow = parse_config(
        {
            "workers": [{"url": "http://a:1"}],
            "redis": {"url": "redis://r:6379/0", "op_timeout_s": 0.5},
        }
    )
    assert Router(slow).shared.op_timeout_s == 0.5  # type: ignore[attr-defined]
    learned = parse_config({"workers": [{"url": "http://a:1"}], "policy": {"recompute_weight": 0}})
    assert learned.policy.recompute_weight == 0.0 and PolicyParams().recompute_weight == 0.0


def test_worker_quick_form():
    w = parse_worker_arg("http://h2:8000;events=tcp://h2:5557;replay=tcp://h2:5558;dp_size=2")
    assert (w.url, w.events, w.replay, w.dp_size) == (
        "http://h2:8000",
        "tcp://h2:5557",
        "tcp://h2:5558",
        2,
    )
    with pytest.raises(ConfigError, match="evnts"):
        parse_worker_arg("http://h:1;evnts=tcp://h:2")


def test_cli_reports_config_error(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("server:\n  port: 8000\n  max_body_byte: 10\n")
    r = subprocess.run(
        [sys.executable, "-m", "router.cli", "serve", "--config", str(p)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "server.max_body_byte" in r.stderr


# ------------------------------------------------------------------------------------ policy


def test_prefers_cached_prefix_and_counts_cpu_at_discount():
    p = KvRouterPolicy(PolicyParams(cpu_transfer_discount=0.25, near_tie_tokens=0), seed=1)
    d = p.choose([cand("a"), cand("b", gpu=512), cand("c", gpu=256, cpu=512)], 1025, 0.0)
    costs = {c.engine: c.cost_tokens for c in d.costs}
    assert costs == {"a": 1025, "b": 513, "c": 257 + 512 * 0.25}
    assert d.engine == "c" and d.ranked == ["c", "b", "a"]


def test_queued_prefill_outweighs_a_small_hit():
    p = KvRouterPolicy(PolicyParams(near_tie_tokens=0), seed=1)
    d = p.choose([cand("a", gpu=256, queued_prefill_tokens=4000), cand("b")], 1000, 0.0)
    assert d.engine == "b"


def test_worker_metrics_correct_the_estimate():
    p = KvRouterPolicy(PolicyParams(near_tie_tokens=0, mean_prompt_tokens=1000), seed=1)
    # b's own queue is empty but the worker reports 3 waiting requests other routers sent.
    d = p.choose([cand("a", gpu=0), cand("b", gpu=512, waiting=3)], 1000, 0.0)
    assert d.engine == "a"
    # Waiting requests this router sent itself are already in queued_prefill_tokens.
    own = {"waiting": 1, "prefilling_at_poll": 1, "prefilling_requests": 1}
    d = p.choose([cand("a"), cand("b", gpu=512, queued_prefill_tokens=100, **own)], 1000, 0.0)
    assert d.engine == "b"


def test_own_requests_started_since_the_poll_are_not_foreign():
    """The gauge is a poll old: two of this router's requests were waiting then and have
    started since. They are not waiting requests of another router's."""
    p = KvRouterPolicy(PolicyParams(near_tie_tokens=0, mean_prompt_tokens=1000), seed=1)
    stale = cand("b", gpu=512, waiting=2, prefilling_at_poll=2, prefilling_requests=0)
    d = p.choose([cand("a"), stale], 1000, 0.0)
    assert d.engine == "b" and d.costs[1].metrics_tokens == 0
    assert stale.load.foreign_waiting() == 0
    # One more waiting at the poll than this router had there: one foreign request.
    assert EngineLoad(waiting=3, prefilling_at_poll=2).foreign_waiting() == 1


def test_an_engine_unused_for_a_window_weighs_a_recompute_at_the_floor():
    """An engine nothing was sent to for UTILIZATION_DECISIONS decisions, idle now, delays
    nobody by recomputing there: its uncached tokens weigh the floor, not the fleet's weight.
    One that was sent a request within the window keeps the fleet's weight."""

    def warmed(b_sent_at: int | None) -> KvRouterPolicy:
        # follow_on_weight=0: a's queue at every arrival would otherwise charge its sessions
        p = KvRouterPolicy(PolicyParams(near_tie_tokens=0, follow_on_weight=0.0), seed=1)
        for i in range(UTILIZATION_DECISIONS + 50):
            a = cand("a", gpu=999, queued_prefill_tokens=500)  # a busy holder takes everything
            b = cand("b", gpu=999 if i == b_sent_at else 0)
            p.choose([a, b] if i != b_sent_at else [b, a], 1000, float(i))
        return p

    turn = [cand("a", gpu=4000, queued_prefill_tokens=6000), cand("b")]
    p = warmed(None)
    w = p.recompute_weight()
    assert w == pytest.approx(2.0, abs=0.05)  # half the engines busy at every arrival
    assert p.unused(turn[1]) and not p.unused(turn[0])
    d = p.choose(turn, 5000, 400.0, dry_run=True)
    assert d.engine == "b"  # 5000 * 1.1 against 6000 + 1000 * w: recompute where nobody waits
    assert p.choose(turn, 5000, 400.0).engine == "b"
    assert not p.unused(cand("b"))  # chosen: not unused for another window
    recently = warmed(UTILIZATION_DECISIONS + 10)  # b was sent one request 40 decisions ago
    assert not recently.unused(turn[1])
    assert recently.choose(turn, 5000, 400.0).engine == "a"  # 6000 + 1000 w < 5000 w


def test_a_new_session_leaves_the_holder_whose_queue_its_continuations_would_share():
    """Where each computed token is read again many times (sessions), placing a prompt pins its
    continuations to that engine: they wait in its mean queue, not its queue of this instant.
    The holder of a shared prefix, idle right now but queued 1,000 tokens on average, loses a
    new session to an engine without the prefix; where tokens are rarely reused, or with
    ``follow_on_weight: 0``, the request takes the cached prefix."""

    def warmed(hit: int, follow_on_weight: float = 0.5) -> KvRouterPolicy:
        params = PolicyParams(
            near_tie_tokens=0, recompute_weight=2.0, follow_on_weight=follow_on_weight
        )
        p = KvRouterPolicy(params, seed=0)
        for i in range(200):  # every request goes to a, 1,000 tokens queued there each time
            p.choose([cand("a", gpu=hit, queued_prefill_tokens=1000)], 1000, i * 0.1)
        return p

    new_session = [cand("a", gpu=1500), cand("b")]  # 1,500 of 2,000 tokens cached on a
    sessions = warmed(hit=900)
    assert sessions.reuse() == pytest.approx(9.0)  # 0.9 of prompt tokens hit: 9 reads each
    d = sessions.choose(new_session, 2000, 30.0)
    charged = {c.engine: c.follow_on_tokens for c in d.costs}
    assert charged == pytest.approx({"a": 4.5 * 1000, "b": 0.0})
    assert d.engine == "b"  # 2,000 * 2 against 500 * 2 + 4,500
    one_off = warmed(hit=100)
    assert one_off.reuse() < 1 and one_off.follow_on_tokens("a") == 0.0
    assert one_off.choose(new_session, 2000, 30.0).engine == "a"
    assert warmed(hit=900, follow_on_weight=0.0).choose(new_session, 2000, 30.0).engine == "a"


def test_near_ties_spread_by_inflight_then_random():
    p = KvRouterPolicy(PolicyParams(near_tie_tokens=64), seed=3)
    d = p.choose([cand("a", gpu=32, inflight_requests=3), cand("b", inflight_requests=1)], 500, 0)
    assert d.engine == "b"  # 32-token advantage is a near-tie: fewer in-flight wins
    chosen = {p.choose([cand("a"), cand("b"), cand("c")], 100, 0.0).engine for _ in range(50)}
    assert chosen == {"a", "b", "c"}


def test_speculative_entries_guide_siblings_then_expire():
    spec = SpeculativeCache(ttl_s=2.0)
    keys = list(range(100, 140))  # 40 units of 16 tokens
    spec.record("a", keys, now=10.0)
    assert spec.hit_tokens("a", keys, 16, now=10.5) == 640
    assert spec.hit_tokens("a", [*keys[:10], 999, 998], 16, now=10.5) == 160
    assert spec.hit_tokens("b", keys, 16, now=10.5) == 0
    p = KvRouterPolicy(PolicyParams(near_tie_tokens=64), seed=0)
    d = p.choose([cand("a", spec=spec.hit_tokens("a", keys, 16, 10.5)), cand("b")], 641, 10.5)
    assert d.engine == "a" and d.costs[0].speculative
    assert spec.hit_tokens("a", keys, 16, now=12.01) == 0
    spec.expire(12.01)
    assert len(spec) == 0


def test_speculative_refresh_keeps_entries_and_bounds():
    spec = SpeculativeCache(ttl_s=1.0, max_keys=50)
    spec.record("a", [1, 2, 3], now=0.0)
    spec.record("a", [1, 2, 3, 4], now=0.9)
    assert spec.hit_tokens("a", [1, 2, 3, 4], 16, now=1.5) == 64  # refreshed by the 2nd record
    for i in range(20):
        spec.record("b", list(range(1000 + 10 * i, 1010 + 10 * i)), now=2.0)
    assert len(spec) <= 50
    # past the bound the oldest records go first; the newest stays usable
    spec = SpeculativeCache(ttl_s=10.0, max_keys=50)
    for i in range(20):
        spec.record("b", list(range(1000 + 10 * i, 1010 + 10 * i)), now=0.01 * i)
        assert len(spec) <= 50
    newest = list(range(1190, 1200))
    assert spec.hit_tokens("b", newest, 16, now=0.3) == 160
    assert spec.hit_tokens("b", list(range(1000, 1010)), 16, now=0.3) == 0


@pytest.mark.parametrize("weight", [1.0, 4.0])
def test_herd_spills_over_once_queue_outweighs_recompute(weight: float) -> None:
    """Siblings follow the first request's speculative entry until the queue there outweighs
    recomputing the shared prefix elsewhere, with recompute counted ``weight`` times (a prefix
    computed twice costs fleet capacity and moves the conversation's later hits)."""
    # follow_on_weight=0: the siblings hit 93 % of their prompts, so their sessions would also
    # be charged the holder's mean queue; this is the one request's trade-off
    params = PolicyParams(near_tie_tokens=64, recompute_weight=weight, follow_on_weight=0.0)
    p = KvRouterPolicy(params, seed=0)
    spec = SpeculativeCache(ttl_s=2.0)
    keys = list(range(64))  # 1024-token shared prefix
    queued = {"a": 0, "b": 0, "c": 0}
    picks = []
    for _i in range(150):
        cands = [
            cand(w, spec=spec.hit_tokens(w, keys, 16, 0.0), queued_prefill_tokens=queued[w])
            for w in queued
        ]
        d = p.choose(cands, 1100, 0.0)
        picks.append(d.engine)
        queued[d.engine] += next(c.uncached_tokens for c in d.costs if c.engine == d.engine)
        spec.record(d.engine, keys, 0.0)
    holder = picks[0]
    first_spill = next(i for i, w in enumerate(picks) if w != holder)
    # The holder's queue starts with the first request's 1100-token prefill and grows by 76
    # uncached tokens per sibling; another worker costs 1100 uncached tokens, weighted. The
    # holder keeps sibling k while 1100 + 76k + 76w <= 1100w: greedy (w = 1) spreads at once.
    expected = max(1.0, (weight - 1) * 1100 / 76 - weight + 1)
    assert abs(first_spill - expected) <= 2 + 0.1 * expected
    assert len(set(picks)) == 3  # load spreads once every holder's queue has built up


def test_recompute_weight_is_learned_from_utilization() -> None:
    """With ``recompute_weight: 0`` the policy weighs recomputing a cached prefix at
    ``1 / (1 - u)``, ``u`` the share of engines found with prefill queued when requests arrive:
    on an idle fleet a request leaves a queued holder whose queue costs more than recomputing
    its prefix (nobody else waits for that recompute); on a busy one it stays (every request
    queued behind the recompute would wait for it too). A fixed weight overrides."""

    def holder_or_other(p: KvRouterPolicy) -> str:
        # a: 1,000 of 2,000 tokens cached behind 1,500 queued; b: idle, nothing cached
        return p.choose([cand("a", gpu=1000, queued_prefill_tokens=1500), cand("b")], 2000, 9.0)

    idle = KvRouterPolicy(PolicyParams(near_tie_tokens=0, recompute_weight=0.0), seed=0)
    for i in range(50):
        idle.choose([cand("a"), cand("b"), cand("c"), cand("d")], 100, i * 0.1)
    assert idle.utilization() == 0.0 and idle.recompute_weight() == LEARNED_WEIGHT_FLOOR
    assert holder_or_other(idle).engine == "b"  # 2,500 tokens of wait there against 2,200 here

    busy = KvRouterPolicy(PolicyParams(near_tie_tokens=0, recompute_weight=0.0), seed=0)
    for i in range(50):  # three engines of four with prefill queued at every arrival
        loads = [cand(w, queued_prefill_tokens=500) for w in "abc"] + [cand("d")]
        busy.choose(loads, 100, i * 0.1)
    assert busy.utilization() == pytest.approx(0.75)
    assert busy.recompute_weight() == pytest.approx(4.0)
    d = holder_or_other(busy)
    assert d.engine == "a"  # 2,500 + 3 * 1,000 against 2,000 + 3 * 2,000
    assert {c.engine: c.rank_tokens for c in d.costs} == pytest.approx({"a": 5500, "b": 8000})

    fixed = KvRouterPolicy(PolicyParams(near_tie_tokens=0, recompute_weight=4.0), seed=0)
    for i in range(50):
        fixed.choose([cand("a"), cand("b")], 100, i * 0.1)
    assert fixed.recompute_weight() == 4.0 and holder_or_other(fixed).engine == "a"


def test_kv_usage_raises_the_learned_weight() -> None:
    """At the same utilization, a fleet whose KV caches running requests fill to 60 % weighs
    recomputing a prefix 0.6 / 0.4 = 1.5 more: the copy evicts cached prefixes later requests
    come back for, so the request stays with its holder where a roomy fleet would move it."""

    def learned(kv_usage: float) -> KvRouterPolicy:
        p = KvRouterPolicy(PolicyParams(near_tie_tokens=0), seed=0)  # learned by default
        for i in range(50):  # one engine of two with prefill queued at every arrival
            p.choose([cand("a", queued_prefill_tokens=500), cand("b")], 100, i * 0.1)
        assert p.utilization() == pytest.approx(0.5)
        return p

    def holder_or_other(p: KvRouterPolicy, kv_usage: float) -> str:
        # a: 1,000 of 2,000 tokens cached behind 2,800 queued; b: idle, nothing cached
        cands = [
            cand("a", gpu=1000, queued_prefill_tokens=2800, kv_usage=kv_usage),
            cand("b", kv_usage=kv_usage),
        ]
        return p.choose(cands, 2000, 9.0).engine

    roomy, full = learned(0.0), learned(0.6)
    assert roomy.recompute_weight(0.0) == pytest.approx(2.0)
    assert full.recompute_weight(0.6) == pytest.approx(3.5)
    assert holder_or_other(roomy, 0.0) == "b"  # 3,800 + 1,000 against 2,000 + 2,000
    assert holder_or_other(full, 0.6) == "a"  # 3,800 + 2,500 against 2,000 + 5,000


def test_simple_policies():
    rr = RoundRobinPolicy()
    assert [rr.choose([cand("a"), cand("b")], 10, 0).engine for _ in range(4)] == [
        "a",
        "b",
        "a",
        "b",
    ]
    ll = make_policy("least_loaded", seed=0)
    assert ll.choose([cand("a", inflight_requests=2), cand("b")], 10, 0).engine == "b"
    rnd = make_policy("random", seed=0)
    assert {rnd.choose([cand("a"), cand("b")], 10, 0).engine for _ in range(30)} == {"a", "b"}


def test_queued_prefill_counts_the_head_done_at_the_learned_rate() -> None:
    """A worker part-way through a long prefill looks busier to the raw count (held in full
    until the first token) than it is. The engine admits in order, so only the head of the
    router's queue there is being prefilled: at the worker's learned rate (tokens over the
    seconds its requests took from heading the queue to their first tokens) that much of it
    counts as done, never more than the head itself, not at all before there is evidence, and
    in proportion to ``queue_drain``."""
    # 20,000 tokens prefilled in 2 s: 10k tokens/s. The head, 10,000 tokens, began at t=10.
    busy = {
        "queued_prefill_tokens": 40_000,
        "head_tokens": 10_000,
        "head_since": 10.0,
        "prefilled_tokens": 20_000,
        "prefill_seconds": 2.0,
    }

    def queued(now: float, drain: float = 1.0, **load: float) -> float:
        p = KvRouterPolicy(PolicyParams(near_tie_tokens=0, queue_drain=drain), seed=0)
        c = p.choose([cand("a", **(busy | load))], 100, now).costs[0]
        assert c.cost_tokens == pytest.approx(c.queued_tokens + 100)
        return c.queued_tokens

    assert queued(10.5) == pytest.approx(35_000)
    assert queued(12.0) == pytest.approx(30_000)  # the head is done; the rest is still to come
    assert queued(60.0) == pytest.approx(30_000)
    assert queued(9.0) == pytest.approx(40_000)  # a clock behind the head: nothing done
    assert queued(10.5, drain=0.5) == pytest.approx(37_500)
    assert queued(12.0, drain=0.0) == 40_000
    assert queued(12.0, prefill_seconds=1.0) == 40_000  # under 2 s of evidence: no rate yet
    assert queued(12.0, queued_prefill_tokens=0, head_tokens=0) == 0


def test_the_learned_prefill_rate_windows_and_restarts() -> None:
    """The rate is what the counters grew by since the policy last looked, decayed over a
    window; counters that went back (a replaced worker's new record) start it again."""
    p = KvRouterPolicy(PolicyParams(near_tie_tokens=0), seed=0)
    a = ("http://a", 0)

    def seen(tokens: int, seconds: float, now: float) -> float | None:
        load = EngineLoad(prefilled_tokens=tokens, prefill_seconds=seconds)
        p.choose([Candidate(a, load=load)], 100, now)
        return p.prefill_rate(a)

    assert seen(1_000, 1.0, 0.0) is None  # 1 s of evidence: not yet
    assert seen(20_000, 2.0, 1.0) == pytest.approx(10_000)
    assert seen(20_000, 2.0, 2.0) == pytest.approx(10_000)  # nothing new: unchanged
    # 100 s more at 20k tokens/s: past 60 s the window halves (both sides: the same rate).
    assert seen(2_020_000, 102.0, 3.0) == pytest.approx(2_020_000 / 102.0)
    assert seen(5_000, 1.0, 4.0) == pytest.approx(2_020_000 / 102.0)  # a new record: no sample
    # From the new record on, 40,000 tokens in 2 s join the halved window (1,010,000 in 51 s).
    assert seen(45_000, 3.0, 5.0) == pytest.approx(1_050_000 / 53.0)


def test_drained_worker_wins_over_an_equal_raw_count() -> None:
    """Two workers report the same queued tokens; one began its head prefill 2.5 s ago (mostly
    done), the other just now: the drained one is chosen."""
    p = KvRouterPolicy(PolicyParams(near_tie_tokens=0), seed=0)
    rate = {"prefilled_tokens": 40_000, "prefill_seconds": 4.0}  # 10k tokens/s, both
    a = cand("a", queued_prefill_tokens=30_000, head_tokens=30_000, head_since=20.5, **rate)
    b = cand("b", queued_prefill_tokens=30_000, head_tokens=30_000, head_since=23.0, **rate)
    d = p.choose([b, a], 100, 23.0)
    assert d.engine == "a"
    costs = {c.engine: c.queued_tokens for c in d.costs}
    assert costs["b"] == 30_000 and costs["a"] == pytest.approx(5_000)


def test_speculative_expiry_is_incremental_and_exact():
    """Records retire one by one as their time passes (no periodic sweep of every entry); at
    every moment the cache holds exactly the keys some live record covers, shared keys kept
    alive by the newest record that refreshed them."""
    rng = random.Random(7)
    spec = SpeculativeCache(ttl_s=1.0)
    history: list[tuple[float, str, list[int]]] = []
    now = 0.0
    for _ in range(400):
        now += rng.random() * 0.05
        worker = rng.choice("ab")
        shared = list(range(rng.randrange(5)))  # a shared prefix, refreshed by many records
        keys = shared + [rng.randrange(10**6) + 10 for _ in range(rng.randrange(1, 6))]
        spec.record(worker, keys, now)
        history.append((now, worker, keys))
        live = {(w, k) for t, w, ks in history if t + 1.0 > now for k in ks}
        assert len(spec) == len(live)
        for w, k in rng.sample(sorted(live), min(5, len(live))):
            assert spec.hit_tokens(w, [k], 16, now) == 16
    spec.expire(now + 1.0)
    assert len(spec) == 0


def test_the_retention_interval_reaches_the_speculative_entries():
    from router.core import Router

    w = {"workers": [{"url": "http://a:1"}]}
    assert Router(parse_config(w, env={})).speculative.retention == 0
    keep_all = parse_config({**w, "model": {"prefix_cache_retention_interval": None}}, env={})
    assert Router(keep_all).speculative.retention is None
    every = parse_config(w, env={"KVROUTER_MODEL_PREFIX_CACHE_RETENTION_INTERVAL": "256"})
    assert Router(every).speculative.retention == 256
    with pytest.raises(ConfigError, match=r"model\.prefix_cache_retention_interval"):
        parse_config({**w, "model": {"prefix_cache_retention_interval": -1}})


def test_a_worker_reporting_its_retention_interval_overrides_the_configured_one():
    """vLLM exports its CacheConfig as ``vllm:cache_config_info`` labels; what a worker reports
    there is what its engines are credited by, the configuration only where it says nothing."""
    from router.core import Router
    from router.workers import NOT_REPORTED, parse_prefix_caching, parse_retention

    info = 'vllm:cache_config_info{block_size="32",prefix_cache_retention_interval="%s"} 1.0\n'
    assert parse_retention("# HELP x\n" + info % "None") is None
    assert parse_retention(info % "128") == 128 and parse_retention(info % "0") == 0
    assert parse_retention(info % "bad") == NOT_REPORTED
    assert parse_retention("vllm:num_requests_running 1\n") == NOT_REPORTED
    caching = 'vllm:cache_config_info{enable_prefix_caching="%s",engine="0"} 1.0\n'
    assert parse_prefix_caching(caching % "False") is False
    assert parse_prefix_caching(caching % "True") is True
    assert parse_prefix_caching(info % "0") is None
    r = Router(parse_config({"workers": [{"url": "http://a:1"}, {"url": "http://b:1"}]}, env={}))
    r.registry.workers["http://a:1"].retention = None
    assert r.retention(("http://a:1", 0)) is None and r.retention(("http://b:1", 0)) == 0
    assert r.speculative.retention_of is not None
    assert r.speculative.retention_of(("http://a:1", 0)) is None


def _queued_holder() -> list[Candidate]:
    """``a`` holds 4,000 tokens of a 5,000-token prompt behind a 12,000-token queue; ``b``
    holds nothing and queues nothing."""
    return [
        cand("a", gpu=4000, queued_prefill_tokens=12000, running=1),
        cand("b", running=1),
    ]


def _hit_loss_policy(budget: float) -> KvRouterPolicy:
    """A policy a window past its first one (which the budget does not count), none of its
    decisions having given up a hit: the budget is saved up in full."""
    params = PolicyParams(
        near_tie_tokens=0,
        recompute_weight=2.0,
        follow_on_weight=0.0,
        new_holder_weight=0.0,
        hit_loss_budget=budget,
    )
    p = KvRouterPolicy(params, seed=0)
    for i in range(2 * UTILIZATION_DECISIONS + 1):
        p.choose([cand("a", running=1), cand("b", running=1)], 5000, 0.01 * i)
    return p


@pytest.mark.parametrize("budget", [0.003, 1.0])
def test_hit_loss_budget_keeps_a_prefix_on_its_holder_once_spent(budget: float) -> None:
    """A long prompt queued on the holder of a 4,000-token prefix sends that prefix's requests
    away (recomputing it costs 2 x 1,000 + 2 x 5,000 ranked tokens, waiting on the holder
    12,000 + 1,000 + 1,000). The first move spends the budget and more: the recompute weight
    then rises by 4 per mean prompt owed, and the next request waits on its holder. Without a
    budget every request leaves. ``/debug/route`` (a dry run) spends nothing."""
    p = _hit_loss_policy(budget)
    assert p.hit_loss_weight() == 0.0

    def picks() -> str:
        return p.choose(_queued_holder(), 5000, 3.0).engine  # type: ignore[return-value]

    saved = -p.hit_debt_tokens
    if budget >= 1.0:
        assert [picks() for _ in range(5)] == ["b"] * 5 and p.hit_loss_weight() == 0.0
        return
    assert saved == pytest.approx(budget * UTILIZATION_DECISIONS * 5000)
    before = p.choose(_queued_holder(), 5000, 3.0, dry_run=True)
    assert before.engine == "b" and p.hit_debt_tokens == -saved
    assert picks() == "b"  # the move the saved budget pays for
    # 4,000 given up, 15 earned, 3,840 saved: 145 owed, 4 x 145 / 5,000 = 0.116 of weight
    assert p.hit_debt_tokens == pytest.approx(4000 - 15 - saved)
    owed_weight = p.hit_loss_weight()
    assert owed_weight == pytest.approx(4 * p.hit_debt_tokens / 5000, rel=0.01)
    assert picks() == "b"  # still cheaper elsewhere at weight 2 + 0.12...
    assert p.hit_loss_weight() > owed_weight
    assert [picks() for _ in range(3)] == ["a"] * 3  # ...no longer once the debt has grown


def _first_window_picks(repeating: bool) -> tuple[list[str], KvRouterPolicy]:
    """Ten requests of 5,000 tokens, each finding ``_queued_holder``'s 4,000-token prefix
    behind a queue, whose prompts repeat the same keys or are each new."""
    params = PolicyParams(
        near_tie_tokens=0, recompute_weight=2.0, follow_on_weight=0.0, new_holder_weight=0.0
    )
    p = KvRouterPolicy(params, seed=0)
    picks = []
    for i in range(10):
        first = 0 if repeating else 1000 * i
        keys = PromptKeys(range(first, first + 5000 // 16), 16)
        picks.append(str(p.choose(_queued_holder(), 5000, 0.01 * i, prompt=keys).engine))
    return picks, p


def test_hit_loss_budget_ignores_a_cold_fleet_whose_prompts_repeat() -> None:
    """Where prompts mostly repeat earlier ones, a cold fleet's first moves make the copies
    later requests hit: nothing of the first window is counted."""
    picks, p = _first_window_picks(repeating=True)
    assert picks == ["b"] * 10
    assert p.hit_debt_tokens == 0.0 and p.hit_loss_weight() == 0.0


def test_hit_loss_budget_counts_from_the_start_where_prompts_do_not_repeat() -> None:
    """Where prompts share little, a move gives up its own request's hit and nothing else:
    once the measured repeated share is clearly under a half (from the fifth decision here),
    moves are counted against a full bucket, and the debt soon keeps the prefix's requests
    on its holder."""
    picks, p = _first_window_picks(repeating=False)
    assert picks[:5] == ["b"] * 5 and "a" in picks
    assert p.hit_debt_tokens > 0 and p.hit_loss_weight() > 0
