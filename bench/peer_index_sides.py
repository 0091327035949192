"""One side of the peer index benchmark: kvrouter's PrefixIndex or Dynamo's RadixTree.

    python bench/peer_index_sides.py kvrouter FIXTURE --core N
    bench/out/dynamo-venv/bin/python bench/peer_index_sides.py dynamo FIXTURE --core N

Each side runs in its own process, pinned to one core before any thread starts (Dynamo's
RadixTree runs its tree on a background thread; pinned first, that thread shares the core).
Both read the same fixture (bench/peer_index_bench.py writes it): vLLM 0.33 msgpack batches for
ingest and churn, and prompts for the 8k and 128k matches. The last line printed is one JSON
object. This module imports only msgspec at the top: the Dynamo side runs in Dynamo's own
virtual environment, which has neither kvrouter nor its other dependencies.

What each side times:

* kvrouter: ``decode_payload`` + ``PrefixIndex.apply`` per batch. ``apply`` computes the content
  keys from the events' token ids, so token hashing is inside the figure.
* Dynamo: ``RadixTree.apply_event`` takes one Dynamo ``KvCacheEvent`` as JSON whose blocks carry
  both the engine hash and Dynamo's token hash (``tokens_hash``). Dynamo's own ingest paths
  (the ZMQ relay, the standalone indexer) compute ``tokens_hash`` from the vLLM event in Rust
  before the tree sees it; through Python that step is ``compute_block_hash_for_seq`` on each
  event's token ids. The conversion is done before the clock starts, the hashing is timed on its
  own (``token_hash_s``), and the tree apply is timed per event, with one ``find_matches`` at the
  end as a barrier (the tree's queue is FIFO, so the barrier returns once every event is in).
* Matching: both sides hash the prompt (kvrouter's content keys inside ``match``, Dynamo's
  ``compute_block_hash_for_seq``) and look it up, inside the clock.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

BLOCK = 16
MODEL = "bench-model"


class Fixture(msgspec.Struct):
    """Everything both sides replay, written once by the driver."""

    workers: int
    ingest: list[tuple[int, bytes]]
    """(engine index, vLLM 0.33 payload ``[ts, [event maps], dp_rank]``)"""
    churn: list[tuple[int, bytes]]
    stored_blocks: int
    churn_blocks: int
    q8k: list[list[int]]
    q128k: list[list[int]]


def load_fixture(path: str) -> Fixture:
    return msgspec.msgpack.decode(Path(path).read_bytes(), type=Fixture)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def p50(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


def p99(xs: list[float]) -> float:
    return round(sorted(xs)[max(int(len(xs) * 0.99) - 1, 0)], 4)


def match_stats(
    fx: Fixture, match: Callable[[list[int]], Any], hit_tokens: Callable[[Any], int]
) -> dict[str, Any]:
    """Both query sets through ``match`` (a side's lookup, key computation included; only it is
    timed): wall and CPU time per query and ``hit_tokens`` of its result, as the JSON keys
    both sides report."""

    def timed(prompts: list[list[int]]) -> tuple[list[float], list[float], list[int]]:
        times, cpu, hits = [], [], []
        for p in prompts:
            c, t = time.process_time(), time.perf_counter()
            result = match(p)
            times.append((time.perf_counter() - t) * 1000)
            cpu.append((time.process_time() - c) * 1000)
            hits.append(hit_tokens(result))
        return times, cpu, hits

    t8, c8, h8 = timed(fx.q8k)
    t128, c128, h128 = timed(fx.q128k)
    return {
        "match_p50_ms_8k": p50(t8),
        "match_p99_ms_8k": p99(t8),
        "match_p50_ms_128k": p50(t128),
        "match_cpu_p50_ms_8k": p50(c8),
        "match_cpu_p50_ms_128k": p50(c128),
        "match_8k_mean_hit_tokens": round(statistics.mean(h8)),
        "match_128k_min_hit_tokens": min(h128),
    }


def run_kvrouter(fx: Fixture) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from indexer.index import PrefixIndex
    from indexer.wire import decode_payload

    engines = [(f"http://worker-{i}:8000", 0) for i in range(fx.workers)]
    index = PrefixIndex(unit=BLOCK, max_entries=10_000_000)
    for e in engines:
        index.add_engine(e, MODEL)
    ingest = [(engines[w], p) for w, p in fx.ingest]
    churn = [(engines[w], p) for w, p in fx.churn]
    # As `kvrouter serve` does after start-up: everything built so far leaves the GC's scans;
    # the collector stays enabled for all that follows, as it is in the router.
    gc.collect()
    gc.freeze()
    rss0 = rss_bytes()
    cpu0, t0 = time.process_time(), time.perf_counter()
    for engine, payload in ingest:
        index.apply(engine, decode_payload(payload).events)
    ingest_s, ingest_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    rss1 = rss_bytes()
    resident = index.total_entries
    cpu0, t0 = time.process_time(), time.perf_counter()
    for engine, payload in churn:
        index.apply(engine, decode_payload(payload).events)
    churn_s, churn_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    root = index.root(MODEL)

    matched = match_stats(
        fx,
        lambda p: index.match(p, root),
        lambda r: max((m.gpu_tokens for m in r.values()), default=0),
    )
    return {
        "side": "kvrouter",
        "resident_entries": resident,
        "entries_after_churn": index.total_entries,
        "ingest_s": round(ingest_s, 3),
        "ingest_blocks_per_s": round(fx.stored_blocks / ingest_s),
        "ingest_cpu_us_per_block": round(ingest_cpu / fx.stored_blocks * 1e6, 3),
        "churn_blocks_per_s": round(fx.churn_blocks / churn_s),
        "churn_cpu_us_per_block": round(churn_cpu / fx.churn_blocks * 1e6, 3),
        **matched,
        "bytes_per_entry": round((rss1 - rss0) / max(resident, 1), 1),
        "gc": "enabled; gc.freeze() after fixtures, as the router after start-up",
    }


def _dynamo_events(payload: bytes, hash_fn: Any, clock: list[float]) -> list[bytes]:
    """A vLLM batch as Dynamo ``KvCacheEvent`` JSON documents, one per event.

    The token hashing inside is Dynamo's own per-block cost: it is added to ``clock`` (wall
    seconds, CPU seconds) and reported apart."""
    _ts, events, _rank = msgspec.msgpack.decode(payload)
    out = []
    for ev in events:
        if ev["type"] == "BlockStored":
            c, t = time.process_time(), time.perf_counter()
            token_hashes = hash_fn(ev["token_ids"], BLOCK)
            clock[0] += time.perf_counter() - t
            clock[1] += time.process_time() - c
            data: dict[str, Any] = {
                "stored": {
                    "parent_hash": ev["parent_block_hash"],
                    "blocks": [
                        {"block_hash": h, "tokens_hash": th}
                        for h, th in zip(ev["block_hashes"], token_hashes, strict=True)
                    ],
                }
            }
        elif ev["type"] == "BlockRemoved":
            data = {"removed": {"block_hashes": ev["block_hashes"]}}
        else:
            data = "cleared"
        out.append(msgspec.json.encode({"event_id": 0, "data": data}))
    return out


def _apply_all(tree: Any, events: list[tuple[int, bytes]]) -> int:
    errors = 0
    for w, doc in events:
        try:
            tree.apply_event(w, doc)
        except RuntimeError:
            errors += 1
    return errors


def run_dynamo(fx: Fixture) -> dict[str, Any]:
    from dynamo._core import RadixTree, compute_block_hash_for_seq

    hash_fn = compute_block_hash_for_seq
    clock = [0.0, 0.0]
    ingest = [(w, e) for w, p in fx.ingest for e in _dynamo_events(p, hash_fn, clock)]
    (token_hash_s, token_hash_cpu), clock = clock, [0.0, 0.0]
    churn = [(w, e) for w, p in fx.churn for e in _dynamo_events(p, hash_fn, clock)]
    churn_hash_s, churn_hash_cpu = clock
    tree = RadixTree()
    gc.collect()
    gc.freeze()
    rss0 = rss_bytes()
    cpu0, t0 = time.process_time(), time.perf_counter()
    ingest_errors = _apply_all(tree, ingest)
    tree.find_matches([0])  # barrier: the tree's thread has applied everything queued before it
    ingest_s, ingest_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    rss1 = rss_bytes()
    cpu0, t0 = time.process_time(), time.perf_counter()
    churn_errors = _apply_all(tree, churn)
    tree.find_matches([0])
    churn_s, churn_cpu = time.perf_counter() - t0, time.process_time() - cpu0

    matched = match_stats(
        fx,
        lambda p: tree.find_matches(compute_block_hash_for_seq(p, BLOCK)).scores,
        lambda scores: max(scores.values(), default=0) * BLOCK,
    )
    # Resident entries: the same event stream as kvrouter's, so the same (engine, block) count;
    # the driver checks the match hits of both sides agree, which they can only if both hold it.
    return {
        "side": "dynamo",
        "ingest_s": round(ingest_s, 3),
        "ingest_blocks_per_s": round(fx.stored_blocks / ingest_s),
        "ingest_cpu_us_per_block": round(ingest_cpu / fx.stored_blocks * 1e6, 3),
        "token_hash_s": round(token_hash_s, 3),
        "token_hash_blocks_per_s": round(fx.stored_blocks / token_hash_s),
        "ingest_incl_token_hash_blocks_per_s": round(fx.stored_blocks / (ingest_s + token_hash_s)),
        "churn_blocks_per_s": round(fx.churn_blocks / churn_s),
        "churn_incl_token_hash_blocks_per_s": round(fx.churn_blocks / (churn_s + churn_hash_s)),
        "churn_cpu_us_per_block": round(churn_cpu / fx.churn_blocks * 1e6, 3),
        "token_hash_cpu_us_per_block": round(token_hash_cpu / fx.stored_blocks * 1e6, 3),
        "churn_token_hash_cpu_us_per_block": round(churn_hash_cpu / fx.churn_blocks * 1e6, 3),
        **matched,
        "rss_growth_bytes": rss1 - rss0,
        "api_calls": {"ingest_events": len(ingest), "churn_events": len(churn)},
        # Events the tree refused (it raises): removals of blocks the engine no longer holds
        # (evicted conversations share their system prompt on an engine) or unknown parents.
        "rejected_events": {"ingest": ingest_errors, "churn": churn_errors},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("side", choices=("kvrouter", "dynamo"))
    ap.add_argument("fixture")
    ap.add_argument("--core", type=int, required=True)
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.core})  # before any library starts a thread
    fx = load_fixture(args.fixture)
    result = run_kvrouter(fx) if args.side == "kvrouter" else run_dynamo(fx)
    result["core"] = args.core
    print(json.dumps(result))


if __name__ == "__main__":
    main()
