"""Event plane side by side: ZMQ publishers -> kvrouter's Subscriber, and -> Dynamo's indexer.

    python bench/peer_index_events.py --dynamo-python bench/out/dynamo-venv/bin/python --core 1

Run by bench/peer_index_bench.py (inside a private network namespace). The publishers are
bench/subscriber_bench.py's: vLLM 0.33's live protocol (``[topic, seq8, payload]``), batches
planned before the clock starts, 32-block ``BlockStored`` chunks with token ids, and once a
publisher's simulated GPU is full one single-hash ``BlockRemoved`` per evicted block. Here they
bind XPUB instead of PUB so that each knows when its subscriber has subscribed (no probe
frames, so sequence numbers start at 0 for both indexers). Publishers run on the other cores at
a lower priority; the indexer under test is pinned to ``--core``:

* kvrouter: ``Subscriber`` + ``PrefixIndex`` in this process, GC enabled, ``gc.freeze()`` after
  start-up as `kvrouter serve` does. Applied events are counted in ``on_batch``.
* Dynamo: ``python -m dynamo.indexer --threads 1`` (the standalone Rust indexer, one indexer
  thread), one ``/register`` per publisher; applied events are read from its Prometheus counter
  ``dynamo_kvrouter_kv_cache_events_applied`` every ``POLL_S``.

Lag is estimated the same way for both: each applied-events sample (t, n) is compared with the
time the n-th event was published. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import gc
import json
import multiprocessing as mp
import os
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import zmq  # noqa: E402
from subscriber_bench import ACTIVE, BLOCK, CHUNK_BLOCKS, REQ_TOKENS, _plan  # noqa: E402

from simulator.testing import find_port_block  # noqa: E402

MODEL = "bench-model"
POLL_S = 0.05
WANT_TOKENS = (REQ_TOKENS - 1) // BLOCK * BLOCK  # a completed request's full blocks


def publisher(
    idx: int, args: argparse.Namespace, cores: set[int], ready: Any, go: Any, results: Any
) -> None:
    os.sched_setaffinity(0, cores)
    os.nice(10)
    steps_per_s = args.blocks_per_s / args.publishers / (ACTIVE * CHUNK_BLOCKS)
    payloads, counts, completed = _plan(idx, int(args.seconds * steps_per_s) + 2, args.gpu_blocks)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.set_hwm(100_000)
    pub.bind("tcp://127.0.0.1:*")
    ready.put(("bound", idx, pub.getsockopt_string(zmq.LAST_ENDPOINT)))
    while not pub.poll(60_000):
        pass
    pub.recv()  # the subscriber's subscription: from here on nothing sent is dropped
    ready.put(("subscribed", idx, ""))
    go.wait()
    period = 1.0 / steps_per_s
    sent_at: list[float] = []
    t0 = time.perf_counter()
    seq = 0
    while seq < len(payloads) and time.perf_counter() - t0 < args.seconds:
        due = t0 + seq * period
        now = time.perf_counter()
        if due > now:
            time.sleep(due - now)
        now_wall = time.time()
        struct.pack_into(">d", payloads[seq], 2, now_wall)
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payloads[seq]], copy=False)
        sent_at.append(now_wall)
        seq += 1
    results.put(
        {
            "idx": idx,
            "sent": [(t, c[0]) for t, c in zip(sent_at, counts, strict=False)],
            "blocks": sum(c[1] for c in counts[:seq]),
            "removed_blocks": sum(c[2] for c in counts[:seq]),
            "elapsed": time.perf_counter() - t0,
            "sample": [tokens for step in completed[:seq] for tokens in step][-3:],
        }
    )
    time.sleep(0.5)
    pub.close(linger=1000)
    ctx.term()


class Fleet:
    """The publisher processes; their endpoints once bound, their reports once done."""

    def __init__(self, args: argparse.Namespace, cores: set[int]) -> None:
        ctx = mp.get_context("fork")
        self.ready, self.results, self.go = ctx.Queue(), ctx.Queue(), ctx.Event()
        self.procs = [
            ctx.Process(
                target=publisher,
                args=(i, args, cores, self.ready, self.go, self.results),
                daemon=True,
            )
            for i in range(args.publishers)
        ]
        for p in self.procs:
            p.start()
        self.endpoints: dict[int, str] = {}
        while len(self.endpoints) < len(self.procs):
            _, idx, ep = self.ready.get(timeout=60)
            self.endpoints[idx] = ep

    def wait_subscribed(self) -> None:
        for _ in self.procs:
            kind, _, _ = self.ready.get(timeout=60)
            assert kind == "subscribed"


def published_curve(reports: list[dict[str, Any]]) -> tuple[list[float], list[int]]:
    sends = sorted((t, n) for r in reports for t, n in r["sent"])
    times, cum, total = [], [], 0
    for t, n in sends:
        total += n
        times.append(t)
        cum.append(total)
    return times, cum


def backlog_lags_ms(samples: list[tuple[float, int]], reports: list[dict[str, Any]]) -> list[float]:
    """For each sample (t, n applied): t minus the time the n-th event had been published."""
    times, cum = published_curve(reports)
    out = []
    for t, n in samples:
        if n <= 0:
            continue
        i = bisect.bisect_left(cum, n)
        if i < len(times):
            out.append(max(t - times[i], 0.0) * 1000)
    return sorted(out)


def pct(xs: list[float], p: float) -> float:
    return round(xs[min(int(p * len(xs)), len(xs) - 1)], 2) if xs else -1.0


def summary(
    reports: list[dict[str, Any]], samples: list[tuple[float, int]], applied: int, cpu_s: float
) -> dict[str, Any]:
    published = sum(n for r in reports for _, n in r["sent"])
    blocks = sum(r["blocks"] for r in reports)
    removed = sum(r["removed_blocks"] for r in reports)
    elapsed = max(r["elapsed"] for r in reports)
    lags = backlog_lags_ms(samples, reports)
    last_sent = max(t for r in reports for t, _ in r["sent"])
    done_at = next((t for t, n in samples if n >= published), None)
    return {
        "offered_blocks_per_s": round(blocks / elapsed),
        "offered_removed_blocks_per_s": round(removed / elapsed),
        "published_events": published,
        "applied_events": applied,
        "drained": applied >= published,
        "drain_ms_after_last_publish": round((done_at - last_sent) * 1000, 1) if done_at else None,
        "backlog_lag_p50_ms": pct(lags, 0.5),
        "backlog_lag_p99_ms": pct(lags, 0.99),
        "backlog_lag_max_ms": pct(lags, 1.0),
        "cpu_s": round(cpu_s, 3),
        "cpu_us_per_block": round(cpu_s / max(blocks + removed, 1) * 1e6, 3),
        "cpu_util": round(cpu_s / elapsed, 3),
    }


async def run_kvrouter(args: argparse.Namespace, fleet: Fleet) -> dict[str, Any]:
    from indexer.index import PrefixIndex
    from indexer.subscriber import Subscriber
    from indexer.wire import DecodedBatch

    os.sched_setaffinity(0, {args.core})
    index = PrefixIndex(max_entries=20_000_000)
    state = {"events": 0}
    lags: list[float] = []
    samples: list[tuple[float, int]] = []

    def on_batch(engine: Any, seq: int, batch: DecodedBatch) -> None:
        lags.append(time.time() - batch.ts)
        state["events"] += len(batch.events)

    sub = Subscriber(index, on_batch=on_batch, queue_depth=10_000)
    for i, ep in fleet.endpoints.items():
        sub.add_worker(f"pub{i}", ep, model=MODEL)
    await sub.start()
    fleet.wait_subscribed()
    gc.collect()
    gc.freeze()
    cpu0 = time.process_time()
    fleet.go.set()
    reports: list[dict[str, Any]] = []
    while len(reports) < len(fleet.procs):
        samples.append((time.time(), state["events"]))
        while not fleet.results.empty():
            reports.append(fleet.results.get())
        await asyncio.sleep(POLL_S)
    published = sum(n for r in reports for _, n in r["sent"])
    deadline = time.monotonic() + 30
    while state["events"] < published and time.monotonic() < deadline:
        samples.append((time.time(), state["events"]))
        await asyncio.sleep(POLL_S)
    samples.append((time.time(), state["events"]))
    cpu_s = time.process_time() - cpu0
    await sub.stop()
    for p in fleet.procs:
        p.join(timeout=5)
    root = index.root(MODEL)
    ok = checked = 0
    for r in reports:
        for tokens in r["sample"]:
            checked += 1
            m = index.match(tokens, root, [(f"pub{r['idx']}", 0)]).get((f"pub{r['idx']}", 0))
            ok += bool(m is not None and m.gpu_tokens == WANT_TOKENS)
    lags_ms = sorted(x * 1000 for x in lags)
    return {
        **summary(reports, samples, state["events"], cpu_s),
        "exact_lag_p50_ms": pct(lags_ms, 0.5),
        "exact_lag_p99_ms": pct(lags_ms, 0.99),
        "chains_checked": checked,
        "chains_ok": ok,
    }


def http(port: int, path: str, body: Any = None) -> bytes:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.read()


def applied_events(port: int) -> int:
    total = 0
    for line in http(port, "/metrics").decode().splitlines():
        if line.startswith("dynamo_kvrouter_kv_cache_events_applied{"):
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def run_dynamo(args: argparse.Namespace, fleet: Fleet) -> dict[str, Any]:
    port = find_port_block(1)
    log = open(HERE / "out" / "dynamo-indexer.log", "w")  # noqa: SIM115 (lives with the process)
    cmd = [args.dynamo_python, "-m", "dynamo.indexer", "--block-size", str(BLOCK)]
    proc = subprocess.Popen(
        [*cmd, "--port", str(port), "--threads", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "RUST_LOG": "warn"},
        preexec_fn=lambda: os.sched_setaffinity(0, {args.core}),
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                http(port, "/health")
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("Dynamo's indexer did not start; see bench/out/") from None
                time.sleep(0.1)
        for i, ep in fleet.endpoints.items():
            body = {"instance_id": i + 1, "endpoint": ep, "model_name": MODEL, "block_size": BLOCK}
            http(port, "/register", body)
        fleet.wait_subscribed()
        base = applied_events(port)
        cpu0 = proc_cpu_s(proc.pid)
        fleet.go.set()
        samples: list[tuple[float, int]] = []
        reports: list[dict[str, Any]] = []
        while len(reports) < len(fleet.procs):
            samples.append((time.time(), applied_events(port) - base))
            while not fleet.results.empty():
                reports.append(fleet.results.get())
            time.sleep(POLL_S)
        published = sum(n for r in reports for _, n in r["sent"])
        deadline = time.monotonic() + 30
        while samples[-1][1] < published and time.monotonic() < deadline:
            time.sleep(POLL_S)
            samples.append((time.time(), applied_events(port) - base))
        cpu_s = proc_cpu_s(proc.pid) - cpu0
        for p in fleet.procs:
            p.join(timeout=5)
        ok = checked = 0
        for r in reports:
            for tokens in r["sample"]:
                checked += 1
                body = {"token_ids": tokens, "model_name": MODEL}
                scores = json.loads(http(port, "/query", body))["scores"]
                # Dynamo scores every full block of the prompt; kvrouter reports what vLLM's
                # scheduler will reuse, which leaves the last token to compute (WANT_TOKENS).
                full = len(tokens) // BLOCK * BLOCK
                ok += scores.get(str(r["idx"] + 1), {}).get("0") == full
        return {
            **summary(reports, samples, samples[-1][1], cpu_s),
            "chains_checked": checked,
            "chains_ok": ok,
        }
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dynamo-python", required=True)
    ap.add_argument("--core", type=int, required=True)
    ap.add_argument("--blocks-per-s", type=float, default=100_000, help="stored, all publishers")
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--publishers", type=int, default=16)
    ap.add_argument("--gpu-blocks", type=int, default=32_768, help="per publisher")
    args = ap.parse_args()
    others = (os.sched_getaffinity(0) - {args.core}) or {args.core}
    os.sched_setaffinity(0, others)
    load = round(os.getloadavg()[0], 2)
    result: dict[str, Any] = {"load_avg_1m_before": load, "publishers": args.publishers}
    result["seconds"] = args.seconds
    result["gpu_blocks_per_publisher"] = args.gpu_blocks
    result["dynamo"] = run_dynamo(args, Fleet(args, others))
    os.sched_setaffinity(0, others)
    fleet = Fleet(args, others)
    result["kvrouter"] = asyncio.run(run_kvrouter(args, fleet))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
