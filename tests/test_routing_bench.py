"""The routing benchmark end to end on a tiny configuration, and its workload synthesis."""

from __future__ import annotations

import itertools
import json
import math
import statistics
import sys
from pathlib import Path

import msgspec
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import peer_index, peer_report, peers, routing_bench
from bench.bounds import earlier_shared_prefix_units, resumes_earlier, workload_bounds
from bench.workloads import (
    Req,
    TokenSource,
    TraceError,
    chat,
    mooncake,
    read_trace,
    spread_arrivals,
)
from indexer.wire import BlockRemoved, BlockStored
from router.policy import PolicyParams
from simulator.hashing import RequestHasher


def _last_json(capsys: pytest.CaptureFixture[str]) -> dict:
    lines = [x for x in capsys.readouterr().out.splitlines() if x.strip()]
    return json.loads(lines[-1])


def test_shared_prefix_workload_ranks_policies(tmp_path, capsys):
    """kvrouter's hit rate beats round robin's and cannot beat the pooled upper bound.

    Chat with shared system prompts on 4 workers with room for every prefix (no eviction, no
    preemption): pooled_ideal hits every reuse, round robin only the ~1/4 of turns that land
    where the conversation was, kvrouter (events + policy) follows the conversations.
    """
    png = tmp_path / "chart.png"
    argv = [
        "--workload",
        "chat",
        "--scale",
        "0.05",
        "--speed",
        "1.0",
        "--workers",
        "4",
        "--gpu-blocks",
        "20000",
        "--policies",
        "round_robin,least_loaded,kvrouter,pooled_ideal",
        "--out",
        str(png),
    ]
    routing_bench.main(argv)
    out = _last_json(capsys)
    pol = out["policies"]
    assert out["workload"] == "chat" and out["workers"] == 4
    for name, s in pol.items():
        assert s["completed"] == out["config"]["requests"], name
        for key in (
            "hit_rate",
            "ttft_mean_s",
            "ttft_p50_s",
            "ttft_p90_s",
            "ttft_p99_s",
            "throughput_rps",
            "imbalance",
            "decision_ms_p50",
        ):
            assert key in s, (name, key)
        assert s["preemptions"] == 0, name
        assert s["ttft_floor_s"] > 0 and 0 <= s["prefill_steps_with_decode"] <= 1, name
        # Queueing split by whether a request resumes an earlier prompt: the two means weighted
        # by their counts are the policy's whole queueing (mean TTFT - floor).
        n, r = s["completed"], s["resumed_requests"]
        assert 0 < r < n, name  # chat sessions resume their earlier turns; first turns do not
        split = (r * s["queueing_resumed_s"] + (n - r) * s["queueing_fresh_s"]) / n
        assert split == pytest.approx(s["ttft_mean_s"] - s["ttft_floor_s"], abs=1e-3), name
    assert pol["kvrouter"]["hit_rate"] > pol["round_robin"]["hit_rate"] + 0.1
    assert pol["kvrouter"]["hit_rate"] > pol["least_loaded"]["hit_rate"]
    assert pol["kvrouter"]["hit_rate"] <= pol["pooled_ideal"]["hit_rate"] + 1e-9
    assert pol["kvrouter"]["ttft_mean_s"] < pol["round_robin"]["ttft_mean_s"]
    assert pol["pooled_ideal"]["imbalance"] == 1.0
    # The no-queueing floor is priced on the engine that served the request: the pooled engine
    # prefills 4x faster than one worker, so its floor is far below round robin's.
    assert pol["pooled_ideal"]["ttft_floor_s"] < pol["round_robin"]["ttft_floor_s"] / 3
    assert png.stat().st_size > 10_000


def test_trace_replay_and_capacity_measurement(tmp_path, capsys):
    """--trace replays a Mooncake-format file; the offered load comes from a saturation run."""
    trace = tmp_path / "t.jsonl"
    lines = []
    for i in range(40):
        conv = i % 8
        turn = i // 8
        hashes = [0, 1000 + conv] + [2000 + conv * 10 + k for k in range(turn)] + [5000 + i]
        lines.append(
            json.dumps(
                {
                    "timestamp": i * 500,
                    "input_length": 512 * len(hashes) - 100,
                    "output_length": 4,
                    "hash_ids": hashes,
                }
            )
        )
    trace.write_text("\n".join(lines) + "\n")
    routing_bench.main(
        [
            "--trace",
            str(trace),
            "--workers",
            "3",
            "--gpu-blocks",
            "3000",
            "--policies",
            "round_robin,sglang,kvrouter",
            "--out",
            str(tmp_path / "c.png"),
        ]
    )
    out = _last_json(capsys)
    cap = out["config"]["capacity"]
    assert cap["round_robin_capacity_rps"] > 0
    assert out["config"]["offered_rps"] == pytest.approx(
        0.8 * cap["round_robin_capacity_rps"], rel=1e-3
    )
    pol = out["policies"]
    assert pol["kvrouter"]["hit_rate"] > pol["round_robin"]["hit_rate"]
    assert pol["kvrouter"]["hit_rate"] >= pol["sglang"]["hit_rate"] - 0.05
    assert set(out["targets"]) >= {
        "ttft_mean <= 0.85 * best peer",
        "ttft_p90 <= 0.9 * best peer",
        "hit_rate >= best peer - 0.005",
    }


