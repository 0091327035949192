"""kvrouter as an Endpoint Picker behind Envoy vs Envoy alone vs kvrouter's own HTTP proxy.

Separate processes on loopback: simulated workers (``kvrouter-sim``, near-zero timing), one
``kvrouter serve`` with both its HTTP proxy and its EPP on (the same routing core), Envoy with
the ext_proc filter (request and response bodies FULL_DUPLEX_STREAMED, the test's GAIE-like
config, tests/test_epp_envoy.py), Envoy without it (round robin), and this load generator.

* ``added_p50_ms``: one connection, 8,192-token prompts (a new one each request, so the router
  tokenizes through a worker's ``/tokenize`` each time), non-streaming ``max_tokens=1``, p50 of
  the path minus p50 of the same requests sent to a worker directly.
* ``requests_per_s``: 32 connections, the same kind of requests, for ``BENCH_TPUT_S`` seconds
  (``throughput_errors``: answers other than 200, e.g. 503 while the saturated workers miss
  their health probes).
* ``kvrouter_cpu_ms_per_request``: the kvrouter process's CPU time over the throughput run.
* ``envoy_epp_none``: the same EPP with the gateway's ``response_body_mode: NONE`` (the
  response never crosses the gRPC stream: Envoy carries the bytes, kvrouter sees the headers).
* ``epp_cpu_us_per_stream_chunk``: streamed responses through Envoy + EPP with 201 vs 1 tokens;
  the kvrouter CPU difference per extra chunk (each chunk passes through the EPP in duplex mode).
* ``grpc_floor_cpu_us_per_stream_chunk``: the same measurement for ``bench/ext_proc_floor.py``,
  a Python ext_proc server on the same grpcio that only hands each chunk back: the part of the
  per-chunk cost that belongs to gRPC in Python rather than to kvrouter
  (``epp_cpu_us_above_floor_per_chunk`` is the rest);
  ``grpc_threaded_floor_cpu_us_per_stream_chunk`` is the same server on grpcio's thread pool.
* ``targets``: each target with the measured value and, where a bound limits it, the bound
  (e.g. no EPP path can exceed Envoy alone's requests/s on the same workers).

Prints one JSON line.
"""

from __future__ import annotations

import asyncio
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
CONNS = 32


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


async def throughput(url: str, seed: int) -> tuple[float, int, int]:
    h, p = _hp(url)
    done = errors = 0
    stop = time.perf_counter() + TPUT_S

    async def loop(i: int) -> None:
        nonlocal done, errors
        c = Conn(h, p)
        rng = random.Random(seed + i)
        try:
            while time.perf_counter() < stop:
                st, _ = await c.post("/v1/completions", _body(rng, PROMPT_TOKENS))
                if st == 200:
                    done += 1
                else:
                    errors += 1
        finally:
            c.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(loop(i) for i in range(CONNS)))
    return done / (time.perf_counter() - t0), done, errors


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


