"""kvrouter as an Endpoint Picker behind Envoy vs Envoy alone vs kvrouter's own HTTP proxy.

Separate processes on loopback: simulated workers (``kvrouter-sim``, near-zero timing), one
``kvrouter serve`` with both its HTTP proxy and its EPP on (the same routing core), Envoys with
the ext_proc filter (the test's GAIE-like config, tests/test_epp_envoy.py) in three processing
modes, Envoy without it (round robin), and this load generator.

Paths: ``envoy_epp`` (request and response bodies FULL_DUPLEX_STREAMED, what GAIE gateways
configure), ``envoy_epp_none`` (response body NONE: Envoy carries the response, kvrouter sees
its headers), ``envoy_epp_buffered`` (request body BUFFERED, response body NONE: the fewest
ext_proc messages per request), ``envoy_round_robin`` and ``proxy``.

**The same workers, the same bound.** No path bounds what each worker is sent: the proxy, too,
forwards whatever its 32 connections send, up to half of them to a worker at once. A per-worker
limit in Envoy only (circuit breakers) would favour the Envoy paths, and the same limit in
kvrouter (``max_connections_per_worker``) is the EPP's shedding threshold, where it answers 429.
Under that load a worker may miss a health probe; the router then still routes to every worker
while none is healthy, in both modes. Every process shares this machine's cores and the
simulated workers take most of them, so a path's requests/s is the whole system's rate;
``kvrouter_requests_per_cpu_s`` is the figure for kvrouter itself.

* ``added_p50_ms``: one connection, 8,192-token prompts (a new one each request, so the router
  tokenizes through a worker's ``/tokenize`` each time), non-streaming ``max_tokens=1``, p50 of
  the path minus p50 of the same requests sent to a worker directly.
* ``requests_per_s``: 32 connections, the same kind of requests, for ``BENCH_TPUT_S`` seconds
  (``throughput_errors``: answers other than 200, by status). Envoy alone's is the ceiling for
  any EPP path.
* ``kvrouter_cpu_ms_per_request``: the kvrouter process's CPU time over the throughput run, and
  ``kvrouter_requests_per_cpu_s`` its inverse: the rate one kvrouter core sustains where it,
  not the workers, is the bottleneck (a fleet of GPU servers on other machines).
* ``ext_proc_msgs_per_request``: gRPC messages each way per request (Envoy's ext_proc stats).
* ``epp_cpu_us_per_stream_chunk``: streamed responses through ``envoy_epp`` with 201 vs 1
  tokens; the kvrouter CPU difference per extra chunk (each chunk crosses the EPP in duplex mode).
* ``grpc_floor_*``: the same measurements for ``bench/ext_proc_floor.py``, a Python ext_proc
  server on the same grpcio that picks without looking and hands each chunk back: the part of
  the cost that belongs to gRPC in Python rather than to kvrouter (``*_above_floor_*`` is
  the rest); ``grpc_threaded_floor_cpu_us_per_stream_chunk`` is that server on grpcio's
  thread pool.
* ``targets``: each of the issue's targets with the measured value and the bounds that limit it
  (Envoy alone's requests/s for any EPP path; the floor's CPU for the EPP's).

``BENCH_KVROUTER_ROOT``: the source tree ``kvrouter serve`` runs from (default: this one), to
compare two versions of the router with the same bench. Prints one JSON line.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.proxy_bench import Conn, prompt
from simulator.testing import find_port_block, running_fleet
from tests.test_epp_envoy import Proc, running_envoy, running_kvrouter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT_TOKENS = 8192
LAT_N = int(os.environ.get("BENCH_LAT_N", "40"))
TPUT_S = float(os.environ.get("BENCH_TPUT_S", "6"))
STREAM_N = int(os.environ.get("BENCH_STREAM_N", "20"))
KVROUTER_ROOT = os.environ.get("BENCH_KVROUTER_ROOT", ROOT)
CONNS = 32
EPP_PATHS: dict[str, dict[str, str]] = {
    "envoy_epp": {},
    "envoy_epp_none": {"response_body": "NONE"},
    "envoy_epp_buffered": {"request_body": "BUFFERED", "response_body": "NONE"},
}


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _hp(url: str) -> tuple[str, int]:
    h, p = url.split("//")[1].split(":")
    return h, int(p)


def _body(rng: random.Random, n: int, **extra: Any) -> bytes:
    doc = {"model": "sim-model", "prompt": prompt(rng, n), "max_tokens": 1, **extra}
    return json.dumps(doc).encode()


@contextlib.contextmanager
def running_floor(tmp: str, port: int, endpoint: str, *flags: str) -> Iterator[Proc]:
    """bench/ext_proc_floor.py on ``port``, picking ``endpoint`` for every request."""
    log = os.path.join(tmp, f"floor-{port}.log")
    cmd = [sys.executable, "-m", "bench.ext_proc_floor", str(port), endpoint, *flags]
    with open(log, "wb") as f:
        p = Proc(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT), log)
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            if p.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ext_proc floor server did not start:\n{p.tail()}")
            time.sleep(0.05)
        yield p
    finally:
        p.stop()


async def latency(url: str, seed: int) -> list[float]:
    c = Conn(*_hp(url))
    rng = random.Random(seed)
    out = []
    try:
        for _ in range(LAT_N):
            b = _body(rng, PROMPT_TOKENS)
            t = time.perf_counter()
            st, _ = await c.post("/v1/completions", b)
            assert st == 200, st
            out.append((time.perf_counter() - t) * 1000)
    finally:
        c.close()
    return out


async def throughput(url: str, seed: int) -> tuple[float, int, dict[str, int]]:
    """Requests/s answered 200 over ``TPUT_S`` seconds of ``CONNS`` connections, how many, and
    the other answers by status (each kind's first body goes to stderr, to say why)."""
    h, p = _hp(url)
    done = 0
    errors: collections.Counter[str] = collections.Counter()
    stop = time.perf_counter() + TPUT_S

    async def loop(i: int) -> None:
        nonlocal done
        c = Conn(h, p)
        rng = random.Random(seed + i)
        try:
            while time.perf_counter() < stop:
                st, data = await c.post("/v1/completions", _body(rng, PROMPT_TOKENS))
                if st == 200:
                    done += 1
                    continue
                if not errors[str(st)]:
                    print(f"{url}: {st} {data[:300]!r}", file=sys.stderr)
                errors[str(st)] += 1
        finally:
            c.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(loop(i) for i in range(CONNS)))
    return done / (time.perf_counter() - t0), done, dict(errors)