def test_a_checkout_without_the_trace_runs_chat_by_default(tmp_path, capsys, monkeypatch):
    """The conversation trace lives outside the repository: without it the default workload is
    the synthetic chat, and asking for the trace explicitly is an error naming the way out."""
    missing = tmp_path / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
    monkeypatch.setattr(routing_bench, "DEFAULT_TRACE", str(missing))
    args = ["--scale", "0.02", "--speed", "1", "--policies", "round_robin,kvrouter", "--json"]
    routing_bench.main([*args, "--out", str(tmp_path / "c.png")])
    out = _last_json(capsys)
    assert out["workload"] == "chat"
    assert out["policies"]["kvrouter"]["completed"] == out["config"]["requests"] > 0
    with pytest.raises(SystemExit, match="--workload chat"):
        routing_bench.main(["--workload", "mooncake", *args])


def test_mooncake_blocks_share_exact_prefixes(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 1100, "output_length": 3, "hash_ids": [7, 8, 9]}\n'
        '{"timestamp": 5, "input_length": 1500, "output_length": 3, "hash_ids": [7, 8, 10]}\n'
        '{"timestamp": 9, "input_length": 600, "output_length": 3, "hash_ids": [7, 8]}\n'
    )
    a, b, c = mooncake(trace)
    src = TokenSource()
    ta, tb, tc = src.tokens(a), src.tokens(b), src.tokens(c)
    assert (len(ta), len(tb), len(tc)) == (1100, 1500, 600)
    assert ta[:1024] == tb[:1024] and ta[1024:1030] != tb[1024:1030]
    assert tc == ta[:600]  # a cut block is the prefix of the full block
    assert a.arrival_s == 0 and b.arrival_s == 0.005


def _bailian_line(chat_id: int, parent: int, t_s: float, n: int, ids: list[int]) -> str:
    return json.dumps(
        {
            "chat_id": chat_id,
            "parent_chat_id": parent,
            "timestamp": t_s,
            "input_length": n,
            "output_length": 5,
            "type": "text",
            "turn": 1 if parent < 0 else 2,
            "hash_ids": ids,
        }
    )


def test_a_bailian_trace_reads_as_16_token_blocks_in_seconds(tmp_path):
    """Alibaba's Qwen Bailian traces list 16-token blocks with timestamps in seconds: read at
    Mooncake's 512 tokens a block, two prompts sharing 16 tokens would share 512."""
    trace = tmp_path / "bailian.jsonl"
    trace.write_text(
        "\n".join(
            [
                _bailian_line(1, -1, 0.5, 40, [11, 12, 13]),
                _bailian_line(2, 1, 2.25, 70, [11, 12, 13, 14, 15]),
                _bailian_line(3, -1, 3.0, 100, [11, 99, 98, 97, 96, 95, 94]),
            ]
        )
        + "\n"
    )
    (a, b, c), fmt = read_trace(trace)
    assert (fmt.block_tokens, fmt.block_tokens_from, fmt.time_unit) == (16, "inferred", "s")
    assert (a.arrival_s, b.arrival_s, c.arrival_s) == (0.5, 2.25, 3.0)
    src = TokenSource()
    ta, tb, tc = src.tokens(a), src.tokens(b), src.tokens(c)
    assert (len(ta), len(tb), len(tc)) == (40, 70, 100)
    assert tb[:40] == ta  # the second turn extends the first, its cut block included
    assert tc[:16] == ta[:16] and tc[16:32] != ta[16:32]  # one shared block, 16 tokens
    (_, _, c512), given = read_trace(trace, block_tokens=512, time_unit="ms")
    assert (given.block_tokens_from, given.time_unit_from) == ("given", "given")
    assert src.tokens(c512)[:100] != tc and c512.arrival_s == 0.003


def test_trace_block_ids_past_2_39_are_renumbered_apart_from_synthetic_seeds(tmp_path):
    trace = tmp_path / "big.jsonl"
    big = [2**63 + 5, 2**40 + 1]
    trace.write_text(
        json.dumps({"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": big})
        + "\n"
        + json.dumps(
            {"timestamp": 1, "input_length": 700, "output_length": 1, "hash_ids": [big[0], 7]}
        )
        + "\n"
    )
    (a, b), fmt = read_trace(trace)
    assert fmt.block_tokens == 512
    assert a.segments[0][0] == b.segments[0][0] < 2**39
    assert a.segments[1][0] not in (b.segments[0][0], b.segments[1][0])
    src = TokenSource()
    assert src.tokens(a)[:512] == src.tokens(b)[:512]


