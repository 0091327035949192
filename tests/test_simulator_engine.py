"""Unit tests of the simulator core: hashing, tokenizer, block pool, hybrid hit rules,
CPU tier, timing, and the fast in-process fleet API used by the routing benchmark."""

from __future__ import annotations

import random
import time
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.block_pool import BlockPool
from simulator.engine import EngineConfig, SimEngine
from simulator.events import encode_batch
from simulator.fleet import FastFleet
from simulator.hashing import NONE_HASH, RequestHasher, hash_block_tokens, to_event_hash
from simulator.kv_cache import parse_groups
from simulator.tokenizer import Tokenizer


def _drain(eng: SimEngine, now: float = 0.0) -> tuple[float, list[list[dict[str, Any]]]]:
    enc = msgspec.msgpack.Encoder()
    batches = []
    while eng.has_work():
        now = max(now, eng.next_step_time(now))
        now = eng.schedule(now)
        out = eng.finish_step()
        if out.events:
            batches.append(msgspec.msgpack.decode(enc.encode(out.events)))
    return now, batches


# ---- hashing / tokenizer ------------------------------------------------------------------
def test_hash_test_vectors() -> None:
    assert NONE_HASH.hex().startswith("066b1e89") and NONE_HASH.hex().endswith("d71198")
    h0 = hash_block_tokens(None, list(range(16)))
    h1 = hash_block_tokens(h0, list(range(16, 32)))
    assert to_event_hash(h0) == 3262291359910021016
    assert to_event_hash(h1) == 7142137847444424233
    rh = RequestHasher(16)
    assert rh.extend(list(range(40))) == 2
    assert rh.event_hashes == [3262291359910021016, 7142137847444424233]


def test_salt_and_lora_change_hashes() -> None:
    toks = list(range(64))
    plain, salted, lora = (
        RequestHasher(16),
        RequestHasher(16, cache_salt="s"),
        RequestHasher(16, lora_name="ad"),
    )
    for h in (plain, salted, lora):
        h.extend(toks)
    assert salted.event_hashes[0] != plain.event_hashes[0]
    assert all(a != b for a, b in zip(plain.event_hashes, salted.event_hashes, strict=True))
    assert all(a != b for a, b in zip(plain.event_hashes, lora.event_hashes, strict=True))
    assert salted.event_extra_keys(0) == ("s",) and salted.event_extra_keys(1) is None
    assert lora.event_extra_keys(3) == ("ad",)


def test_tokenizer_matches_capture_template_shape() -> None:
    t = Tokenizer()
    ids = t.encode_chat(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello router"}]
    )
    nl = t.encode("\n")[0]
    assert ids[:3] == [2, 4, nl] and ids[-4:] == [7, nl, 6, nl]
    assert t.encode_chat(
        [{"role": "user", "content": "hello router"}], add_generation_prompt=False
    )[-2:] == [7, nl]
    assert t.token_strs("hello router") == ["hello", "\u0120router"]
    assert t.encode("hello router") == Tokenizer().encode("hello router")  # stable
    alt = Tokenizer(template="alt")
    assert alt.encode_chat([{"role": "user", "content": "x"}]) != t.encode_chat(
        [{"role": "user", "content": "x"}]
    )
    assert t.decode(t.encode("hello router, cache!")) == "hello router, cache!"


def test_parse_groups() -> None:
    g = parse_groups("full,swa:64,mamba")
    assert [x.kind for x in g] == ["full_attention", "sliding_window", "mamba"]
    assert g[1].sliding_window == 64
    (c, f) = parse_groups("chunked:128@32,full")
    assert (c.kind, c.attention_chunk, c.block_size, f.kind) == (
        "chunked_local_attention",
        128,
        32,
        "full_attention",
    )
    for bad in ("", "swa", "foo", "swa:x", "chunked", "chunked:0", "chunked:x"):
        with pytest.raises(ValueError):
            parse_groups(bad)


