"""The router verifies its predictions against what workers report, and handles drift.

Real HTTP on loopback, simulated vLLM workers (subprocesses), real ZMQ events. Every wait polls
with a deadline. Misconfigurations: events off, a different chat template, a BOS-adding
tokenizer (prompt_tokens differ), events that lie about the block size, lost events without
replay, an unannounced cache reset; and a correct fleet under a multi-turn load with evictions
that must raise no alarm.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response
from test_router_support import config_for, serve_app, serve_router, until, words

from indexer.index import PrefixIndex
from router.cache_read import sequences
from router.config import Config, WorkerSpec
from router.verify import StreamUsageFilter, Verifier, VerifyParams, with_stream_usage
from simulator.testing import running_fleet

pytestmark = pytest.mark.timeout(180)

FAST = {"decode_ms": 1, "prefill_tps": 400000, "step_overhead_ms": 0.1}
VERIFY = {"window": 30, "min_samples": 12, "min_accuracy": 0.8, "selfcheck_timeout_s": 3.0}


def cfg_with(workers: list[Any], **sections: dict[str, Any]) -> Config:
    sections.setdefault("verify", {})
    sections["verify"] = {**VERIFY, **sections["verify"]}
    return config_for(workers, **sections)


async def debug_worker(c: httpx.AsyncClient, base: str, url: str) -> dict[str, Any]:
    d = (await c.get(base + "/debug/index")).json()
    return next(w for w in d["workers"] if w["url"] == url)


async def verify_of(c: httpx.AsyncClient, base: str, url: str) -> dict[str, Any]:
    return (await debug_worker(c, base, url))["engines"][0]["verify"]


async def repeat_prompts(c: httpx.AsyncClient, base: str, n: int, tag: str, size: int = 250):
    """``n`` requests: each prompt twice in a row (the second is a cache hit on the worker)."""
    for i in range(n):
        body = {"model": "sim-model", "prompt": words(size + 16 * (i % 3), f"{tag}{i // 2}")}
        r = await c.post(base + "/v1/completions", json={**body, "max_tokens": 1})
        assert r.status_code == 200, r.text


async def until_unverified(c, base, url, timeout=20.0) -> dict[str, Any]:
    async def unverified():
        v = await verify_of(c, base, url)
        return v if v["state"] == "unverified" else None

    return await until(unverified, timeout, f"{url} to become unverified")


# ------------------------------------------------------------------------- pure parts


def test_stream_usage_filter_is_byte_exact_under_any_chunking():
    events = [
        b'data: {"id":"x","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
        b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"h\xc3\xa9"},'
        b'"finish_reason":null}]}\n\n',
        b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"!"},'
        b'"finish_reason":"length"}]}\n\n',
    ]
    usage = (
        b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":7,"total_tokens":9,'
        b'"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":4}}}\n\n'
    )
    done = b"data: [DONE]\n\n"
    full = b"".join(events) + usage + done
    want = b"".join(events) + done
    rng = random.Random(7)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(full)), rng.randrange(0, 12)))
        parts = [full[a:b] for a, b in zip([0, *cuts], [*cuts, len(full)], strict=True)]
        f = StreamUsageFilter()
        out = [f.feed(p) for p in parts]
        got = b"".join(out) + f.flush()
        assert got == want
        assert f.usage == (4, 7)
        # Before a choice finished, every chunk passes through at once, unchanged.
        first_finish = full.index(b'"finish_reason":"')
        pos = 0
        for p, o in zip(parts, out, strict=True):
            if pos + len(p) <= first_finish:
                assert o == p
            pos += len(p)
    # A stream the router did not touch keeps its usage event (no filter there), and a body
    # that already asks for usage is sent unchanged.
    body = {"stream": True, "stream_options": {"include_usage": True}}
    assert with_stream_usage(body, b"orig") == (b"orig", False)
    data, strip = with_stream_usage({"stream": True, "prompt": "x"}, b"orig")
    assert strip and b'"stream_options":{"include_usage":true}' in data


def test_counters_going_back_reset_the_engine_once():
    from indexer.index import PrefixIndex
    from indexer.wire import BlockStored

    idx = PrefixIndex(unit=16)
    e = ("http://w", 0)
    idx.add_engine(e, "m")
    idx.apply(e, [BlockStored([1], None, list(range(16)), 16, None)])
    assert idx.resident_blocks(e) == 1
    v = Verifier(idx, VerifyParams())
    v.on_metrics("http://w", {0: {"prefix_hits": 10.0, "prefix_queries": 100.0}})
    v.on_metrics("http://w", {0: {"prefix_hits": 30.0, "prefix_queries": 200.0}})
    assert idx.resident_blocks(e) == 1 and v.state(e).metrics_hits == 20.0
    v.on_metrics("http://w", {0: {"prefix_hits": 0.0, "prefix_queries": 16.0}})  # restarted
    assert idx.resident_blocks(e) == 0
    assert v.debug(e)["index_resets"] == {"restart": 1}


def test_an_unknown_attention_chunk_under_counts_without_an_alarm():
    """Under-predictions on an engine with a chunked-attention group whose chunk the router was
    not told are the price of never over-crediting: no alarm, so the hits the index does see
    still route. Told the chunk, the same misses are a wrong index; over-predictions always are."""
    from indexer.wire import BlockStored

    engine = ("http://w", 0)
    for chunk, miss, expect_unverified in (
        (None, -512, False),
        (128, -512, True),
        (None, 512, True),
    ):
        index = PrefixIndex(unit=16, attention_chunk=chunk)
        index.add_engine(engine, "m")
        kind = "chunked_local_attention"
        index.apply(engine, [BlockStored([1], None, list(range(16)), 16, kv_cache_spec_kind=kind)])
        v = Verifier(index, VerifyParams(window=20, min_samples=10, min_accuracy=0.8))
        for _ in range(20):
            v.observe(
                engine,
                predicted_gpu=max(miss, 0),
                predicted_cpu=0,
                n_tokens=600,
                cached=max(-miss, 0),
                prompt_tokens=600,
            )
        assert v.is_unverified(engine) is expect_unverified, (chunk, miss)


# ------------------------------------------------------------------------- correct fleet


def test_races_the_events_show_are_not_wrong_predictions():
    """Round robin on small caches: a worker evicts a predicted prefix before it schedules the
    request (over-prediction) or a concurrent request computes one (under-prediction). When the
    engine's events show that churn since the decision, the index was right and no alarm may
    follow; the same mismatches with no churn are a wrong index."""
    for churn, expect_unverified in ((True, False), (False, True)):
        index = PrefixIndex()
        engine = ("http://w", 0)
        index.add_engine(engine, "m")
        v = Verifier(index, VerifyParams(window=20, min_samples=10, min_accuracy=0.8))
        for i in range(20):
            over = i % 2 == 0
            v.observe(
                engine,
                predicted_gpu=512 if over else 0,
                predicted_cpu=0,
                n_tokens=600,
                cached=0 if over else 512,
                prompt_tokens=600,
                removed_since=churn and over,
                stored_since=churn and not over,
            )
        assert v.is_unverified(engine) is expect_unverified, churn
    # Collapses (predicted a hit, the worker found nothing) in a row read as a reset vLLM did
    # not announce -- unless the engine's own BlockRemoved events explain them.
    for evicted, expect_reset in ((True, False), (False, True)):
        index = PrefixIndex()
        index.add_engine(engine, "m")
        v = Verifier(index, VerifyParams(reset_after_misses=3))
        for _ in range(3):
            v.observe(
                engine,
                predicted_gpu=512,
                predicted_cpu=0,
                n_tokens=600,
                cached=0,
                prompt_tokens=600,
                removed_since=evicted,
            )
        assert bool(v.debug(engine)["index_resets"]) is expect_reset, evicted


async def test_correct_fleet_under_multi_turn_load_raises_no_alarm(capsys):
    """120 requests of 12 four-way concurrent multi-turn chats (streaming with and without
    usage, and not), caches small enough to evict: no worker unverified, predictions exact."""
    with running_fleet(3, num_gpu_blocks=160, **FAST) as fleet:
        cfg = cfg_with(fleet)
        async with serve_router(cfg) as (base, _router), httpx.AsyncClient(timeout=60) as c:
            r = await c.get(base + "/ready")
            assert r.status_code == 200, r.text
            systems = [words(200, f"sys{k}") for k in range(3)]
            sem = asyncio.Semaphore(4)
            kinds = {"plain": 0, "stream": 0, "stream_usage": 0}

            async def conversation(i: int) -> None:
                msgs = [{"role": "system", "content": systems[i % 3]}]
                async with sem:
                    for turn in range(10):
                        msgs.append({"role": "user", "content": words(60, f"u{i}-{turn}")})
                        body: dict[str, Any] = {
                            "model": "sim-model",
                            "messages": msgs,
                            "max_tokens": 8,
                        }
                        kind = ("plain", "stream", "stream_usage")[(i + turn) % 3]
                        kinds[kind] += 1
                        if kind == "plain":
                            r = await c.post(base + "/v1/chat/completions", json=body)
                            assert r.status_code == 200, r.text
                            text = r.json()["choices"][0]["message"]["content"]
                        else:
                            body["stream"] = True
                            if kind == "stream_usage":
                                body["stream_options"] = {"include_usage": True}
                            async with c.stream(
                                "POST", base + "/v1/chat/completions", json=body
                            ) as r:
                                assert r.status_code == 200
                                raw = b"".join([x async for x in r.aiter_raw()])
                            assert raw.endswith(b"data: [DONE]\n\n")
                            # the usage event exactly when the client asked for it
                            assert (b'"usage"' in raw) == (kind == "stream_usage"), raw[-300:]
                            parts = re.findall(rb'"content":"([^"]*)"', raw)
                            text = b"".join(parts).decode()
                        msgs.append({"role": "assistant", "content": text})

            await asyncio.gather(*(conversation(i) for i in range(12)))
            d = (await c.get(base + "/debug/index")).json()
            samples = exact = within = 0
            for w in d["workers"]:
                assert w["selfcheck"]["events"] == "ok" and w["selfcheck"]["hits"] == "ok"
                assert not w["unverified"], w["engines"][0]["verify"]
                v = w["engines"][0]["verify"]
                samples += v["samples"]
                exact += v["exact"]
                within += round(v["accuracy"] * v["window"]) if v["window"] else 0
                assert v["accuracy"] is None or v["accuracy"] >= 0.9, v
                assert v["index_resets"] == {}, v
            assert samples == 120
            evicted = sum(
                e["counters"]["blocks_removed"] for w in d["workers"] for e in w["engines"]
            )
            assert evicted > 0  # the caches really turned over
            rate = exact / samples
            with capsys.disabled():
                print(
                    f"\n[verify] simulator fleet: {exact}/{samples} predictions exact "
                    f"({rate:.3f}); {evicted} blocks evicted; request kinds {kinds}"
                )
            assert rate >= 0.95
            m = (await c.get(base + "/metrics")).text
            for name in (
                "kvrouter_prediction_error_tokens_bucket",
                "kvrouter_worker_prediction_accuracy{",
                'kvrouter_predictions_total{result="exact"',
                "kvrouter_worker_unverified{",
            ):
                assert name in m.replace('{result="exact",worker', '{result="exact"'), name
            assert re.search(r"kvrouter_prediction_error_tokens_count 120\.0", m)


async def test_parallel_sampling_is_served_whole_and_left_out_of_verification():
    """``n`` > 1: vLLM runs a child per choice and reports the cached tokens of the child that
    ended last, which found the blocks the first one allocated: a fresh prompt "hits". Every
    choice comes back (streamed or not), no such request is taken as a sample of the index's
    accuracy (its figure says nothing about it), and n = 1 requests still are."""
    with running_fleet(1, **FAST) as fleet:
        async with serve_router(cfg_with(fleet)) as (base, _r), httpx.AsyncClient(timeout=60) as c:
            assert (await c.get(base + "/ready")).status_code == 200
            url = fleet[0].url
            before = (await verify_of(c, base, url))["samples"]
            reported = []
            for i in range(16):
                body = {"model": "sim-model", "prompt": words(250, f"par{i}"), "max_tokens": 3}
                body |= {"n": 4, "temperature": 0.8}
                if i % 2:
                    body |= {"stream": True, "stream_options": {"include_usage": True}}
                    async with c.stream("POST", base + "/v1/completions", json=body) as r:
                        assert r.status_code == 200
                        raw = b"".join([x async for x in r.aiter_raw()])
                    assert raw.endswith(b"data: [DONE]\n\n")
                    indexes = re.findall(rb'"index":(\d)', raw)
                    assert sorted(set(indexes)) == [b"0", b"1", b"2", b"3"], raw[:400]
                    assert len(indexes) == 4 * 3
                    usage = re.findall(rb'"cached_tokens":(\d+)', raw)
                    reported.append(int(usage[-1]))
                else:
                    r = await c.post(base + "/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    doc = r.json()
                    assert [ch["index"] for ch in doc["choices"]] == [0, 1, 2, 3]
                    assert doc["usage"]["completion_tokens"] == 12
                    reported.append(doc["usage"]["prompt_tokens_details"]["cached_tokens"])
            # A later child finds the blocks the first one allocated: fresh prompts report hits.
            assert min(reported) > 0, reported
            greedy = {"model": "sim-model", "prompt": "x", "n": 2, "temperature": 0}
            refused = await c.post(base + "/v1/completions", json=greedy)
            assert refused.status_code == 400 and "greedy" in refused.text, refused.text
            v = await verify_of(c, base, url)
            assert v["samples"] == before and v["state"] != "unverified", v
            await repeat_prompts(c, base, 4, "single")
            v = await verify_of(c, base, url)
            assert v["samples"] == before + 4 and v["accuracy"] == 1.0, v


async def test_a_batch_of_prompts_is_served_whole_and_left_out_of_verification():
    """A completion whose prompt is a list of prompts: vLLM runs each, sums their prompt tokens
    and reports the last prompt's cached tokens. The router routes by the first; taken as a
    sample, a cached first prompt and a fresh last one read as a collapse, and repeated they
    would clear the engine's index as an unannounced reset. None is a sample; each prompt's
    ``n`` children count in the engine's load."""
    with running_fleet(1, **FAST) as fleet:
        async with serve_router(cfg_with(fleet)) as (base, r), httpx.AsyncClient(timeout=60) as c:
            assert (await c.get(base + "/ready")).status_code == 200
            url = fleet[0].url
            head = words(250, "batch-head")
            warm = {"model": "sim-model", "prompt": head, "max_tokens": 1}
            assert (await c.post(base + "/v1/completions", json=warm)).status_code == 200
            await until(lambda: r.index.resident_blocks((url, 0)) >= 15, 10, "the head's events")
            before = await verify_of(c, base, url)
            for i in range(6):
                fresh = words(100, f"batch-tail{i}")
                body = {"model": "sim-model", "prompt": [head, fresh], "max_tokens": 2}
                if i % 2:
                    body |= {"n": 2, "temperature": 0.8}
                res = await c.post(base + "/v1/completions", json=body)
                assert res.status_code == 200, res.text
                doc = res.json()
                assert [ch["index"] for ch in doc["choices"]] == list(range(2 + 2 * (i % 2)))
                assert doc["usage"]["prompt_tokens"] == 350
            v = await verify_of(c, base, url)
            assert v["samples"] == before["samples"] and v["index_resets"] == {}, v
            assert r.index.resident_blocks((url, 0)) >= 15
            batch = {"model": "sim-model", "prompt": [head, "a b", "c d"], "n": 3}
            assert sequences(batch) == 9 and sequences({**batch, "prompt": [[1, 2]]}) == 3
            assert sequences({"prompt": [1, 2, 3], "n": 2}) == 2 and sequences({}) == 1