def test_the_bench_replays_a_bailian_trace_and_reports_how_it_read_it(tmp_path, capsys):
    trace = tmp_path / "bailian.jsonl"
    lines, cid = [], 0
    for conv in range(12):
        parent = -1
        for turn in range(3):
            cid += 1
            ids = [1, 2, 3] + [100 * conv + k for k in range(10 * (turn + 1))]
            t = conv * 0.7 + turn * 2.0
            lines.append(_bailian_line(cid, parent, t, 16 * len(ids) - 3, ids))
            parent = cid
    trace.write_text("\n".join(lines) + "\n")
    flags = ["--workers", "3", "--speed", "1", "--policies", "round_robin,kvrouter", "--json"]
    routing_bench.main(["--trace", str(trace), *flags, "--out", str(tmp_path / "c.png")])
    out = _last_json(capsys)
    assert out["config"]["trace_format"] == {
        "block_tokens": 16,
        "block_tokens_from": "inferred",
        "time_unit": "s",
        "time_unit_from": "inferred",
    }
    assert out["config"]["requests"] == 36 and out["rejected"]["kvrouter"] == 0
    pol = out["policies"]
    assert pol["kvrouter"]["hit_rate"] > pol["round_robin"]["hit_rate"] > 0


def test_chat_turns_extend_the_previous_prompt():
    reqs = chat(n_conversations=5, seed=3)
    src = TokenSource()
    by_conv: dict[str, list] = {}
    for r in reqs:
        by_conv.setdefault(r.rid.split(".")[0], []).append(r)
    multi = [v for v in by_conv.values() if len(v) > 1]
    assert multi
    for turns in multi:
        turns.sort(key=lambda r: int(r.rid.split(".")[1]))
        for prev, nxt in itertools.pairwise(turns):
            assert nxt.arrival_s > prev.arrival_s
            assert src.tokens(nxt)[: prev.n_tokens] == src.tokens(prev)


def test_sglang_follows_its_routing_history_until_the_imbalance_gate():
    """SGLang's cache_aware rule (the routing-history model): a prompt sharing more than 30 % of
    its tokens with one routed earlier goes to that worker however loaded it is, until the
    in-flight imbalance passes 64 requests and 1.5x; a prompt matching nothing goes to the
    least loaded worker."""
    fs = routing_bench.FleetSpec(workers=3, gpu_blocks=2000)
    fleet = routing_bench.FastFleet(3, fs.engine(events=False))
    p = peers.make("sglang", peers.PeerEnv(fleet, 16, 16, 256, routing_bench.MODEL, seed=0))
    src = TokenSource()
    keys = routing_bench.KeyCache(16)

    def route(rid: str, segments: tuple[tuple[int, int], ...]) -> int:
        req = Req(rid, 0.0, segments, sum(n for _, n in segments), 4)
        toks = src.tokens(req)
        return p.route(rid, toks, keys.get(req, toks)[0], 0.0)

    first = route("c0", ((4_000_000, 1024),))
    follow = [route(f"c{i}", ((4_000_000, 1024), (4_100_000 + i, 256))) for i in range(1, 60)]
    assert follow == [first] * 59  # 59 in flight there, none elsewhere: history still wins
    cold = route("x", ((4_200_000, 1024),))
    assert cold != first  # no match: the least loaded worker
    spilled = [route(f"d{i}", ((4_000_000, 1024), (4_300_000 + i, 256))) for i in range(10)]
    # 65 in flight on the holder against 0: past the gate, the least loaded, history or not
    assert spilled[:5] == [first] * 5 and spilled[5] not in (first, cold)


def test_hit_rate_counts_the_first_admission_not_a_preempted_requests_own_blocks():
    """Two unique prompts whose decodes outgrow a tiny KV cache: one is preempted and, when
    re-admitted, finds its own just-freed blocks cached. vLLM's ``num_cached_tokens`` keeps the
    first admission's hit (none here), and so must the benchmark's hit rate."""
    reqs = [Req(f"r{i}", 0.01 * i, ((1_000_000 + i, 400),), 400, 400) for i in range(2)]
    fs = routing_bench.FleetSpec(workers=1, gpu_blocks=64, max_num_batched_tokens=512)
    rs = routing_bench.RouterSpec()
    res = routing_bench.run_policy(
        "round_robin", reqs, 1.0, fs, rs, TokenSource(), routing_bench.KeyCache(16)
    )
    assert res.completed == 2 and res.preemptions >= 1
    assert res.hit_rate == 0.0