# ---- block pool ------------------------------------------------------------------------------
def test_pool_lru_and_reset_rules() -> None:
    pool = BlockPool(5)
    a = pool.get_new_blocks(2)
    pool.cache_block(a[0], (b"h0" * 16, 0))
    pool.cache_block(a[1], (b"h1" * 16, 0))
    assert not pool.reset_prefix_cache()  # blocks in use: refused, no event
    assert pool.take_events() == []
    pool.free_blocks(a[::-1])  # tail first
    assert pool.get_cached_block((b"h0" * 16, 0)) == a[0]  # freed but still hit-able
    got = pool.get_new_blocks(3)  # 2 never-hashed blocks first, then the LRU tail block
    ev = pool.take_events()
    assert len(ev) == 1 and ev[0].block_hashes == [to_event_hash(b"h1" * 16)]
    assert a[1] in got
    pool.free_blocks(got)
    assert pool.reset_prefix_cache()
    assert [type(e).__name__ for e in pool.take_events()] == ["AllBlocksCleared"]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.integers(1, 120), st.integers(1, 6)),
        min_size=1,
        max_size=25,
    )
)
def test_engine_accounting_invariants(reqs: list[tuple[int, int, int]]) -> None:
    """Whatever the traffic: blocks are conserved, stores and removes balance per key."""
    eng = SimEngine(
        EngineConfig(
            block_size=8, num_gpu_blocks=40, groups="full,swa:16", max_num_batched_tokens=64
        )
    )
    live: dict[tuple[int, int], int] = {}
    now = 0.0
    for i, (prefix, n, mt) in enumerate(reqs):
        toks = [1000 + prefix] * 8 + [2000 + i] * n
        try:
            eng.add_request(f"r{i}", toks, mt, now)
        except ValueError:
            continue
        now, batches = _drain(eng, now)
        for b in batches:
            for e in b:
                if e["type"] == "BlockStored":
                    for h in e["block_hashes"]:
                        live[(e["group_idx"], h)] = live.get((e["group_idx"], h), 0) + 1
                elif e["type"] == "BlockRemoved":
                    k = (e["group_idx"], e["block_hashes"][0])
                    assert live.get(k, 0) > 0
                    live[k] -= 1
    pool = eng.kv.pool
    assert pool.num_free() == pool.num_blocks - 1
    assert sum(live.values()) == pool.num_cached_blocks()


# ---- hybrid hit rules ----------------------------------------------------------------------
def test_swa_hit_survives_head_eviction_and_mamba_needs_boundary_state() -> None:
    cfg = EngineConfig(
        block_size=16, num_gpu_blocks=200, groups="full,swa:32", retention_interval=None
    )
    eng = SimEngine(cfg)
    toks = list(range(100, 100 + 161))  # 10 full blocks + 1
    eng.add_request("a", toks, 1, 0.0)
    now, _ = _drain(eng)
    eng.add_request("b", toks, 1, now)
    now, _ = _drain(eng, now)
    assert eng.kv.pool.num_free() == 199
    # a fresh request with the same prompt hits the whole prefix (160 tokens)
    req = eng.add_request("c", toks, 1, now)
    hit, _, _ = eng.kv.find_hit(req)
    assert hit == 160
    eng.abort("c")
    m = SimEngine(EngineConfig(block_size=16, num_gpu_blocks=200, groups="full,mamba"))
    m.add_request("a", toks, 1, 0.0)
    _drain(m)
    r2 = m.add_request("b", toks[:120] + [7] * 50, 1, 10.0)
    hit, _, longest = m.kv.find_hit(r2)
    # FA would hit 7 blocks but mamba only kept the state at the replay boundary (block 10)
    assert longest == 112 and hit == 0


def test_sparse_swa_lists_only_reachable_blocks() -> None:
    eng = SimEngine(EngineConfig(block_size=32, num_gpu_blocks=72, groups="swa:64,full"))
    eng.add_request("a", list(range(200, 410)), 2, 0.0)
    _, batches = _drain(eng)
    swa, fa = batches[0]
    assert swa["kv_cache_spec_kind"] == "sliding_window"
    assert swa["kv_cache_spec_sliding_window"] == 64
    assert len(swa["token_ids"]) == 192 and len(swa["block_hashes"]) == 2
    assert swa["block_hashes"] == fa["block_hashes"][4:6]
    assert "kv_cache_spec_sliding_window" not in fa