# ------------------------------------------------------------------------- misconfigurations


async def test_events_off_selfcheck_missing_then_unverified_no_events(caplog):
    caplog.set_level(logging.WARNING)
    with running_fleet(1, no_events=True, num_gpu_blocks=512, **FAST) as fleet:
        url = fleet[0].url
        async with (
            serve_router(cfg_with(fleet)) as (base, _router),
            httpx.AsyncClient(timeout=30) as c,
        ):
            # Obvious at once: /ready says why, the log says it once for the fleet.
            r = await c.get(base + "/ready")
            assert r.status_code == 503
            assert "events missing" in r.json()["reason"] and "no KV events" in r.json()["reason"]
            w = await debug_worker(c, base, url)
            assert w["selfcheck"]["events"] == "missing"
            assert any(
                "no worker passed the KV-event self-check" in x.getMessage() for x in caplog.records
            )
            # Traffic: the worker reports hits, the router predicted none.
            await repeat_prompts(c, base, 14, "noev", size=300)
            v = await until_unverified(c, base, url)
            assert v["cause"] == "no_events", v
            assert (await debug_worker(c, base, url))["unverified"] is True
            warnings = [x for x in caplog.records if "UNVERIFIED" in x.getMessage()]
            assert len(warnings) == 1 and "no_events" in warnings[0].getMessage()
            m = (await c.get(base + "/metrics")).text
            assert f'kvrouter_worker_unverified{{worker="{url}"}} 1.0' in m