def test_kvrouter_admission_holds_requests_at_the_router_and_counts_their_wait():
    """One worker, two long prompts then three short ones in a burst. kvrouter sends them all
    at once and the worker serves them in arrival order; behind the router's admission queue
    (``shortest_prompt``) the second long prompt waits at the router and the short ones pass
    it. The wait at the router is part of TTFT (from arrival, as the client sees it)."""
    lengths = [8000, 8000, 100, 100, 100]
    reqs = [Req(f"r{i}", 0.001 * i, ((3_000_000 + i, n),), n, 2) for i, n in enumerate(lengths)]
    fs = routing_bench.FleetSpec(workers=1, prefill_tokens_per_s=10_000.0)

    def run(name: str, order: str = "shortest_prompt") -> routing_bench.RunResult:
        rs = routing_bench.RouterSpec()
        rs.admission = msgspec.structs.replace(rs.admission, order=order)
        return routing_bench.run_policy(
            name, reqs, 1.0, fs, rs, TokenSource(), routing_bench.KeyCache(16)
        )

    plain, held, fair = (
        run("kvrouter"),
        run("kvrouter_admission"),
        run("kvrouter_admission", "fair"),
    )
    assert plain.completed == held.completed == fair.completed == 5
    assert held.refused == 0
    one_long = 8000 / 10_000.0
    # The second long prompt waited for the first and for the short ones: >= two long prefills.
    assert max(held.ttft) >= 2 * one_long
    # Short prompts no longer wait for the second long one: every short TTFT is under two long
    # prefills, where in arrival order each waits for both.
    assert sorted(held.ttft)[2] < 2 * one_long <= sorted(plain.ttft)[2]
    assert statistics.fmean(held.ttft) < statistics.fmean(fair.ttft)
    assert statistics.fmean(held.ttft) < statistics.fmean(plain.ttft)


def test_router_replicas_see_each_others_load_through_the_shared_state(monkeypatch):
    """Two replicas, two workers, two long prompts 0.3 s apart: the first goes through one
    replica, the second through the other (seed 4 of the spread). With the others' load
    shared (every ``SHARE_S``, as the product's push and refresh), the second replica sees the
    first prompt queued on its worker and takes the idle one: neither waits. Blind to each
    other (nothing shared), it sees two idle workers and takes the busy one here."""
    reqs = [Req(f"r{i}", 0.3 * i, ((3_050_000 + i, 8000),), 8000, 2) for i in range(2)]
    fs = routing_bench.FleetSpec(workers=2, prefill_tokens_per_s=10_000.0)
    one_long = 8000 / 10_000.0

    def run(replicas: int) -> routing_bench.RunResult:
        rs = routing_bench.RouterSpec(replicas=replicas)
        return routing_bench.run_policy(
            "kvrouter", reqs, 1.0, fs, rs, TokenSource(), routing_bench.KeyCache(16), seed=4
        )

    single, shared = run(1), run(2)
    assert single.completed == shared.completed == 2
    assert max(single.ttft) < 1.5 * one_long
    assert max(shared.ttft) < 1.5 * one_long
    monkeypatch.setattr(routing_bench, "PUBLISH_LAG_S", math.inf)
    blind = run(2)
    assert max(blind.ttft) >= 1.5 * one_long  # the second waited for the first


def test_prefill_priority_lets_short_prompts_pass_a_long_one_queued_on_the_worker():
    """The same burst on workers running vLLM's priority scheduling: kvrouter writes each
    request's prefill class as its priority, so the worker itself takes the short prompts
    before the second long one (waiting behind the first), with nothing held at the router;
    the peers write none and are served in arrival order."""
    lengths = [8000, 8000, 100, 100, 100]
    reqs = [Req(f"r{i}", 0.001 * i, ((3_100_000 + i, n),), n, 2) for i, n in enumerate(lengths)]
    fs = routing_bench.FleetSpec(
        workers=1, prefill_tokens_per_s=10_000.0, scheduling_policy="priority"
    )

    def run(name: str, prefill_priority: bool) -> routing_bench.RunResult:
        rs = routing_bench.RouterSpec(params=PolicyParams(prefill_priority=prefill_priority))
        return routing_bench.run_policy(
            name, reqs, 1.0, fs, rs, TokenSource(), routing_bench.KeyCache(16)
        )

    plain, prioritized, peer = (
        run("kvrouter", False),
        run("kvrouter", True),
        run("dynamo", True),
    )
    assert plain.completed == prioritized.completed == peer.completed == 5
    one_long = 8000 / 10_000.0
    shorts = sorted(prioritized.ttft)[:3]
    assert max(shorts) < 2 * one_long <= sorted(plain.ttft)[2]
    assert max(prioritized.ttft) >= 2 * one_long  # the second long prompt waited for them
    assert sorted(peer.ttft)[2] >= 2 * one_long
    assert statistics.fmean(prioritized.ttft) < statistics.fmean(plain.ttft)