def test_mixed_group_block_sizes() -> None:
    """full@16 + mamba@64: hashes at gcd=16, group blocks take the tail hash at their
    boundary, hits align to lcm=64 (vLLM resolve_kv_cache_block_sizes)."""
    eng = SimEngine(
        EngineConfig(
            block_size=16, num_gpu_blocks=300, groups="full@16,mamba@64", retention_interval=None
        )
    )
    toks = list(range(1000, 1000 + 300))
    eng.add_request("a", toks, 1, 0.0)
    now, batches = _drain(eng)
    fa, mb = batches[0]
    assert fa["block_size"] == 16 and mb["block_size"] == 64
    assert len(fa["block_hashes"]) == 18 and len(mb["block_hashes"]) == 4
    assert mb["block_hashes"] == [fa["block_hashes"][i] for i in (3, 7, 11, 15)]
    assert len(mb["token_ids"]) == 256 and mb["kv_cache_spec_kind"] == "mamba"
    req = eng.add_request("b", toks[:200] + [5] * 40, 1, now)
    hit, per_group, _ = eng.kv.find_hit(req)
    assert hit == 192 and len(per_group[0]) == 12 and per_group[1][:2] == [0, 0]


# ---- CPU tier ----------------------------------------------------------------------------------
def _offloaded(prompt: list[int], load_tps: float) -> tuple[SimEngine, float, list]:
    """An engine with a small GPU and a 16-chunk CPU tier (64-token chunks) that computed
    ``prompt`` (so its chunks were offloaded), then had it flushed off the GPU by others."""
    cfg = EngineConfig(
        block_size=16,
        num_gpu_blocks=40,
        cpu_chunks=16,
        cpu_chunk_tokens=64,
        cpu_events="self_describing",
        cpu_load_tokens_per_s=load_tps,
    )
    eng = SimEngine(cfg)
    eng.add_request("a", prompt, 1, 0.0)
    now, first = _drain(eng)
    for i in range(3):  # flush the GPU with other prompts
        eng.add_request(f"x{i}", [5000 + i] * 200 + list(range(i, i + 57)), 1, now)
        now, _ = _drain(eng, now)
    return eng, now, first


def test_cpu_tier_extends_hit_and_costs_load_time() -> None:
    base = list(range(300, 300 + 257))
    eng, now, b1 = _offloaded(base, 1000.0)
    cpu = [e for b in b1 for e in b if e.get("medium") == "CPU"]
    assert len(cpu) == 4 and all(e["block_size"] == 16 and len(e["token_ids"]) == 64 for e in cpu)
    eng.add_request("again", base, 1, now)
    t0 = now
    r = eng.requests["again"]
    now, _ = _drain(eng, now)
    assert r.cpu_loaded_tokens > 0 and r.cached_tokens + r.cpu_loaded_tokens <= 256
    assert r.first_token_s is not None and r.first_token_s - t0 >= r.cpu_loaded_tokens / 1000.0