async def test_a_worker_without_prefix_caching_is_named_as_such():
    """vLLM with prefix caching off (a flag, or forced off for the model: MLA on CPU) publishes
    no block event: the self-check says which flag, read from vllm:cache_config_info."""
    with running_fleet(1, no_prefix_caching=True, num_gpu_blocks=512, **FAST) as fleet:
        url = fleet[0].url
        async with (
            serve_router(cfg_with(fleet)) as (base, router),
            httpx.AsyncClient(timeout=30) as c,
        ):
            w = await debug_worker(c, base, url)
            assert router.registry.workers[url].prefix_caching is False
            assert w["selfcheck"]["events"] == "missing", w["selfcheck"]
            detail = w["selfcheck"]["events_detail"]
            assert "prefix caching is off" in detail and "--enable-prefix-caching" in detail


def _bos_proxy(target: str) -> FastAPI:
    """A worker front whose /tokenize adds a BOS token the engine itself does not add: the
    router's token count differs from the worker's prompt_tokens (a tokenizer mismatch)."""
    app = FastAPI()
    client = httpx.AsyncClient(base_url=target, timeout=30)

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def fwd(path: str, request: Request) -> Response:
        r = await client.request(
            request.method,
            "/" + path,
            content=await request.body(),
            headers={"content-type": "application/json"},
        )
        if path == "tokenize" and r.status_code == 200:
            doc = r.json()
            doc["tokens"] = [2, *doc["tokens"]]
            doc["count"] = len(doc["tokens"])
            return Response(
                content=httpx.Response(200, json=doc).content, media_type="application/json"
            )
        return Response(
            content=r.content, status_code=r.status_code, media_type=r.headers.get("content-type")
        )

    return app