def test_prefill_priority_stops_passing_a_long_prompt_once_it_has_waited_its_allowance():
    """One worker kept past its capacity by short prompts: with priorities, a long prompt sent
    among them waits until they stop, unless the router ages it (``prefill_priority_max_wait_s``:
    later requests then queue behind it)."""
    shorts = [Req(f"s{i}", 0.025 * i, ((3_200_000 + i, 300),), 300, 2) for i in range(400)]
    long = Req("long", 1.0, ((3_199_999, 8000),), 8000, 2)  # shorts queued ahead of it already
    reqs = sorted([long, *shorts], key=lambda r: r.arrival_s)
    fs = routing_bench.FleetSpec(
        workers=1, prefill_tokens_per_s=10_000.0, scheduling_policy="priority"
    )

    def long_ttft(max_wait_s: float) -> float:
        params = PolicyParams(prefill_priority=True, prefill_priority_max_wait_s=max_wait_s)
        res = routing_bench.run_policy(
            "kvrouter", reqs, 1.0, fs, routing_bench.RouterSpec(params=params), TokenSource(),
            routing_bench.KeyCache(16),
        )  # fmt: skip
        assert res.completed == len(reqs)
        return res.ttft[res.ids.index("long")]

    starved, aged = long_ttft(1e9), long_ttft(1.0)
    # Shorts arrive at 12k tokens/s against 10k: unaged, the long prompt waits for the last.
    assert starved > 10.0
    # Aged: passed over for 1 s beyond its own prefill (at the rate the router knows), then by
    # the shorts already queued ahead of it, then its own 0.8 s.
    assert aged < starved / 2 and aged < 6.0, (aged, starved)


def _conversation_trace(
    path: Path, n: int = 40, long_at: tuple[int, ...] = (), long_answer_at: tuple[int, ...] = ()
) -> None:
    """Eight conversations growing turn by turn; requests at ``long_at`` get a 40k-token prompt,
    those at ``long_answer_at`` ask for a 40k-token answer."""
    lines = []
    for i in range(n):
        conv, turn = i % 8, i // 8
        hashes = [0, 1000 + conv] + [2000 + conv * 10 + k for k in range(turn)] + [5000 + i]
        length = 512 * len(hashes) - 100
        if i in long_at:
            hashes, length = [9000 + i], 40_000
        lines.append(
            json.dumps(
                {
                    "timestamp": i * 500,
                    "input_length": length,
                    "output_length": 40_000 if i in long_answer_at else 4,
                    "hash_ids": hashes,
                }
            )
        )
    path.write_text("\n".join(lines) + "\n")


def test_peers_sweep_goodput_and_rejected_prompts(tmp_path, capsys):
    """Every peer runs the trace to the end; a prompt, or a prompt and the answer it asks for,
    over max_model_len is refused (HTTP 400 in vLLM), counted per policy and never routed; the
    sweep, goodput and targets come out."""
    trace = tmp_path / "t.jsonl"
    _conversation_trace(trace, long_at=(5,), long_answer_at=(17,))
    policies = ["kvrouter", *peers.NAMES]
    routing_bench.main(
        [
            "--trace",
            str(trace),
            "--workers",
            "3",
            "--gpu-blocks",
            "3000",
            "--max-model-len",
            "32768",
            "--loads",
            "0.5,1.2",
            "--load",
            "0.5",
            "--slo-p90-s",
            "1000",
            "--policies",
            ",".join(policies),
            "--out",
            str(tmp_path / "c.png"),
        ]
    )
    out = _last_json(capsys)
    assert set(out["rejected"]) == set(policies)
    for name in policies:
        assert out["rejected"][name] == 2, name
        for load in ("0.5", "1.2"):
            s = out["sweep"][name][load]
            assert s["completed"] == 38, (name, load)
            assert s["ttft_p90_s"] > 0 and 0 <= s["hit_rate"] <= 1
        # the SLO is loose enough for every policy at every tested load
        assert out["goodput"][name] == 1.2, name
    assert out["policies"] == {n: out["sweep"][n]["0.5"] for n in policies}
    t = out["targets"]
    assert {"ttft_mean <= 0.85 * best peer", "hit_rate >= best peer - 0.005"} <= set(t)
    goodput = t["goodput >= 1.1 * best peer"]
    assert (
        goodput["value"] == 1.2
        and goodput["limit"] == pytest.approx(1.32)
        and "censored" in goodput
    )
    # conversations come back: an event-fed peer finds their prefixes as kvrouter does
    assert out["sweep"]["dynamo"]["0.5"]["hit_rate"] > 0.2
    assert Path(out["chart_p90"]).stat().st_size > 10_000


