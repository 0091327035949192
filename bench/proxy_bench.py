"""Proxy overhead of kvrouter on loopback: latency added per request, and requests/s.

Separate processes: the simulated worker (``kvrouter-sim``, near-zero timing so it is not the
bottleneck), the router (``kvrouter serve``), and this load generator (a minimal keep-alive
HTTP/1.1 client on asyncio streams, so the client costs little CPU).

* Latency, one connection, 8,192-token prompts, non-streaming ``max_tokens=1``, router vs the
  same worker directly, in alternating order:
  - ``added_*_ms``: percentiles of the per-pair differences (routed minus direct); a new prompt
    every request, so the router tokenizes through the worker's
    ``POST /tokenize`` each time (the figure the target is about) and sends the worker the ids
    (``tokenizer.forward_ids``): one tokenization per request on either path, so the figure is
    the router's own work plus one more worker round trip. ``tokenize_direct_p50_ms`` is a
    first ``/tokenize`` of a prompt measured alone (the simulator's tokenizer is pure Python).
  - ``added_p50_routed_first_ms`` / ``..._second_ms``: the same, for the routed requests that
    came right after the warm-up completion / right after the direct request (the two modes of a
    bimodal distribution; the first is ~0.4 ms slower, mostly in the simulator's answers).
  - ``added_cached_*_ms``: the same prompt repeated (tokenization cache hit).
* The router's own cost, the same new-prompt loop against ``bench/instant_worker.py`` (answers
  at once, no tokenization or engine time), in the router's default configuration
  (verification and self-check on) over a warm index: two workers hold the prompts' first 6,144
  and 2,048 tokens beside 50,000 unrelated blocks each, and report what they hold as
  ``cached_tokens``: ``router_self_added_p50_ms`` and the router's ``router_cpu_ms_per_request``
  (its process CPU time over that loop).
* Throughput: 32 connections for a bounded duration, 64-token prompts (unique per request, so
  every request also costs a /tokenize call), ``requests_per_s`` through the router.

The last line printed is one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from simulator.testing import find_port_block, running_fleet, wait_http_ok

PROMPT_TOKENS = 8192
LAT_N = int(os.environ.get("BENCH_LAT_N", "100"))
TPUT_S = float(os.environ.get("BENCH_TPUT_S", "8"))
CONNS = 32


class Conn:
    """Keep-alive HTTP/1.1 client connection (POST JSON, read Content-Length bodies)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.r: asyncio.StreamReader | None = None
        self.w: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.w is None:
            self.r, self.w = await asyncio.open_connection(self.host, self.port)
        assert self.r is not None
        self.w.write(
            b"POST " + path.encode() + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        head = await self.r.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        chunked = False
        for line in head.split(b"\r\n")[1:]:
            k, _, v = line.partition(b":")
            k = k.strip().lower()
            if k == b"content-length":
                length = int(v)
            elif k == b"transfer-encoding" and b"chunked" in v.lower():
                chunked = True
        if not chunked:
            return status, await self.r.readexactly(length)
        out = b""
        while True:
            size = int((await self.r.readuntil(b"\r\n")).strip(), 16)
            data = await self.r.readexactly(size + 2)
            if size == 0:
                return status, out
            out += data[:-2]

    def close(self) -> None:
        if self.w is not None:
            self.w.close()


def prompt(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(10**9)}" for _ in range(n - 1))


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


async def latency(router: str, worker: str) -> dict[str, float]:
    rh, rp = router.split("//")[1].split(":")
    wh, wp = worker.split("//")[1].split(":")
    rc, wc = Conn(rh, int(rp)), Conn(wh, int(wp))
    rng = random.Random(1)

    def body(p: str) -> bytes:
        return json.dumps({"model": "sim-model", "prompt": p, "max_tokens": 1}).encode()

    async def timed(c: Conn, path: str, b: bytes) -> float:
        t = time.perf_counter()
        st, _ = await c.post(path, b)
        assert st == 200, st
        return (time.perf_counter() - t) * 1000

    async def pair(i: int, b: bytes, routed: list[float], direct: list[float]) -> None:
        """One routed and one direct request, taking turns going first."""
        first, second = ((wc, direct), (rc, routed)) if i % 2 else ((rc, routed), (wc, direct))
        for c, out in (first, second):
            out.append(await timed(c, "/v1/completions", b))

    def added(routed: list[float], direct: list[float], p: float) -> float:
        """Percentile of the per-pair differences (a difference of percentiles would compare
        two different requests' tails)."""
        return round(pct([r - d for r, d in zip(routed, direct, strict=True)], p), 3)

    # warm-up
    for _ in range(3):
        b = body(prompt(rng, PROMPT_TOKENS))
        await timed(rc, "/v1/completions", b)
        await timed(wc, "/v1/completions", b)
    direct, routed, tok = [], [], []
    for i in range(LAT_N):
        b = body(prompt(rng, PROMPT_TOKENS))
        # The worker sees each prompt once first, so both measured requests hit its cache
        # equally. That first completion stores 512 blocks: the worker then publishes their
        # events and the router applies them while the next request runs, so router and direct
        # take turns going first and share that cost.
        tok.append(
            await timed(wc, "/tokenize", json.dumps({"prompt": json.loads(b)["prompt"]}).encode())
        )
        await timed(wc, "/v1/completions", b)
        await pair(i, b, routed, direct)
    same = body(prompt(rng, PROMPT_TOKENS))
    await timed(rc, "/v1/completions", same)
    cdirect, crouted = [], []
    for i in range(LAT_N):
        await pair(i, same, crouted, cdirect)
    rc.close()
    wc.close()
    # Routed latencies are bimodal: a request right after the warm-up completion (even i: the
    # routed one goes first) is slower than one right after the direct request. Reported apart
    # so that a change in either mode is visible; the headline p50 mixes both, as traffic does.
    first = [x for i, x in enumerate(routed) if i % 2 == 0]
    second = [x for i, x in enumerate(routed) if i % 2 == 1]
    return {
        "added_p50_ms": round(pct(routed, 0.5) - pct(direct, 0.5), 3),
        "added_p50_routed_first_ms": round(pct(first, 0.5) - pct(direct, 0.5), 3),
        "added_p50_routed_second_ms": round(pct(second, 0.5) - pct(direct, 0.5), 3),
        "added_p99_ms": added(routed, direct, 0.99),
        "direct_p50_ms": round(pct(direct, 0.5), 3),
        "router_p50_ms": round(pct(routed, 0.5), 3),
        "tokenize_direct_p50_ms": round(statistics.median(tok), 3),
        "added_cached_p50_ms": round(pct(crouted, 0.5) - pct(cdirect, 0.5), 3),
        "added_cached_p99_ms": added(crouted, cdirect, 0.99),
    }


async def throughput(router: str) -> dict[str, float]:
    h, p = router.split("//")[1].split(":")
    done = 0
    errors = 0
    stop = time.perf_counter() + TPUT_S

    async def loop(i: int) -> None:
        nonlocal done, errors
        c = Conn(h, int(p))
        rng = random.Random(1000 + i)
        try:
            while time.perf_counter() < stop:
                b = json.dumps(
                    {"model": "sim-model", "prompt": prompt(rng, 64), "max_tokens": 1}
                ).encode()
                st, _ = await c.post("/v1/completions", b)
                if st == 200:
                    done += 1
                else:
                    errors += 1
        finally:
            c.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(loop(i) for i in range(CONNS)))
    el = time.perf_counter() - t0
    return {"requests_per_s": round(done / el, 1), "throughput_errors": errors}


