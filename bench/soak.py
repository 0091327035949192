"""Soak: steady load with constant prefix churn through the router; router memory must plateau.

    python bench/soak.py --quick      # ~2.5 min: 30 s warm-up + 90 s measured
    python bench/soak.py              # 60 s warm-up + 10 min measured

Starts a simulated fleet (``simulator.testing.running_fleet``) and ``kvrouter serve`` as its own
process, then drives ``--concurrency`` clients: completions and chats, streaming and not, each
prompt = one of the currently "live" shared prefixes + a fresh tail. A new prefix family is born
every ``--churn-s`` seconds and the oldest retired, so the index, tokenizer cache, speculative
entries and the workers' caches turn over all the time. The router's RSS (``/proc/PID/status``)
is read after warm-up and at the end; the LAST line printed is one JSON object:
``requests, errors, rss_mb_after_warmup, rss_mb_end, rss_growth_pct`` (+ details).
Pass: ``errors == 0`` and ``rss_growth_pct <= 10``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import deque
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from simulator.testing import find_port_block, running_fleet, wait_http_ok


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(10**9)}" for _ in range(n))


class Churn:
    """Live prefix families: a new one every ``period_s``, at most ``live`` at a time."""

    def __init__(self, seed: int, live: int, period_s: float) -> None:
        self.rng = random.Random(seed)
        self.live: deque[str] = deque(maxlen=live)
        self.period_s = period_s
        self.born = 0
        self.next_at = 0.0

    def prefix(self, now: float) -> str:
        if now >= self.next_at or not self.live:
            self.live.append(_words(self.rng, self.rng.choice((128, 256, 512))))
            self.born += 1
            self.next_at = now + self.period_s
        return self.rng.choice(self.live)


async def client(
    c: httpx.AsyncClient, base: str, churn: Churn, until: float, stats: dict[str, Any], seed: int
) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        prefix = churn.prefix(time.monotonic())
        tail = _words(rng, rng.randrange(8, 64))
        stream = rng.random() < 0.3
        if rng.random() < 0.5:
            path = "/v1/completions"
            body: dict[str, Any] = {"prompt": f"{prefix} {tail}"}
        else:
            path = "/v1/chat/completions"
            body = {
                "messages": [
                    {"role": "system", "content": prefix},
                    {"role": "user", "content": tail},
                ]
            }
        body.update(model="sim-model", max_tokens=rng.randrange(1, 8), stream=stream)
        try:
            if stream:
                async with c.stream("POST", base + path, json=body) as r:
                    data = b"".join([x async for x in r.aiter_raw()])
                    ok = r.status_code == 200 and data.endswith(b"[DONE]\n\n")
                    ok = ok and b'"error"' not in data
            else:
                r = await c.post(base + path, json=body)
                ok = r.status_code == 200
        except httpx.HTTPError as exc:
            ok = False
            stats.setdefault("error_kinds", {}).setdefault(type(exc).__name__, 0)
            stats["error_kinds"][type(exc).__name__] += 1
        stats["requests"] += 1
        if not ok:
            stats["errors"] += 1


async def drive(base: str, seconds: float, concurrency: int, churn: Churn, stats: dict) -> None:
    until = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=60, limits=limits) as c:
        await asyncio.gather(*[client(c, base, churn, until, stats, i) for i in range(concurrency)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--warmup-s", type=float, default=None)
    ap.add_argument("--duration-s", type=float, default=None)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--churn-s", type=float, default=0.5, help="a new prefix family this often")
    ap.add_argument("--live-prefixes", type=int, default=16)
    ns = ap.parse_args()
    warm = ns.warmup_s if ns.warmup_s is not None else (30.0 if ns.quick else 60.0)
    dur = ns.duration_s if ns.duration_s is not None else (90.0 if ns.quick else 600.0)
    flags = {"decode_ms": 2, "prefill_tps": 200000, "step_overhead_ms": 0.2}
    with (
        running_fleet(ns.workers, num_gpu_blocks=1024, **flags) as ws,
        tempfile.TemporaryDirectory() as tmp,
    ):
        port = find_port_block(1)
        cfg = os.path.join(tmp, "kvrouter.yaml")
        with open(cfg, "w") as f:
            json.dump(
                {
                    "server": {"host": "127.0.0.1", "port": port, "log_level": "warning"},
                    "workers": [{"url": w.url} for w in ws],
                },
                f,
            )
        proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "serve", "--config", cfg],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            if not wait_http_ok(base + "/ready", timeout=30, proc=proc):
                raise SystemExit("router did not become ready")
            churn = Churn(0, ns.live_prefixes, ns.churn_s)
            warm_stats = {"requests": 0, "errors": 0}
            asyncio.run(drive(base, warm, ns.concurrency, churn, warm_stats))
            rss_warm = rss_mb(proc.pid)
            # The bounded caches may still be filling after warm-up; their fill at both ends
            # tells that growth (expected, up to the bound) from a leak.
            idx_warm = httpx.get(base + "/debug/index", timeout=10).json()["totals"]
            stats: dict[str, Any] = {"requests": 0, "errors": 0}
            samples = []
            t0 = time.monotonic()

            async def run() -> None:
                async def sampler() -> None:
                    while time.monotonic() - t0 < dur:
                        await asyncio.sleep(5)
                        samples.append(round(rss_mb(proc.pid), 1))

                await asyncio.gather(drive(base, dur, ns.concurrency, churn, stats), sampler())

            asyncio.run(run())
            rss_end = rss_mb(proc.pid)
            idx = httpx.get(base + "/debug/index", timeout=10).json()
            alive = proc.poll() is None
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    growth = (rss_end - rss_warm) / rss_warm * 100 if rss_warm else 0.0
    out = {
        "requests": stats["requests"],
        "errors": stats["errors"] + (0 if alive else 1),
        "rss_mb_after_warmup": round(rss_warm, 1),
        "rss_mb_end": round(rss_end, 1),
        "rss_growth_pct": round(growth, 2),
        "warmup_requests": warm_stats["requests"],
        "warmup_errors": warm_stats["errors"],
        "req_per_s": round(stats["requests"] / dur, 1),
        "prefix_families": churn.born,
        "rss_samples_mb": samples,
        "index_entries": idx["totals"]["index_entries"],
        "tokenizer_cache_entries": idx["totals"]["tokenizer_cache_entries"],
        "tokenizer_cache_entries_after_warmup": idx_warm["tokenizer_cache_entries"],
        "speculative_keys": idx["totals"]["speculative_keys"],
        "error_kinds": stats.get("error_kinds", {}),
        "warmup_s": warm,
        "duration_s": dur,
    }
    if "Traceback" in err:
        print(err[-3000:], file=sys.stderr)
    print(json.dumps(out))
    return 0 if out["errors"] == 0 and growth <= 10 else 1


if __name__ == "__main__":
    sys.exit(main())