def test_seeds_run_the_whole_bench_once_each_and_count_targets_met(tmp_path, capsys):
    """--seeds S1,S2 is --seed S1 and --seed S2, each run whole; every target says on how many
    of them it was met, with each seed's value and limit."""
    trace = tmp_path / "t.jsonl"
    _conversation_trace(trace)
    base = ["--trace", str(trace), "--workers", "3", "--gpu-blocks", "3000", "--speed", "2"]
    base += ["--policies", "kvrouter,dynamo,llm_d", "--out", str(tmp_path / "c.png")]
    routing_bench.main([*base, "--seeds", "0,1"])
    out = _last_json(capsys)
    assert set(out["seeds"]) == {"0", "1"}
    assert [out["seeds"][s]["config"]["seed"] for s in ("0", "1")] == [0, 1]
    assert (tmp_path / "c_seed0.png").exists() and (tmp_path / "c_seed1.png").exists()
    routing_bench.main([*base, "--seed", "1"])
    alone = _last_json(capsys)

    def simulated(pol: dict) -> dict:  # what the simulated clock decides; decision_ms is wall time
        return {n: {k: v for k, v in m.items() if "decision_ms" not in k} for n, m in pol.items()}

    assert simulated(out["seeds"]["1"]["policies"]) == simulated(alone["policies"])
    over = out["targets_over_seeds"]
    assert set(over) == set(alone["targets"])
    for name, t in over.items():
        assert t["seeds"] == 2 and set(t["values"]) == {"0", "1"}
        met = [out["seeds"][s]["targets"][name]["met"] for s in ("0", "1")]
        assert t["met_on"] == sum(met), name
        assert t["limits"]["1"] == alone["targets"][name]["limit"]
    with pytest.raises(SystemExit, match="--seeds"):
        routing_bench.main([*base, "--seeds", "0,x"])


def test_targets_carry_the_workloads_bounds():
    """Each hit-rate and TTFT target names the best any placement can do on the workload
    (bench/bounds.py); a limit beyond the bound is marked excluded."""

    def s(hit: float, mean: float, p90: float) -> dict[str, float]:
        return {"hit_rate": hit, "ttft_mean_s": mean, "ttft_p90_s": p90}

    pol = {
        "kvrouter": s(0.15, 1.0, 2.0),
        "sglang": s(0.17, 2.0, 4.0),
        "dynamo": s(0.10, 1.1, 2.5),
        "pooled_ideal": s(0.16, 0.6, 1.2),
    }
    bounds = {"hit_rate_upper": 0.16, "ttft_mean_lower_s": 0.7, "ttft_p90_lower_s": 1.5}
    t = peer_report.targets({"0.8": pol}, {}, peers.NAMES, True, bounds)
    hit = t["hit_rate >= best peer - 0.005"]
    assert hit["limit"] == pytest.approx(0.165) and not hit["met"]
    assert hit["bound"] == {"what": "hit_rate_upper", "value": 0.16, "excluded": True}
    mean = t["ttft_mean <= 0.85 * best peer"]
    assert mean["limit"] == pytest.approx(0.935) and mean["bound"]["value"] == 0.7
    assert not mean["bound"]["excluded"]
    p90 = t["ttft_p90 <= 0.9 * best peer"]
    assert p90["bound"]["value"] == 1.5 and not p90["bound"]["excluded"]
    pooled = t["ttft_mean <= 1.3 * pooled_ideal (conversation trace)"]
    assert pooled["limit"] == pytest.approx(0.78) and not pooled["bound"]["excluded"]
    bounds["ttft_mean_lower_s"] = 0.8  # the bound alone passes the limit
    t = peer_report.targets({"0.8": pol}, {}, peers.NAMES, True, bounds)
    assert t["ttft_mean <= 1.3 * pooled_ideal (conversation trace)"]["bound"]["excluded"]
    assert (
        "bound"
        not in peer_report.targets({"0.8": pol}, {}, peers.NAMES, True)[
            "ttft_p90 <= 0.9 * best peer"
        ]
    )


def test_workload_bounds_hold_for_every_policy_and_count_only_earlier_prompts(tmp_path, capsys):
    """The hit-rate bound credits a prompt only the prefix some earlier prompt shares (whole
    blocks, an unbounded cache); the TTFT bounds prefill the rest alone with nothing queued.
    No policy, pooled_ideal included, beats either on a run."""
    keys = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 9, 9], [7]]
    assert earlier_shared_prefix_units(keys) == [0, 3, 2, 0]
    got = workload_bounds(
        [(64, keys[0]), (64, keys[1]), (70, keys[2]), (16, keys[3])],
        unit=16,
        block_size=32,
        prefill_tokens_per_s=1000.0,
        max_num_batched_tokens=32,
        step_overhead_s=0.5,
        percentile=routing_bench.pct,
    )
    # hits: 0, 48 -> 32 (whole 32-token blocks), 32, 0 of 64 + 64 + 70 + 16 tokens
    assert got["hit_rate_upper"] == round(64 / 214, 4)
    lower = [0.064 + 2 * 0.5, 0.032 + 0.5, 0.038 + 2 * 0.5, 0.016 + 0.5]
    assert got["ttft_mean_lower_s"] == round(sum(lower) / 4, 4)
    assert got["ttft_p90_lower_s"] == round(max(lower), 4)

    routing_bench.main(
        [
            "--workload",
            "chat",
            "--scale",
            "0.05",
            "--speed",
            "2.0",
            "--workers",
            "3",
            "--gpu-blocks",
            "3000",
            "--policies",
            "round_robin,kvrouter,vllm_router_kv_aware,pooled_ideal",
            "--json",
            "--out",
            str(tmp_path / "c.png"),
        ]
    )
    out = _last_json(capsys)
    b = out["bounds"]
    for name, p in out["policies"].items():
        assert p["hit_rate"] <= b["hit_rate_upper"], name
        assert p["ttft_mean_s"] >= b["ttft_mean_lower_s"], name
        assert p["ttft_p90_s"] >= b["ttft_p90_lower_s"], name
    assert out["policies"]["pooled_ideal"]["hit_rate"] > 0.5 * b["hit_rate_upper"]
    assert out["targets"]["hit_rate >= best peer - 0.005"]["bound"]["what"] == "hit_rate_upper"