# ---- fast fleet --------------------------------------------------------------------------------
def test_fleet_api_and_timing() -> None:
    cfg = EngineConfig(
        block_size=16, num_gpu_blocks=2000, prefill_tokens_per_s=10000.0, decode_s_per_token=0.01
    )
    fleet = FastFleet(2, cfg)
    prompt = list(range(1000, 3000))
    fleet.submit(0, "cold", prompt, 4, 0.0)
    fleet.submit(0, "warm", [*prompt, 1], 4, 5.0)
    fleet.submit(1, "other", [*prompt, 1], 4, 5.0)
    assert fleet.next_event_time() == 0.0
    fleet.run_until(1.0)
    assert fleet.load(0).running == 0
    fleet.run_until(100.0)
    done = {c.request_id: c for c in fleet.completed()}
    assert set(done) == {"cold", "warm", "other"}
    cold, warm, other = done["cold"], done["warm"], done["other"]
    assert cold.cached_tokens == 0 and warm.cached_tokens == 2000
    assert other.worker_idx == 1 and other.cached_tokens == 0
    ttft = {k: v.first_token_s - v.arrival_s for k, v in done.items()}
    assert ttft["cold"] > 0.19 and ttft["warm"] < 0.01 and ttft["other"] > 0.19
    assert cold.finish_s > cold.first_token_s
    ev = fleet.drain_events()
    assert [e[2] for e in ev if e[0] == 0] == list(range(sum(1 for e in ev if e[0] == 0)))


def test_fleet_events_are_vllm_payloads() -> None:
    fleet = FastFleet(1, EngineConfig(block_size=16, num_gpu_blocks=64))
    fleet.submit(0, "a", list(range(40)), 1, 0.0)
    fleet.run_until(10.0)
    ((w, rank, seq, payload),) = fleet.drain_events()
    assert (w, rank, seq) == (0, 0, 0)
    ts, events, dp = msgspec.msgpack.decode(payload)
    assert dp == 0 and events[0]["type"] == "BlockStored"
    assert events[0]["block_hashes"] == [3262291359910021016, 7142137847444424233]
    assert encode_batch(ts, [], 0) != payload


def test_fleet_queueing_shows_in_ttft_and_load() -> None:
    cfg = EngineConfig(
        block_size=16,
        num_gpu_blocks=5000,
        prefill_tokens_per_s=10000.0,
        max_num_batched_tokens=2048,
    )
    fleet = FastFleet(1, cfg)
    for i in range(5):
        fleet.submit(0, f"r{i}", [10000 + i] * 4000, 2, 0.0)
    fleet.run_until(0.0)
    ld = fleet.load(0)
    assert ld.running + ld.waiting == 5 and ld.queued_prefill_tokens > 0 and ld.kv_usage > 0
    fleet.run_until(60.0)
    ttfts = sorted(c.first_token_s for c in fleet.completed())
    assert ttfts[-1] > 1.9  # 20k tokens at 10k tok/s: the last one waited


def test_fleet_replay_speed() -> None:
    """10,000 requests with shared prefixes replay in seconds."""
    rng = random.Random(1)
    prefixes = [
        [rng.randrange(100, 30000) for _ in range(rng.choice([256, 1024, 2048]))] for _ in range(30)
    ]
    fleet = FastFleet(
        4, EngineConfig(block_size=32, num_gpu_blocks=20000, max_num_batched_tokens=8192)
    )
    t0 = time.perf_counter()
    t = 0.0
    n = 10_000
    for i in range(n):
        t += rng.expovariate(200.0)
        toks = prefixes[rng.randrange(30)] + [
            rng.randrange(100, 30000) for _ in range(rng.randrange(20, 200))
        ]
        fleet.run_until(t)
        fleet.submit(i % 4, f"r{i}", toks, 8, t)
        fleet.drain_events()
    fleet.run_until(t + 1000)
    done = fleet.completed()
    elapsed = time.perf_counter() - t0
    assert len(done) == n
    assert sum(c.cached_tokens for c in done) > 0.5 * sum(c.prompt_tokens for c in done)
    assert elapsed < 60, elapsed