async def run(paths: dict[str, str], direct: str, pid: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    base = statistics.median(await latency(direct, 1))
    out["direct_p50_ms"] = round(base, 3)
    for i, (name, url) in enumerate(paths.items()):
        await latency(url, 500 + i)  # warm
        p50 = statistics.median(await latency(url, 100 + i))
        cpu0 = _cpu_s(pid)
        rps, n, errors = await throughput(url, 1000 * (i + 1))
        cpu = _cpu_s(pid) - cpu0
        out[name] = {
            "p50_ms": round(p50, 3),
            "added_p50_ms": round(p50 - base, 3),
            "requests_per_s": round(rps, 1),
            "throughput_errors": errors,
        }
        if name != "envoy_round_robin":
            out[name]["kvrouter_cpu_ms_per_request"] = round(cpu / max(n, 1) * 1000, 3)
    out["epp_cpu_us_per_stream_chunk"] = await per_chunk_us(paths["envoy_epp"], pid)
    return out


async def per_chunk_us(url: str, pid: int) -> float:
    """CPU of process ``pid`` per streamed response chunk: 201-token minus 1-token streams."""
    await streamed_cpu(url, pid, 1, 9)  # warm
    long = await streamed_cpu(url, pid, 201, 7)
    short = await streamed_cpu(url, pid, 1, 8)
    return round((long - short) / (STREAM_N * 200) * 1e6, 2)


def targets(out: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets from the measured figures, with the bound that limits each."""
    none, proxy, rr = out["envoy_epp_none"], out["proxy"], out["envoy_round_robin"]
    per_chunk = out["epp_cpu_us_per_stream_chunk"]
    floors = ("grpc_floor_cpu_us_per_stream_chunk", "grpc_threaded_floor_cpu_us_per_stream_chunk")
    floor = min(out[k] for k in floors)
    return {
        "none_added_p50_le_proxy": {
            "value_ms": none["added_p50_ms"],
            "target_ms": proxy["added_p50_ms"],
            "met": none["added_p50_ms"] <= proxy["added_p50_ms"],
        },
        "none_requests_per_s_ge_1_5x_proxy": {
            "ratio": round(none["requests_per_s"] / max(proxy["requests_per_s"], 1e-9), 3),
            "target": 1.5,
            "met": none["requests_per_s"] >= 1.5 * proxy["requests_per_s"],
            # Envoy alone routes without any picker: no EPP path carries more on these workers.
            "bound_envoy_alone_ratio": round(
                rr["requests_per_s"] / max(proxy["requests_per_s"], 1e-9), 3
            ),
        },
        "duplex_cpu_us_per_chunk_le_30": {
            "value_us": per_chunk,
            "target_us": 30.0,
            "met": per_chunk <= 30.0,
            "bound_grpc_floor_us": floor,
        },
    }


def main() -> None:
    flags = {"prefill_tps": 1e12, "decode_ms": 0, "step_overhead_ms": 0, "num_gpu_blocks": 65536}
    with (
        tempfile.TemporaryDirectory() as tmp,
        running_fleet(2, **flags) as ws,
        running_kvrouter(tmp, ws, max_body_bytes=10_485_760) as (router, epp_port, proc),
    ):
        ports = [w.port for w in ws]
        floor_port, threaded_port = find_port_block(1), find_port_block(1)
        worker0 = f"127.0.0.1:{ports[0]}"
        with (
            running_envoy(tmp, epp=epp_port, workers=ports) as envoy_epp,
            running_envoy(tmp, epp=epp_port, workers=ports, response_body="NONE") as envoy_none,
            running_envoy(tmp, epp=None, workers=ports) as envoy_rr,
            running_floor(tmp, floor_port, worker0) as floor,
            running_envoy(tmp, epp=floor_port, workers=ports) as envoy_floor,
            running_floor(tmp, threaded_port, worker0, "--threads") as threaded,
            running_envoy(tmp, epp=threaded_port, workers=ports) as envoy_threaded,
        ):
            paths = {
                "envoy_epp": envoy_epp,
                "envoy_epp_none": envoy_none,
                "envoy_round_robin": envoy_rr,
                "proxy": router,
            }
            res = asyncio.run(run(paths, ws[0].url, proc.proc.pid))
            floor_us = asyncio.run(per_chunk_us(envoy_floor, floor.proc.pid))
            threaded_us = asyncio.run(per_chunk_us(envoy_threaded, threaded.proc.pid))
            res["grpc_floor_cpu_us_per_stream_chunk"] = floor_us
            res["grpc_threaded_floor_cpu_us_per_stream_chunk"] = threaded_us
            res["epp_cpu_us_above_floor_per_chunk"] = round(
                res["epp_cpu_us_per_stream_chunk"] - floor_us, 2
            )
            res["targets"] = targets(res)
    res.update(prompt_tokens=PROMPT_TOKENS, connections=CONNS, cpus=os.cpu_count())
    print(json.dumps(res))


if __name__ == "__main__":
    main()