async def test_tokens_differ_prompt_tokens_mismatch_is_diagnosed():
    with running_fleet(1, num_gpu_blocks=512, **FAST) as fleet:
        sim = fleet[0]
        async with serve_app(_bos_proxy(sim.url)) as front:
            cfg = cfg_with([front])
            cfg.workers = [
                WorkerSpec(url=front, events=sim.events_endpoint, replay=sim.replay_endpoint)
            ]
            # Forwarded ids would make the engine see the BOS too (no mismatch left to find):
            # the text must reach the engine for its own tokenization to differ.
            cfg.tokenizer.forward_ids = False
            async with serve_router(cfg) as (base, _r), httpx.AsyncClient(timeout=30) as c:
                await until(lambda: c.get(base + "/debug/index"), 10)
                await repeat_prompts(c, base, 14, "bos")
                v = await until_unverified(c, base, front)
                assert v["cause"] == "tokens_differ", v
                assert v["tokens_mismatches"] >= 12
                assert "prompt tokens" in v["cause_detail"]


async def test_different_chat_template_fails_the_tokenizer_selfcheck(caplog):
    caplog.set_level(logging.WARNING)
    with (
        running_fleet(2, num_gpu_blocks=256, **FAST) as good,
        running_fleet(1, chat_template="alt", num_gpu_blocks=256, **FAST) as alt,
    ):
        async with (
            serve_router(cfg_with([*good, *alt])) as (base, router),
            httpx.AsyncClient(timeout=30) as c,
        ):
            w = await debug_worker(c, base, alt[0].url)
            assert w["selfcheck"]["tokenizer"] == "mismatch", w["selfcheck"]
            assert "chat" in w["selfcheck"]["tokenizer_detail"]
            for g in good:
                assert (await debug_worker(c, base, g.url))["selfcheck"]["tokenizer"] == "remote"
            assert any("tokenizer mismatch" in x.getMessage() for x in caplog.records)
            # Drift on that worker is then attributed to the tokenizer.
            assert router.verifier is not None
            cause = router.verifier.diagnose(router.verifier.state((alt[0].url, 0)))
            assert cause[0] == "tokens_differ" and "self-check" in cause[1]