async def streamed_cpu(url: str, pid: int, max_tokens: int, seed: int) -> float:
    c = Conn(*_hp(url))
    rng = random.Random(seed)
    cpu0 = _cpu_s(pid)
    try:
        for _ in range(STREAM_N):
            b = _body(rng, 256, stream=True, max_tokens=max_tokens)
            st, data = await c.post("/v1/completions", b)
            assert st == 200 and data.rstrip().endswith(b"[DONE]"), st
    finally:
        c.close()
    return _cpu_s(pid) - cpu0


def _msgs_per_request(url: str) -> dict[str, float]:
    """ext_proc messages per stream, each way, from the Envoy at ``url`` (admin on port + 1)."""
    host, port = _hp(url)
    with urllib.request.urlopen(f"http://{host}:{port + 1}/stats?filter=ext_proc") as r:
        stats = dict(line.split(": ", 1) for line in r.read().decode().splitlines() if ": " in line)
    n = max(int(stats.get("http.gateway.ext_proc.streams_started", 0)), 1)
    sent = int(stats.get("http.gateway.ext_proc.stream_msgs_sent", 0))
    received = int(stats.get("http.gateway.ext_proc.stream_msgs_received", 0))
    return {"to_epp": round(sent / n, 2), "from_epp": round(received / n, 2)}


async def cpu_per_request(url: str, pid: int, seed: int) -> tuple[dict[str, Any], float]:
    """The throughput run, and the CPU ms of process ``pid`` per request over it."""
    cpu0 = _cpu_s(pid)
    rps, n, errors = await throughput(url, seed)
    cpu = _cpu_s(pid) - cpu0
    out = {"requests_per_s": round(rps, 1), "throughput_errors": errors}
    return out, round(cpu / max(n, 1) * 1000, 3)


