"""``kvrouter demo``: a simulated 4-worker fleet, the router, and a multi-turn chat load.

The same load (seeded) runs twice on a fresh fleet each time: once through kvrouter's policy
and once round-robin. Workers are the simulator (``kvrouter-sim`` subprocess, loopback only)
with a KV cache too small to hold every shared system prompt on every worker, so round-robin
thrashes while cache-aware routing keeps each prompt family on a few workers.

Hit rate = sum of the workers' ``usage.prompt_tokens_details.cached_tokens`` / prompt tokens;
TTFT = time to the first SSE chunk that carries generated text.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from kvrouter.progress import Progress
from router.app import create_apps
from router.config import Config, WorkerSpec
from router.serving import bound_port, build_servers, wait_started
from simulator.testing import WorkerInfo, running_fleet

FLEET_FLAGS: dict[str, Any] = {
    "num_gpu_blocks": 256,  # 4096 tokens per worker: not enough for all system prompts
    "prefill_tps": 5000,  # 1k uncached tokens = 200 ms of prefill
    "decode_ms": 4,
    "step_overhead_ms": 0.5,
    "max_num_batched_tokens": 4096,
}
N_SYSTEM_PROMPTS = 8
SYSTEM_TOKENS = 900
MAX_TOKENS = 12
TURNS = 4


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(10**8)}" for _ in range(n))


class Load:
    """Conversations over shared system prompts; each turn extends the previous prompt."""

    def __init__(self, seed: int = 7) -> None:
        rng = random.Random(seed)
        self.systems = [_words(rng, SYSTEM_TOKENS) for _ in range(N_SYSTEM_PROMPTS)]
        self.seed = seed

    def conversation(self, i: int) -> tuple[str, random.Random]:
        rng = random.Random(self.seed * 100_003 + i)
        return self.systems[rng.randrange(N_SYSTEM_PROMPTS)], rng


async def _one(
    client: httpx.AsyncClient, url: str, messages: list[dict[str, str]]
) -> dict[str, Any]:
    body = {
        "model": "sim-model",
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = None
    text = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"error": r.status_code}
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            d = json.loads(line[6:])
            for ch in d.get("choices") or []:
                content = (ch.get("delta") or {}).get("content")
                if content:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(content)
            if d.get("usage"):
                usage = d["usage"]
    return {
        "ttft": ttft if ttft is not None else time.perf_counter() - t0,
        "prompt": usage.get("prompt_tokens", 0),
        "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        "text": "".join(text),
    }


async def run_load(
    url: str, load: Load, duration: float, concurrency: int, label: str, progress: Progress
) -> dict[str, float]:
    results: list[dict[str, Any]] = []
    errors = 0
    t_start = time.perf_counter()
    deadline = t_start + duration
    next_conv = 0

    async def user(client: httpx.AsyncClient) -> None:
        nonlocal next_conv, errors
        while time.perf_counter() < deadline:
            i = next_conv
            next_conv += 1
            system, rng = load.conversation(i)
            msgs = [{"role": "system", "content": system}]
            for _ in range(TURNS):
                if time.perf_counter() >= deadline:
                    return
                msgs.append({"role": "user", "content": _words(rng, rng.randrange(20, 60))})
                res = await _one(client, url, msgs)
                if "error" in res:
                    errors += 1
                    break
                results.append(res)
                msgs.append({"role": "assistant", "content": res["text"]})

    async def report() -> None:
        while True:
            await asyncio.sleep(0.5)
            el = time.perf_counter() - t_start
            detail = f"{el:4.1f}/{duration:.0f} s, {len(results)} requests, {errors} errors"
            progress.update(label, el / duration, detail)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        reporter = asyncio.create_task(report())
        await asyncio.gather(*(user(client) for _ in range(concurrency)))
        reporter.cancel()
    elapsed = time.perf_counter() - t_start
    progress.update(label, 1.0, f"{elapsed:4.1f} s, {len(results)} requests, {errors} errors")
    ttfts = sorted(r["ttft"] for r in results)
    prompt = sum(r["prompt"] for r in results)
    cached = sum(r["cached"] for r in results)

    def pct(p: float) -> float:
        if not ttfts:
            return float("nan")
        return ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))]

    return {
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "ttft_p50_s": round(pct(0.50), 4),
        "ttft_p99_s": round(pct(0.99), 4),
        "requests_per_s": round(len(results) / elapsed, 2),
        "requests": len(results),
        "errors": errors,
    }


async def _answers(url: str, timeout_s: float) -> bool:
    """Poll ``url`` from this event loop (which also serves it) until it answers 200. A signal
    cancels the poll at its next await; a poll in a worker thread would keep running after the
    router stopped, and ``asyncio.run`` waits for its thread before it returns."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=1.0, trust_env=False) as c:
        while time.monotonic() < deadline:
            try:
                if (await c.get(url)).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.05)
    return False