async def test_event_block_size_lie_is_diagnosed():
    with running_fleet(1, event_block_size_lie=32, num_gpu_blocks=512, **FAST) as fleet:
        url = fleet[0].url
        async with serve_router(cfg_with(fleet)) as (base, _r), httpx.AsyncClient(timeout=30) as c:
            w = await debug_worker(c, base, url)
            assert w["selfcheck"]["events"] == "unmatched", w["selfcheck"]
            assert w["selfcheck"]["hits"] == "mismatch"
            await repeat_prompts(c, base, 20, "lie")
            v = await until_unverified(c, base, url)
            assert v["cause"] == "block_size_mismatch", v
            assert (
                "block_size 32" in v["cause_detail"]
                and "gcd of cached_tokens: 16" in (v["cause_detail"])
            )


async def test_lost_events_without_replay_unverified_then_recovers():
    with running_fleet(1, num_gpu_blocks=512, **FAST) as fleet:
        sim = fleet[0]
        cfg = cfg_with(fleet)
        cfg.workers = [WorkerSpec(url=sim.url, events=sim.events_endpoint)]  # no replay
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            assert (await c.get(base + "/ready")).status_code == 200
            await c.post(sim.url + "/sim/faults", json={"drop_event_fraction": 0.5})
            await repeat_prompts(c, base, 24, "lost")
            v = await until_unverified(c, base, sim.url)
            assert v["cause"] == "lost_events", v
            assert "gaps" in v["cause_detail"]
            # While unverified it gets no prefix credit.
            body = {"model": "sim-model", "prompt": words(300, "credit")}
            await c.post(base + "/v1/completions", json={**body, "max_tokens": 1})
            e = (await c.post(base + "/debug/route", json=body)).json()
            assert e["workers"][0]["gpu_hit_tokens"] == 0
            # Events flow again: predictions recover, the worker is re-verified.
            await c.post(sim.url + "/sim/faults", json={"drop_event_fraction": 0.0})

            async def recovered():
                await repeat_prompts(c, base, 4, f"rec{random.random()}")
                v = await verify_of(c, base, sim.url)
                return v if v["state"] == "verified" else None

            v = await until(recovered, 60, "re-verification")
            assert v["recoveries"] == 1
            assert router.verifier is not None and not router.verifier.is_unverified((sim.url, 0))