@settings(max_examples=30, deadline=None)
@given(
    groups=st.sampled_from(
        [
            "full",
            "full,swa:16",
            "swa:24,full",
            "full,mamba",
            "full,mamba@16",
            "swa:24@16,full",
            "chunked:32,full",
        ]
    ),
    cpu=st.sampled_from([0, 4]),
    reqs=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 150), st.integers(1, 12), st.floats(0, 0.05)),
        min_size=1,
        max_size=30,
    ),
)
def test_fleet_concurrent_invariants(
    groups: str, cpu: int, reqs: list[tuple[int, int, int, float]]
) -> None:
    """Concurrent traffic on a tiny pool (preemption, chunked prefill, early SWA and chunk
    frees, CPU tier): every request completes, stores/removes balance, the pool drains."""
    if "@" in groups or "chunked" in groups:
        cpu = 0  # a CPU tier needs one block size for all groups; none for chunked attention
    cfg = EngineConfig(
        block_size=8,
        num_gpu_blocks=48,
        groups=groups,
        max_num_batched_tokens=48,
        max_num_seqs=6,
        cpu_chunks=cpu,
        cpu_chunk_tokens=16,
        prefill_tokens_per_s=5000.0,
    )
    fleet = FastFleet(1, cfg)
    t = 0.0
    n = 0
    for i, (prefix, ln, mt, dt) in enumerate(reqs):
        t += dt
        toks = [500 + prefix] * 16 + [1000 + i] * ln
        try:
            fleet.submit(0, f"r{i}", toks, mt, t)
            n += 1
        except ValueError:
            pass
    fleet.run_until(1e6)
    assert len(fleet.completed()) == n
    live: dict[tuple[str, int, int], int] = {}
    for _, _, _, payload in fleet.drain_events():
        for e in msgspec.msgpack.decode(payload)[1]:
            if e["type"] == "BlockStored":
                for h in e["block_hashes"]:
                    k = (e["medium"], e["group_idx"], h)
                    live[k] = live.get(k, 0) + 1
            elif e["type"] == "BlockRemoved":
                for h in e["block_hashes"]:
                    k = (e["medium"], e["group_idx"], h)
                    assert live.get(k, 0) > 0, k
                    live[k] -= 1
    eng = fleet.engines[0]
    pool = eng.kv.pool
    assert pool.num_free() == pool.num_blocks - 1 and not eng.running and not eng.waiting
    gpu_live = sum(v for k, v in live.items() if k[0] == "GPU")
    assert gpu_live == pool.num_cached_blocks()
    if eng.cpu is not None:
        cpu_live = sum(v for k, v in live.items() if k[0] == "CPU")
        assert cpu_live == sum(1 for ch in eng.cpu.lru.values() if ch.ready)