def main() -> None:
    flags = {"prefill_tps": 1e12, "decode_ms": 0, "step_overhead_ms": 0, "num_gpu_blocks": 8192}
    with running_fleet(1, **flags) as ws:
        port = find_port_block(1)
        router = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "serve", "--host", "127.0.0.1", "--port",
             str(port), "--worker", ws[0].url, "--log-level", "warning"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            if not wait_http_ok(router + "/ready", timeout=30, proc=proc):
                raise RuntimeError("router did not become ready")
            out = asyncio.run(latency(router, ws[0].url))
            out.update(asyncio.run(throughput(router)))
            direct = asyncio.run(throughput(ws[0].url))  # the worker alone, same load
            out["direct_requests_per_s"] = direct["requests_per_s"]
            out.update(
                {"prompt_tokens": PROMPT_TOKENS, "connections": CONNS, "cpus": os.cpu_count()}
            )
        finally:
            proc.terminate()
            proc.wait(10)
    out.update(router_self())
    print(json.dumps(out))


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


WARM_HOLD = (6144, 2048)
"""Prefix tokens of every measured prompt held by each instant worker: the router matches a
real prefix on every request and routes to the first."""
WARM_FILLER = 50_000
"""Unrelated blocks each instant worker holds beside it (a warm index, not an empty one)."""