async def test_unannounced_reset_clears_the_index_for_that_worker():
    with running_fleet(1, num_gpu_blocks=512, **FAST) as fleet:
        url = fleet[0].url
        async with (
            serve_router(cfg_with(fleet)) as (base, router),
            httpx.AsyncClient(timeout=30) as c,
        ):
            prompts = [words(300, f"reset{i}") for i in range(4)]
            for p in prompts:
                r = await c.post(
                    base + "/v1/completions",
                    json={"model": "sim-model", "prompt": p, "max_tokens": 1},
                )
                assert r.status_code == 200

            async def indexed():
                e = (
                    await c.post(
                        base + "/debug/route", json={"model": "sim-model", "prompt": prompts[-1]}
                    )
                ).json()
                return e["workers"][0]["gpu_hit_tokens"] >= 288

            await until(indexed, 20, "prompts indexed")
            r = await c.post(url + "/sim/faults", json={"unannounced_reset": True})
            assert r.status_code == 200
            for p in prompts[:3]:
                r = await c.post(
                    base + "/v1/completions",
                    json={"model": "sim-model", "prompt": p, "max_tokens": 1},
                )
                assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            v = await verify_of(c, base, url)
            assert v["index_resets"] == {"unannounced_reset": 1}, v
            assert "without AllBlocksCleared" in v["last_reset"]
            # The stale prefix is gone from the index; what the worker really holds is back.
            e = (
                await c.post(
                    base + "/debug/route", json={"model": "sim-model", "prompt": prompts[3]}
                )
            ).json()
            assert e["workers"][0]["gpu_hit_tokens"] == 0
            m = (await c.get(base + "/metrics")).text
            assert re.search(r'kvrouter_index_resets_total\{[^}]*reason="unannounced_reset"', m)
            assert router.verifier is not None and not router.verifier.is_unverified((url, 0))


