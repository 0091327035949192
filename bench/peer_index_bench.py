"""kvrouter's prefix index and event plane side by side with NVIDIA Dynamo's Rust indexer.

    python bench/peer_index_bench.py            # full run, 3-6 min; last line is one JSON object
    python bench/peer_index_bench.py --quick    # smaller fleet and shorter event plane, < 3 min

Dynamo's Python bindings (PyPI ``ai-dynamo-runtime``, abi3 wheels for CPython >= 3.10 on
manylinux x86_64/aarch64) are installed on first use into their own virtual environment under
bench/out/ (gitignored), made with this interpreter's ``venv``.

Two parts, each side in its own process(es), each process pinned to the same core:

1. Index (bench/peer_index_sides.py): the workload of bench/index_bench.py (64 engines, ~1M
   resident (engine, block) entries, 32-block vLLM 0.33 ``BlockStored`` batches in map encoding,
   churn = stores + single-hash removals, 8k and 128k token matches including the prompt's
   hashing) is generated once here, written to bench/out/, and replayed by kvrouter's
   ``PrefixIndex`` (with ``decode_payload``) and by Dynamo's ``RadixTree``.
2. Event plane (bench/peer_index_events.py): the same ZMQ publisher processes speaking vLLM's
   live protocol feed kvrouter's ``Subscriber`` + ``PrefixIndex`` and Dynamo's standalone
   indexer (``python -m dynamo.indexer``, Rust, one indexer thread) at the same offered rate.
   It runs in a private network namespace, since Dynamo's indexer binds its HTTP port on all
   interfaces.

Where the two are not strictly comparable the JSON says so under ``notes``; docs/capacity.md
explains the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from index_bench import BLOCK, block_hashes, chain_payloads, make_chain, stored_event  # noqa: E402
from peer_index_sides import Fixture  # noqa: E402

OUT = HERE / "out"
VENV = OUT / "dynamo-venv"
DYNAMO_PIN = "ai-dynamo-runtime==1.6.1"
BLOCKS_PER_EVENT = 32

NOTES = [
    "Each side runs in its own process pinned to the same core, one after the other; "
    "kvrouter with its GC enabled and gc.freeze() after the fixtures, as `kvrouter serve`.",
    "kvrouter ingest = msgpack decode of the vLLM batch + content keys from token ids + apply. "
    "Dynamo ingest = RadixTree.apply_event(JSON KvCacheEvent) per event (serde_json parse + tree "
    "update on the tree's own thread), from events converted before the clock starts; the "
    "token hashing Dynamo's relay/listener does before the tree (xxh3 of each block's tokens) is "
    "timed apart through compute_block_hash_for_seq and added in "
    "ingest_incl_token_hash_blocks_per_s, the figure the ingest ratio uses.",
    "Dynamo's Python RadixTree takes one event per call (a churn batch of 32 removals + 1 store "
    "is 33 calls) and crosses to its thread on each; kvrouter applies a whole batch per call. "
    "Dynamo's in-Rust benchmarks skip both the Python call and the JSON parse, so they report "
    "higher rates than any Python caller sees.",
    "match = prompt hashing + lookup on both sides (kvrouter: content keys inside match(); "
    "Dynamo: compute_block_hash_for_seq + find_matches). kvrouter's match also returns CPU-tier "
    "and per-group (hybrid) detail; Dynamo's returns per-worker block scores.",
    "bytes_per_entry = RSS growth over ingest / resident (engine, block) entries, the same "
    "event stream on both sides (kvrouter's count is used for both; equal match hits on both "
    "sides check that both hold the same blocks). Nothing is freed before the baseline: memory "
    "freed first is reused by the index and hides part of its growth (index_bench.py frees its "
    "build state first; on one 256k-entry fixture kvrouter reads 108 bytes that way, 166 not).",
    "Event plane: lag is a backlog estimate for both sides (each applied-events sample is "
    "compared with when that many events had been published); kvrouter also reports its exact "
    "per-batch lag. cpu_us_per_block is the indexer process's CPU (all its threads) per applied "
    "block, stored + removed.",
]


def ensure_venv() -> Path:
    """Dynamo's bindings in their own venv: they pin their own pydantic/uvloop versions."""
    py = VENV / "bin" / "python"
    probe = [str(py), "-c", "import dynamo._core, msgspec"]
    if py.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return py
    OUT.mkdir(parents=True, exist_ok=True)
    if VENV.exists():
        shutil.rmtree(VENV)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, DYNAMO_PIN, "msgspec"], check=True)
    subprocess.run(probe, check=True)
    return py