def test_a_prompt_resumes_an_earlier_one_when_it_shares_half_of_it():
    """Resuming is read from the requests alone: at least half of the prompt's tokens are a
    prefix some earlier prompt has; a later prompt never counts, nor a short shared head."""
    keys = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 9, 9, 9], [7, 8], [7, 8, 6, 6, 6]]
    prompts = [(64, keys[0]), (64, keys[1]), (64, keys[2]), (32, keys[3]), (80, keys[4])]
    # shared units: 0, 3, 1, 0, 2 -> tokens 0, 48, 16, 0, 32 of 64, 64, 64, 32, 80
    assert resumes_earlier(prompts, unit=16) == [False, True, False, False, False]
    assert resumes_earlier(prompts, unit=16, share=0.25) == [False, True, True, False, True]


def test_a_queueing_split_with_no_request_on_one_side_is_null_not_nan():
    run = routing_bench.RunResult(
        name="x", hit_rate=0.0, ttft=[1.0, 2.0], throughput_rps=1.0, imbalance=1.0,
        decision_ms=[0.1], completed=2, ttft_floor=[0.5, 0.5], ids=["a", "b"],
        resuming=frozenset(),
    )  # fmt: skip
    s = run.summary()
    assert s["queueing_resumed_s"] is None and s["queueing_fresh_s"] == 1.0
    assert s["resumed_requests"] == 0
    json.loads(json.dumps(s), parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))


def test_rounded_arrivals_spread_over_their_step_the_same_way_for_every_run(tmp_path, capsys):
    """``--trace-spread-s``: each arrival moves later by less than the spread, the requests are
    the same and in arrival order, the same seed spreads them the same way, 0 changes nothing,
    and the JSON says how the trace was read. A negative spread is a clear error."""
    reqs = [Req(f"r{i}", 3.0 * (i // 4), ((i, 32),), 32, 2) for i in range(40)]
    spread = spread_arrivals(reqs, 3.0, seed=5)
    assert sorted(r.rid for r in spread) == sorted(r.rid for r in reqs)
    assert [r.arrival_s for r in spread] == sorted(r.arrival_s for r in spread)
    before = {r.rid: r.arrival_s for r in reqs}
    assert all(0 <= r.arrival_s - before[r.rid] < 3.0 for r in spread)
    assert len({r.arrival_s for r in spread}) == 40  # no two at one instant any more
    assert spread == spread_arrivals(reqs, 3.0, seed=5)
    assert spread != spread_arrivals(reqs, 3.0, seed=6)
    assert spread_arrivals(reqs, 0.0) is reqs
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": 3000 * (i // 4),
                    "input_length": 600,
                    "output_length": 4,
                    "hash_ids": [i, i + 1000],
                }
            )
            + "\n"
            for i in range(24)
        )
    )
    common = ["--trace", str(trace), "--speed", "1", "--policies", "kvrouter", "--json"]
    routing_bench.main([*common, "--trace-spread-s", "3"])
    out = _last_json(capsys)
    assert out["config"]["trace_spread_s"] == 3.0
    assert out["policies"]["kvrouter"]["completed"] == 24
    with pytest.raises(SystemExit, match="trace-spread-s"):
        routing_bench.main([*common, "--trace-spread-s", "-1"])


def test_a_missed_mean_ttft_target_splits_floor_and_queueing():
    """A missed mean-TTFT target says how much of kvrouter's TTFT is its no-queueing floor at
    the hits it got and how much queueing, next to the queueing the limit allows and each
    peer's own queueing; a met target carries no split."""

    def s(hit: float, mean: float, p90: float, floor: float) -> dict[str, float]:
        return {"hit_rate": hit, "ttft_mean_s": mean, "ttft_p90_s": p90, "ttft_floor_s": floor}

    pol = {"kvrouter": s(0.15, 1.0, 2.0, 0.7), "dynamo": s(0.10, 1.1, 2.5, 0.75)}
    pol["kvrouter"] |= {"queueing_resumed_s": 0.6, "queueing_fresh_s": 0.2, "resumed_requests": 5}
    t = peer_report.targets({"0.8": pol}, {}, peers.NAMES, conversation_trace=False)
    q = t["ttft_mean <= 0.85 * best peer"]["queueing"]
    assert q == pytest.approx(
        {
            "floor_s": 0.7,
            "queueing_s": 0.3,
            "allowed_s": 0.235,
            "queueing_resumed_s": 0.6,
            "queueing_fresh_s": 0.2,
            "resumed_requests": 5,
            "dynamo_queueing_s": 0.35,
        }
    )
    pol["kvrouter"]["ttft_mean_s"] = 0.9
    t = peer_report.targets({"0.8": pol}, {}, peers.NAMES, conversation_trace=False)
    assert "queueing" not in t["ttft_mean <= 0.85 * best peer"]