async def test_fleet_tokenizing_prompts_differently_gets_text_not_ids():
    """A worker whose tokenizer differs (another vocabulary) fails the prompt probe; then no
    worker's /tokenize ids are sent to any worker (another may answer /tokenize), only text."""
    with (
        running_fleet(1, num_gpu_blocks=256, **FAST) as good,
        running_fleet(1, vocab_size=50000, num_gpu_blocks=256, **FAST) as other,
    ):
        async with (
            serve_router(cfg_with([*good, *other])) as (base, router),
            httpx.AsyncClient(timeout=30) as c,
        ):

            async def both_checked() -> bool:
                for w in (*good, *other):
                    sc = (await debug_worker(c, base, w.url)).get("selfcheck") or {}
                    if sc.get("tokenizer") not in ("remote", "mismatch"):
                        return False
                return len(router.selfcheck.fingerprints) == 2  # type: ignore[union-attr]

            await until(both_checked, 20, "both workers self-checked")
            assert not router.ids_portable()

            async def forms() -> list[dict[str, int]]:
                return [
                    (await c.get(w.url + "/sim/state")).json()["prompt_forms"]
                    for w in (*good, *other)
                ]

            before = await forms()  # (the self-check's own probes are sent as ids)
            body = {"model": "sim-model", "prompt": words(100, "vocab"), "max_tokens": 1}
            for _ in range(4):
                r = await c.post(base + "/v1/completions", json=body)
                assert r.status_code == 200
            after = await forms()
            assert sum(a["ids"] - b["ids"] for a, b in zip(after, before, strict=True)) == 0
            assert sum(a["text"] - b["text"] for a, b in zip(after, before, strict=True)) == 4