def _encode(events: list[dict[str, Any]]) -> bytes:
    return msgspec.msgpack.encode([time.time(), events, 0])


def build_fixture(workers: int, blocks: int, queries: int, seed: int) -> Fixture:
    """index_bench.py's fleet: 8k-token conversations behind 8 shared 1k-token system prompts,
    a quarter resident on 2-3 engines, plus two 128k-token documents on 4 engines each."""
    rng = random.Random(seed)
    systems = [make_chain(rng, 1024) for _ in range(8)]
    conv_tokens, long_tokens = 8192, 131_072
    per_conv = conv_tokens // BLOCK
    long_docs = [make_chain(rng, long_tokens) for _ in range(2)]
    target = blocks - len(long_docs) * 4 * (long_tokens // BLOCK)
    placements: list[tuple[int, list[int]]] = []
    conversations: list[list[int]] = []
    placed = 0
    while placed < target:
        chain = make_chain(rng, conv_tokens, rng.choice(systems))
        conversations.append(chain)
        for w in rng.sample(range(workers), rng.choice((1, 1, 1, 2, 3))):
            placements.append((w, chain))
            placed += per_conv - 64 // 2
    for doc in long_docs:
        placements.extend((w, doc) for w in rng.sample(range(workers), 4))
    rng.shuffle(placements)
    cached: list[set[int]] = [set() for _ in range(workers)]
    ingest = [(w, p) for w, chain in placements for p in chain_payloads(chain, cached[w], 0)]
    del cached
    stored = sum(len(msgspec.msgpack.decode(p)[1][0]["block_hashes"]) for _, p in ingest)

    # A full cache's steady state: each batch evicts (one single-hash BlockRemoved per block,
    # tail first) as many blocks as the new request stores.
    churn: list[tuple[int, bytes]] = []
    churn_blocks = 0
    for w, chain in placements[: len(placements) // 4]:
        gone_all = block_hashes(chain)[::-1]
        fresh = make_chain(rng, len(chain))
        fresh_hashes = block_hashes(fresh)
        for start in range(0, len(gone_all), BLOCKS_PER_EVENT):
            gone = gone_all[start : start + BLOCKS_PER_EVENT]
            blk = fresh_hashes[start : start + BLOCKS_PER_EVENT]
            events = [
                {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": 0}
                for h in gone
            ]
            events.append(
                stored_event(
                    blk,
                    fresh_hashes[start - 1] if start else None,
                    fresh[start * BLOCK : (start + len(blk)) * BLOCK],
                )
            )
            churn.append((w, _encode(events)))
            churn_blocks += len(gone) + len(blk)
    q8k = []
    for _ in range(queries):
        base = rng.choice(conversations)
        cut = rng.randrange(BLOCK * 8, conv_tokens)
        q8k.append(base[:cut] + make_chain(rng, conv_tokens - cut))
    q128k = [[*rng.choice(long_docs)[: long_tokens - 7], 1, 2, 3, 4, 5, 6, 7] for _ in range(30)]
    return Fixture(workers, ingest, churn, stored, churn_blocks, q8k, q128k)


def run_json(cmd: list[str], timeout: float) -> dict[str, Any]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("nan")


def index_part(args: argparse.Namespace, dyn_py: Path) -> dict[str, Any]:
    fx = build_fixture(args.workers, args.blocks, args.queries, args.seed)
    path = OUT / f"peer_fixture_{args.workers}_{args.blocks}_{args.seed}.msgpack"
    path.write_bytes(msgspec.msgpack.encode(fx))
    sides = HERE / "peer_index_sides.py"
    env_core = ["--core", str(args.core)]
    kv = run_json([sys.executable, str(sides), "kvrouter", str(path), *env_core], 900)
    dyn = run_json([str(dyn_py), str(sides), "dynamo", str(path), *env_core], 900)
    path.unlink()
    dyn["bytes_per_entry"] = round(dyn.pop("rss_growth_bytes") / kv["resident_entries"], 1)
    return {
        "stored_blocks": fx.stored_blocks,
        "churn_blocks": fx.churn_blocks,
        "workers": fx.workers,
        "kvrouter": kv,
        "dynamo": dyn,
        "hits_agree": kv["match_8k_mean_hit_tokens"] == dyn["match_8k_mean_hit_tokens"]
        and kv["match_128k_min_hit_tokens"] == dyn["match_128k_min_hit_tokens"],
        "ratios_kvrouter_over_dynamo": {
            "ingest_blocks_per_s": ratio(
                kv["ingest_blocks_per_s"], dyn["ingest_incl_token_hash_blocks_per_s"]
            ),
            "churn_blocks_per_s": ratio(
                kv["churn_blocks_per_s"], dyn["churn_incl_token_hash_blocks_per_s"]
            ),
            "match_p50_ms_8k": ratio(kv["match_p50_ms_8k"], dyn["match_p50_ms_8k"]),
            "match_p50_ms_128k": ratio(kv["match_p50_ms_128k"], dyn["match_p50_ms_128k"]),
            "bytes_per_entry": ratio(kv["bytes_per_entry"], dyn["bytes_per_entry"]),
        },
        # CPU seconds instead of wall time: what each side costs, whatever else shares the core.
        "cpu_ratios_kvrouter_over_dynamo": {
            "ingest_cpu_per_block": ratio(
                kv["ingest_cpu_us_per_block"],
                dyn["ingest_cpu_us_per_block"] + dyn["token_hash_cpu_us_per_block"],
            ),
            "churn_cpu_per_block": ratio(
                kv["churn_cpu_us_per_block"],
                dyn["churn_cpu_us_per_block"] + dyn["churn_token_hash_cpu_us_per_block"],
            ),
            "match_cpu_p50_8k": ratio(kv["match_cpu_p50_ms_8k"], dyn["match_cpu_p50_ms_8k"]),
            "match_cpu_p50_128k": ratio(kv["match_cpu_p50_ms_128k"], dyn["match_cpu_p50_ms_128k"]),
        },
    }


def events_part(args: argparse.Namespace, dyn_py: Path) -> dict[str, Any]:
    cmd = [
        sys.executable,
        str(HERE / "peer_index_events.py"),
        "--dynamo-python",
        str(dyn_py),
        "--core",
        str(args.core),
        "--blocks-per-s",
        str(args.ep_blocks_per_s),
        "--seconds",
        str(args.ep_seconds),
        "--publishers",
        str(args.ep_publishers),
    ]
    netns = ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$0" "$@"']
    if shutil.which("unshare") and subprocess.run([*netns[:2], "true"]).returncode == 0:
        result = run_json([*netns, *cmd], 900)
        result["network"] = "private namespace, loopback only"
    else:
        result = run_json(cmd, 900)
        result["network"] = "host (Dynamo's HTTP port is bound on all interfaces)"
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small fleet, short event plane")
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--core", type=int, default=max(os.sched_getaffinity(0)))
    ap.add_argument("--ep-blocks-per-s", type=float, default=100_000)
    ap.add_argument("--ep-seconds", type=float, default=12.0)
    ap.add_argument("--ep-publishers", type=int, default=16)
    ap.add_argument("--skip-events", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.blocks, args.queries, args.ep_seconds, args.ep_publishers = 200_000, 100, 4.0, 8
    dyn_py = ensure_venv()
    version = subprocess.run(
        [str(dyn_py), "-m", "pip", "show", "ai-dynamo-runtime"], capture_output=True, text=True
    ).stdout
    result: dict[str, Any] = {
        "load_avg_1m_before": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "core": args.core,
        "python": sys.version.split()[0],
        "dynamo": next((ln.split()[1] for ln in version.splitlines() if "Version:" in ln), "?"),
        "quick": args.quick,
    }
    result["index"] = index_part(args, dyn_py)
    if not args.skip_events:
        result["event_plane"] = events_part(args, dyn_py)
    result["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    result["notes"] = NOTES
    print(json.dumps(result))


if __name__ == "__main__":
    main()