async def _with_router(
    policy: str,
    port: int,
    workers: list[WorkerInfo],
    body: Callable[[str, Any], Awaitable[Any]],
    stop: asyncio.Event | None = None,
) -> Any:
    """Run ``body(url, router)`` against a router over ``workers``, served as `kvrouter serve`
    serves it, once that router is ready; the router stops when ``body`` returns or the process
    is told to stop (SIGTERM: exit status 143; SIGINT: KeyboardInterrupt, as Ctrl-C ends
    ``asyncio.run``).

    A signal cancels this task, so the stop unwinds from an ``await`` here: a handler that
    raised where the signal lands could raise inside a request the router is answering, where
    the ASGI server logs it as that request's error and serves on. It also sets ``stop``, which
    a body that waits for the end waits on: a cancellation that lands inside a client library's
    shielded clean-up can be absorbed there, and the body must still end."""
    cfg = Config(workers=[WorkerSpec(url=w.url) for w in workers])
    cfg.server.host = "127.0.0.1"
    cfg.server.port = port
    cfg.server.log_level = "warning"
    cfg.policy.name = policy
    app, _admin, router = create_apps(cfg, seed=0)
    (server,) = build_servers(cfg, app, None)
    loop = asyncio.get_running_loop()
    this = asyncio.current_task()
    assert this is not None
    signalled: list[int] = []

    def on_signal(sig: int) -> None:
        signalled.append(sig)
        if stop is not None:
            stop.set()
        this.cancel()

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:
        loop.add_signal_handler(sig, on_signal, sig)
    task = asyncio.create_task(server.serve())
    try:
        try:
            await asyncio.wait_for(wait_started([server], [task], interval=0.05), 20)
        except TimeoutError:
            raise RuntimeError("router did not start within 20 s") from None
        if task.done():
            task.result()
            raise RuntimeError("router did not start")
        url = f"http://127.0.0.1:{bound_port(server)}"
        if not await _answers(url + "/ready", 20.0):
            raise RuntimeError("router not ready within 20 s")
        result = await body(url, router)
    except asyncio.CancelledError:
        if not signalled:
            raise
    finally:
        for sig, handler in previous.items():
            loop.remove_signal_handler(sig)
            signal.signal(sig, handler)  # the fleet's clean-up still answers SIGTERM
        server.should_exit = True
        await asyncio.wait_for(task, 15)
    if signalled:
        if signalled[0] == signal.SIGTERM:
            raise SystemExit(128 + signal.SIGTERM)
        raise KeyboardInterrupt
    return result


def run_demo(ns: argparse.Namespace) -> int:
    load = Load()
    if ns.serve:
        return _serve(ns)
    summary: dict[str, dict[str, float]] = {}
    progress = Progress(quiet=ns.json)
    policies = ("kvrouter", "round_robin")
    for i, policy in enumerate(policies, 1):
        step = f"[{i}/{len(policies)}] {policy}:"
        progress.phase(f"{step} starting {ns.workers} simulated workers and the router")
        with running_fleet(ns.workers, **FLEET_FLAGS) as workers:

            async def body(
                url: str, _router: Any, policy: str = policy, step: str = step
            ) -> dict[str, float]:
                progress.phase(f"{step} {ns.duration:.0f} s of chat load, {ns.concurrency} users")
                return await run_load(url, load, ns.duration, ns.concurrency, policy, progress)

            s = summary[policy] = asyncio.run(_with_router(policy, 0, workers, body))
        progress.phase(
            f"{step} done: hit rate {s['hit_rate'] * 100:.1f}%, TTFT p50 "
            f"{s['ttft_p50_s'] * 1000:.0f} ms, {s['requests']} requests, {s['errors']} errors"
        )
    _print_table(summary)
    if ns.json:
        out = {
            k: {m: v[m] for m in ("hit_rate", "ttft_p50_s", "ttft_p99_s", "requests_per_s")}
            for k, v in summary.items()
        }
        print(json.dumps(out))
    return 0


def _print_table(summary: dict[str, dict[str, float]]) -> None:
    print()
    print(
        f"{'policy':<12} {'hit rate':>9} {'TTFT p50':>10} {'TTFT p99':>10} {'req/s':>8} {'reqs':>6}"
    )
    for k, v in summary.items():
        print(
            f"{k:<12} {v['hit_rate'] * 100:8.1f}% {v['ttft_p50_s'] * 1000:8.1f}ms "
            f"{v['ttft_p99_s'] * 1000:8.1f}ms {v['requests_per_s']:8.1f} {v['requests']:6d}"
        )
    if "kvrouter" in summary and "round_robin" in summary:
        a, b = summary["kvrouter"], summary["round_robin"]
        if a["ttft_p50_s"] > 0:
            print(
                f"\nkvrouter vs round-robin: TTFT p50 {b['ttft_p50_s'] / a['ttft_p50_s']:.1f}x "
                f"lower, hit rate {a['hit_rate'] * 100:.0f}% vs {b['hit_rate'] * 100:.0f}%"
            )


def _serve(ns: argparse.Namespace) -> int:
    with running_fleet(ns.workers, **FLEET_FLAGS) as workers:

        async def body(url: str, router: Any) -> None:
            print(f"kvrouter demo: router at {url} (OpenAI API: {url}/v1)")
            for w in workers:
                print(f"  simulated worker {w.url}  events {w.events_endpoint}")
            async with httpx.AsyncClient(timeout=5) as c:
                print(json.dumps((await c.get(url + "/debug/index")).json(), indent=1)[:4000])
            print(f"try: curl -s {url}/debug/index | python -m json.tool ; Ctrl-C to stop")
            sys.stdout.flush()
            await stop.wait()

        stop = asyncio.Event()
        try:
            asyncio.run(_with_router("kvrouter", ns.port, workers, body, stop))
        except KeyboardInterrupt:
            pass
    return 0