async def run(paths: dict[str, str], direct: str, pid: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    base = statistics.median(await latency(direct, 1))
    out["direct_p50_ms"] = round(base, 3)
    for i, (name, url) in enumerate(paths.items()):
        await latency(url, 500 + i)  # warm
        p50 = statistics.median(await latency(url, 100 + i))
        tput, cpu_ms = await cpu_per_request(url, pid, 1000 * (i + 1))
        out[name] = {"p50_ms": round(p50, 3), "added_p50_ms": round(p50 - base, 3), **tput}
        if name != "envoy_round_robin":
            out[name]["kvrouter_cpu_ms_per_request"] = cpu_ms
            out[name]["kvrouter_requests_per_cpu_s"] = round(1000 / max(cpu_ms, 1e-9), 1)
        if name in EPP_PATHS:
            out[name]["ext_proc_msgs_per_request"] = _msgs_per_request(url)
    out["epp_cpu_us_per_stream_chunk"] = await per_chunk_us(paths["envoy_epp"], pid)
    return out


async def per_chunk_us(url: str, pid: int) -> float:
    """CPU of process ``pid`` per streamed response chunk: 201-token minus 1-token streams."""
    await streamed_cpu(url, pid, 1, 9)  # warm
    long = await streamed_cpu(url, pid, 201, 7)
    short = await streamed_cpu(url, pid, 1, 8)
    return round((long - short) / (STREAM_N * 200) * 1e6, 2)


def targets(out: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets from the measured figures, with the bounds that limit each."""
    none, proxy, rr = out["envoy_epp_none"], out["proxy"], out["envoy_round_robin"]
    per_chunk = out["epp_cpu_us_per_stream_chunk"]
    floors = ("grpc_floor_cpu_us_per_stream_chunk", "grpc_threaded_floor_cpu_us_per_stream_chunk")
    floor = min(out[k] for k in floors)
    proxy_cpu = proxy["kvrouter_cpu_ms_per_request"]

    def ratio(a: float, b: float) -> float:
        return round(a / max(b, 1e-9), 3)

    return {
        "none_added_p50_le_proxy": {
            "value_ms": none["added_p50_ms"],
            "target_ms": proxy["added_p50_ms"],
            "met": none["added_p50_ms"] <= proxy["added_p50_ms"],
        },
        "none_requests_per_s_ge_1_5x_proxy": {
            "ratio": ratio(none["requests_per_s"], proxy["requests_per_s"]),
            "target": 1.5,
            "met": none["requests_per_s"] >= 1.5 * proxy["requests_per_s"],
            # Envoy alone routes without any picker: no EPP path carries more on these workers.
            "bound_envoy_alone_ratio": ratio(rr["requests_per_s"], proxy["requests_per_s"]),
            # Requests per kvrouter CPU-second: the ratio where kvrouter's core is the limit.
            "kvrouter_cpu_ratio": ratio(proxy_cpu, none["kvrouter_cpu_ms_per_request"]),
            # A picker that does nothing but speak ext_proc from Python gets no further.
            "bound_grpc_floor_cpu_ratio": ratio(
                proxy_cpu, out["grpc_floor_none_cpu_ms_per_request"]
            ),
        },
        "duplex_cpu_us_per_chunk_le_30": {
            "value_us": per_chunk,
            "target_us": 30.0,
            "met": per_chunk <= 30.0,
            "bound_grpc_floor_us": floor,
        },
    }


async def floors(tmp: str, ports: list[int]) -> dict[str, Any]:
    """The do-nothing ext_proc server's CPU per request (duplex and response body NONE) and per
    streamed chunk, on asyncio and on grpcio's thread pool."""
    every = ",".join(f"127.0.0.1:{p}" for p in ports)
    port = find_port_block(2)
    threaded_port = port + 1
    out: dict[str, Any] = {}
    with (
        running_floor(tmp, port, every) as floor,
        running_envoy(tmp, epp=port, workers=ports) as duplex,
        running_envoy(tmp, epp=port, workers=ports, response_body="NONE") as none,
        running_floor(tmp, threaded_port, every, "--threads") as threaded,
        running_envoy(tmp, epp=threaded_port, workers=ports) as envoy_threaded,
    ):
        pid = floor.proc.pid
        for key, url in (("", duplex), ("none_", none)):
            await latency(url, 77)  # warm
            _, cpu_ms = await cpu_per_request(url, pid, 4242)
            out[f"grpc_floor_{key}cpu_ms_per_request"] = cpu_ms
        out["grpc_floor_cpu_us_per_stream_chunk"] = await per_chunk_us(duplex, pid)
        out["grpc_threaded_floor_cpu_us_per_stream_chunk"] = await per_chunk_us(
            envoy_threaded, threaded.proc.pid
        )
    return out


def main() -> None:
    flags = {"prefill_tps": 1e12, "decode_ms": 0, "step_overhead_ms": 0, "num_gpu_blocks": 65536}
    with (
        tempfile.TemporaryDirectory() as tmp,
        running_fleet(2, **flags) as ws,
        running_kvrouter(tmp, ws, KVROUTER_ROOT, max_body_bytes=10_485_760) as (router, epp, p),
    ):
        ports = [w.port for w in ws]
        with contextlib.ExitStack() as stack:
            paths = {
                name: stack.enter_context(running_envoy(tmp, epp=epp, workers=ports, **kw))
                for name, kw in EPP_PATHS.items()
            }
            rr = running_envoy(tmp, epp=None, workers=ports)
            paths["envoy_round_robin"] = stack.enter_context(rr)
            paths["proxy"] = router
            res = asyncio.run(run(paths, ws[0].url, p.proc.pid))
        res.update(asyncio.run(floors(tmp, ports)))
        res["epp_cpu_us_above_floor_per_chunk"] = round(
            res["epp_cpu_us_per_stream_chunk"] - res["grpc_floor_cpu_us_per_stream_chunk"], 2
        )
        for name, floor in (("envoy_epp", ""), ("envoy_epp_none", "none_")):
            res[name]["kvrouter_cpu_ms_above_floor_per_request"] = round(
                res[name]["kvrouter_cpu_ms_per_request"]
                - res[f"grpc_floor_{floor}cpu_ms_per_request"],
                3,
            )
        res["targets"] = targets(res)
    res.update(prompt_tokens=PROMPT_TOKENS, connections=CONNS, cpus=os.cpu_count())
    print(json.dumps(res))


if __name__ == "__main__":
    main()