def test_fleet_dp_ranks() -> None:
    fleet = FastFleet(2, EngineConfig(block_size=16, num_gpu_blocks=256), dp_size=2)
    for i in range(4):
        fleet.submit(1, f"r{i}", [100 + i] * 64, 2, 0.0)
    fleet.run_until(10.0)
    ev = fleet.drain_events()
    assert {(w, r) for w, r, _, _ in ev} == {(1, 0), (1, 1)}
    for _, r, _, payload in ev:
        assert msgspec.msgpack.decode(payload)[2] == r
    assert sorted(s for w, r, s, _ in ev if r == 1) == list(range(sum(1 for e in ev if e[1] == 1)))
    assert len(fleet.completed()) == 4 and fleet.load(1).running == 0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 80), st.sampled_from([None, "s"])),
        min_size=1,
        max_size=8,
    )
)
def test_hasher_memos_never_change_hashes(specs: list[tuple[int, int, str | None]]) -> None:
    """Shared-prefix adoption and the block memo give exactly the plain chain."""
    bases = [[7] * 40 + list(range(100)), [7] * 40 + list(range(50, 150)), list(range(300))]
    for which, cut, salt in specs:
        toks = bases[which][: 20 + cut] + [9000 + cut] * (cut % 17)
        h = RequestHasher(8, cache_salt=salt)
        h.extend(toks)
        parent = None
        for i in range(len(toks) // 8):
            extra = (("cache_salt", salt),) if salt is not None and i == 0 else None
            parent = hash_block_tokens(parent, toks[i * 8 : (i + 1) * 8], extra)
            assert h.digests[i] == parent
        assert len(h.digests) == len(toks) // 8


def test_cpu_lookup_follows_offloading_connector_rules() -> None:
    """vLLM: whole chunks of the request (n // chunk), contiguous from gpu_hit // chunk, at least
    one whole chunk gained; a load reaching the prompt's end recomputes the last token."""
    base = list(range(300, 300 + 256))  # exactly 4 chunks
    eng, now, _ = _offloaded([*base, 7], 1e6)
    eng.add_request("again", base, 1, now)
    req = eng.requests["again"]
    req.hasher.extend(req.all_token_ids)  # what the engine does at the first schedule
    assert eng.cpu is not None
    assert eng.cpu.lookup(req, 0) == 256  # n // chunk, not (n - 1) // chunk
    assert eng.cpu.lookup(req, 192) == 64
    assert eng.cpu.lookup(req, 224) == 0, "32 tokens < one chunk: nothing is loaded"
    now, _ = _drain(eng, now)
    assert req.cached_tokens + req.cpu_loaded_tokens == 255  # the last token is recomputed


def test_a_loaded_request_behind_a_head_that_cannot_fit_still_runs() -> None:
    """A request whose CPU load holds GPU blocks, queued behind one that needs more blocks than
    are free (a preempted request goes back to the queue's front): the head waits for blocks
    only the loaded request's completion frees, so the loaded one must go past it. Stopping
    the scan at the head leaves nothing running and the engine stepping empty forever."""
    base = list(range(300, 300 + 257))
    eng, now, _ = _offloaded(base, 1e6)
    eng.add_request("again", base, 1, now)
    now = eng.schedule(max(now, eng.next_step_time(now)))  # its CPU load starts: holds blocks
    eng.finish_step()
    loaded = eng.requests["again"]
    assert loaded.cpu_loaded_tokens > 0 and any(loaded.blocks)
    eng.add_request("big", list(range(9000, 9000 + 470)), 1, now)
    big = eng.requests["big"]
    eng.waiting.remove(big)
    eng.waiting.appendleft(big)  # where _preempt puts a preempted request
    assert eng.kv.blocks_for_tokens(470) > eng.kv.pool.num_free()
    later = [9500 + i for i in range(40)]
    eng.add_request("later", later, 1, now)  # holds nothing: waits behind the head, FCFS
    behind = eng.requests["later"]
    for _ in range(200):
        if not eng.has_work():
            break
        now = eng.schedule(max(now, eng.next_step_time(now)))
        eng.finish_step()
    assert not eng.has_work(), f"stuck: waiting {[r.request_id for r in eng.waiting]}"
    assert loaded.first_token_s < big.first_token_s <= behind.first_token_s


def test_preempted_request_reports_its_first_admission_hit() -> None:
    """vLLM sets num_cached_tokens once: a request preempted after computing its prompt is
    re-admitted, finds its own freed blocks cached, and still reports the first hit (0 here)."""
    cfg = EngineConfig(
        block_size=8,
        num_gpu_blocks=10,
        max_num_batched_tokens=64,
        max_num_seqs=2,
        prefill_tokens_per_s=1e6,
    )
    fleet = FastFleet(1, cfg)
    eng = fleet.engines[0]
    preempted: list[str] = []
    readmit_hits: list[int] = []
    orig_preempt, orig_first = eng._preempt, eng._first_schedule

    def preempt(req: Any) -> None:
        preempted.append(req.request_id)
        orig_preempt(req)

    def first_schedule(req: Any, now: float) -> bool:
        ok = orig_first(req, now)
        if req.request_id in preempted:
            readmit_hits.append(req.cached_tokens)
        return ok

    eng._preempt = preempt  # type: ignore[method-assign]
    eng._first_schedule = first_schedule  # type: ignore[method-assign]
    fleet.submit(0, "a", list(range(100, 124)), 30, 0.0)
    fleet.submit(0, "b", list(range(200, 224)), 30, 0.0)
    fleet.run_until(1e6)
    done = {c.request_id: c for c in fleet.completed()}
    assert preempted and readmit_hits and max(readmit_hits) >= 24  # its own prompt, cached
    victim = preempted[0]
    assert done[victim].cached_tokens == 0  # what its first admission found
    assert done[victim].output_tokens == 30