def router_self() -> dict[str, float]:
    """The router's own cost: the same new-8k-prompt latency loop against workers that answer
    at once (bench/instant_worker.py), in the router's default configuration (verification and
    self-check on) over a warm index, and the router's CPU time per request."""
    base = find_port_block(2 + 3 * len(WARM_HOLD))
    rport = base
    here = os.path.dirname(os.path.abspath(__file__))
    workers, ports = [], []
    for i, hold in enumerate(WARM_HOLD):
        port = base + 1 + 3 * i
        ports.append(port)
        argv = [os.path.join(here, "instant_worker.py"), str(port), "--events", str(port + 1)]
        argv += ["--hold", str(hold), "--filler", str(WARM_FILLER)]
        workers.append(subprocess.Popen([sys.executable, *argv]))
    worker_args = [a for p in ports for a in ("--worker", f"http://127.0.0.1:{p}")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "serve", "--host", "127.0.0.1", "--port", str(rport),
         *worker_args, "--log-level", "error"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        router = f"http://127.0.0.1:{rport}"
        want = sum(h // 16 + WARM_FILLER for h in WARM_HOLD)
        if not _wait_warm(router, want, proc):
            raise RuntimeError("router (instant workers) did not load the warm index")

        async def run() -> tuple[list[float], list[float]]:
            rc, wc = Conn("127.0.0.1", rport), Conn("127.0.0.1", ports[0])
            rng = random.Random(2)
            routed: list[float] = []
            direct: list[float] = []
            for i in range(3 * LAT_N):
                b = json.dumps(
                    {"model": "sim-model", "prompt": prompt(rng, PROMPT_TOKENS), "max_tokens": 1}
                ).encode()
                pairs = ((wc, direct), (rc, routed)) if i % 2 else ((rc, routed), (wc, direct))
                for c, out in pairs:
                    t = time.perf_counter()
                    st, _ = await c.post("/v1/completions", b)
                    assert st == 200, st
                    out.append((time.perf_counter() - t) * 1000)
            rc.close()
            wc.close()
            return routed, direct

        cpu0 = _cpu_s(proc.pid)
        routed, direct = asyncio.run(run())
        cpu = _cpu_s(proc.pid) - cpu0
        served = _served_by(router)
    finally:
        proc.terminate()
        for w in workers:
            w.terminate()
        proc.wait(10)
        for w in workers:
            w.wait(10)
    if served != f"http://127.0.0.1:{ports[0]}":
        raise RuntimeError(f"the router did not route by the warm index (served by {served})")
    return {
        "router_self_added_p50_ms": round(pct(routed, 0.5) - pct(direct, 0.5), 3),
        "router_cpu_ms_per_request": round(cpu / len(routed) * 1000, 3),
        "router_self_index_blocks": want,
    }


def _wait_warm(router: str, blocks: int, proc: subprocess.Popen[bytes]) -> bool:
    """Until the router's index holds ``blocks`` blocks (the instant workers' whole state)."""
    deadline = time.monotonic() + 120
    with httpx.Client(timeout=5) as c:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                totals = c.get(router + "/debug/index").json()["totals"]
                if totals["resident_blocks"] >= blocks:
                    return True
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.2)
    return False


def _served_by(router: str) -> str | None:
    """Which worker the router picks for a measured prompt (the one holding the most of it)."""
    body = {"model": "sim-model", "prompt": "which worker", "max_tokens": 1}
    with httpx.Client(timeout=10) as c:
        return c.post(router + "/v1/completions", json=body).headers.get("x-kvrouter-worker")


if __name__ == "__main__":
    main()