def test_malformed_trace_line_names_the_line(tmp_path):
    trace = tmp_path / "bad.jsonl"
    good = '{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}'
    for bad, why in (
        ('{"timestamp": 5, "input_length": 600, "output_length": 3', "not JSON"),
        ('{"timestamp": 5, "output_length": 3, "hash_ids": [1]}', "input_length"),
        ('{"timestamp": 5, "input_length": -1, "output_length": 3, "hash_ids": [1]}', "input"),
        ('{"timestamp": 5, "input_length": 9, "output_length": 3, "hash_ids": "x"}', "hash_ids"),
        ("[1, 2, 3]", "JSON object"),
    ):
        trace.write_text(f"{good}\n\n{bad}\n{good}\n")
        with pytest.raises(TraceError, match=rf"bad\.jsonl: line 3: .*{why}"):
            mooncake(trace)
        with pytest.raises(SystemExit, match="line 3"):
            routing_bench.main(["--trace", str(trace), "--speed", "1"])


def test_a_trace_every_worker_refuses_is_a_clear_error(tmp_path):
    """Nothing to replay (every prompt past max_model_len): an error naming the limits and the
    flags that move them, not a crash in the capacity run."""
    trace = tmp_path / "long.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 2000, "output_length": 3, "hash_ids": [1, 2, 3, 4]}\n'
    )
    for extra in ([], ["--speed", "1"]):
        with pytest.raises(SystemExit, match=r"refused.*max_model_len 1024.*--max-model-len"):
            routing_bench.main(["--trace", str(trace), "--max-model-len", "1024", *extra])


def test_llm_d_scores_scraped_load_not_dispatches():
    """llm-d's queue and KV scores come from a scrape every 50 ms, never from its own
    dispatches: a burst of cold requests inside one interval sees the same load everywhere and
    is spread by the random tie-break alone; the next scrape sees the burst."""
    fs = routing_bench.FleetSpec(workers=4, gpu_blocks=2000)
    fleet = routing_bench.FastFleet(4, fs.engine())
    env = peers.PeerEnv(fleet, 16, 16, 256, routing_bench.MODEL, seed=1)
    p = peers.make("llm_d", env)
    src = TokenSource()
    keys = routing_bench.KeyCache(16)
    p.advance(0.0)
    chosen = []
    for i in range(40):
        req = Req(f"b{i}", 0.0, ((3_000_000 + i, 256),), 256, 4)
        toks = src.tokens(req)
        w = p.route(req.rid, toks, keys.get(req, toks)[0], 0.0)
        fleet.submit(w, req.rid, toks, 4, 0.0)
        chosen.append(w)
    assert p.waiting == [0, 0, 0, 0]  # nothing scraped since the burst began
    assert len(set(chosen)) == 4 and max(chosen.count(w) for w in range(4)) < 40
    p.advance(0.05)
    assert sum(p.waiting) + sum(len(e.running) for e in fleet.engines) == 40


def test_vllm_router_kv_aware_loses_blocks_to_any_groups_removal():
    """vllm-router keeps one set of hashes per worker: a sliding-window group's (or the CPU
    tier's) BlockRemoved deletes a hash the full-attention group still holds, breaking the
    prefix run; Dynamo's and llm-d's indexes keep only the full-attention group."""
    toks = list(range(100, 164))  # four 16-token blocks
    h = RequestHasher(16)
    h.extend(toks)
    hashes = h.event_hashes
    stored = [
        BlockStored(hashes, None, toks, 16, group_idx=0, kv_cache_spec_kind="full_attention"),
        BlockStored(hashes, None, toks, 16, group_idx=1, kv_cache_spec_kind="sliding_window"),
    ]
    swa_evicted = [BlockRemoved([hashes[1]], group_idx=1)]
    idx = peer_index.BlockHashSet(2)
    idx.apply(0, stored)
    assert idx.match(hashes, 0.0) == [4, 0]
    idx.apply(0, swa_evicted)
    assert idx.match(hashes, 0.0) == [1, 0]
    keys = routing_bench.KeyCache(16)
    kk = keys.index.prompt_keys(toks, keys.root)
    fa = peer_index.GroupFilteredIndex(
        2, 16, 256, routing_bench.MODEL, peer_index.full_attention_only
    )
    fa.apply(0, stored)
    fa.apply(0, swa_evicted)
    assert fa.match(kk, len(toks))[0][0] == 48  # the full-attention run (minus the last token)
