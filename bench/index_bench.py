"""Index benchmark: ingest rate, match latency and memory of the prefix index.

    python bench/index_bench.py            # ~30 s; last line is one JSON object

Shape: 64 engines, ~1,000,000 resident (engine, block) entries, block size 16.
Payloads are realistic vLLM 0.33 msgpack batches of 32-block ``BlockStored`` events (map
encoding, parents chained, int hashes >= 2**63 included), pre-encoded so that the timed part is
exactly decode + apply. Conversations share system prompts and some are resident on several
engines, as in a real fleet. ``match`` latency includes computing the prompt's content keys.
RSS growth is measured around ingest and divided by the resident entries. The collector runs as
``kvrouter serve`` runs it: enabled, start-up objects frozen (``gc.freeze()``).

``match_keys_p50_ms_*``: the router's call, ``match_keys`` from keys it computed beforehand.
``match_p50_ms_128k_swa``: a hybrid full-attention + sliding-window model whose 64 engines hold a
128k-token prefix in full attention but not the window's tail (:func:`hybrid_swa_case`).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

import msgspec
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from indexer.index import PrefixIndex
from indexer.wire import decode_payload

BLOCK = 16
BLOCKS_PER_EVENT = 32
MODEL = "bench-model"


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def make_chain(rng: random.Random, tokens: int, prefix: list[int] | None = None) -> list[int]:
    body = [rng.randrange(32000) for _ in range(tokens - (len(prefix) if prefix else 0))]
    return (prefix or []) + body


def block_hashes(chain: list[int]) -> list[int]:
    """Engine hashes the way vLLM makes them: chained over content, so equal prefixes hash
    equally on every engine (vLLM >= 0.25 default seed). Not the index's content keys."""
    out, h = [], 0x5EED
    for i in range(len(chain) // BLOCK):
        h = xxhash.xxh3_64_intdigest(str(chain[i * BLOCK : (i + 1) * BLOCK]).encode(), h)
        out.append(h)
    return out


def stored_event(
    hashes: list[int],
    parent: int | None,
    tokens: list[int],
    group: int = 0,
    kind: str = "full_attention",
    window: int | None = None,
) -> dict:
    """A vLLM 0.33 BlockStored event map (GPU; full attention unless told)."""
    event = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
        "group_idx": group,
        "kv_cache_spec_kind": kind,
    }
    if window is not None:
        event["kv_cache_spec_sliding_window"] = window
    return event


def chain_payloads(chain: list[int], cached: set[int], rank: int) -> list[bytes]:
    """vLLM-shaped batches storing the blocks of ``chain`` the engine does not hold yet.

    Like vLLM, blocks already cached on the engine are hits, not stores: events start at the
    first missing block with the previous block as parent, 32 blocks per BlockStored.
    """
    hashes = block_hashes(chain)
    first = 0
    while first < len(hashes) and hashes[first] in cached:
        first += 1
    cached.update(hashes[first:])
    payloads = []
    for start in range(first, len(hashes), BLOCKS_PER_EVENT):
        blk = hashes[start : start + BLOCKS_PER_EVENT]
        event = stored_event(
            blk,
            hashes[start - 1] if start else None,
            chain[start * BLOCK : (start + len(blk)) * BLOCK],
        )
        payloads.append(msgspec.msgpack.encode([time.time(), [event], rank]))
    return payloads


def timed_keys(index: PrefixIndex, prompts: list[list[int]]) -> list[float]:
    """Per prompt: ``match_keys`` latency (ms) from keys computed beforehand, with the engine
    list given, as the router calls it (router/core.py; its tokenizer caches the keys)."""
    root = index.root(MODEL)
    engines = index.engines()
    times = []
    for p in prompts:
        keys = index.prompt_keys(p, root)
        t = time.perf_counter()
        index.match_keys(keys, len(p), engines)
        times.append((time.perf_counter() - t) * 1000)
    return times


def timed(index: PrefixIndex, prompts: list[list[int]]) -> tuple[list[float], list[int]]:
    """Per prompt: match latency (ms, content keys included) and the best engine's GPU hit."""
    root = index.root(MODEL)
    times, hits = [], []
    for p in prompts:
        t = time.perf_counter()
        result = index.match(p, root)
        times.append((time.perf_counter() - t) * 1000)
        hits.append(max((m.gpu_tokens for m in result.values()), default=0))
    return times, hits


SWA_WINDOW = 1024
SWA_HELD_TOKENS = 1024


def hybrid_swa_case(
    workers: int, queries: int, rng: random.Random
) -> tuple[list[float], list[int]]:
    """The sliding-window search's worst case: engines of a hybrid model (full attention and a
    1,024-token window, 16-token blocks) that each hold a 128k-token document's full-attention
    blocks but its window blocks only for the first 1,024 tokens. Every engine's hit is 1,024,
    found below ~8k candidate points where the window's tail is missing."""
    tokens = 131_072
    doc = make_chain(rng, tokens)
    hashes = block_hashes(doc)
    payloads = []
    for start in range(0, len(hashes), BLOCKS_PER_EVENT):
        blk = hashes[start : start + BLOCKS_PER_EVENT]
        parent = hashes[start - 1] if start else None
        part = doc[start * BLOCK : (start + len(blk)) * BLOCK]
        events = [stored_event(blk, parent, part)]
        if start * BLOCK < SWA_HELD_TOKENS:
            events.append(stored_event(blk, parent, part, 1, "sliding_window", SWA_WINDOW))
        payloads.append(msgspec.msgpack.encode([time.time(), events, 0]))
    index = PrefixIndex(unit=16, max_entries=10_000_000)
    for i in range(workers):
        engine = (f"http://hybrid-{i}:8000", 0)
        index.add_engine(engine, MODEL)
        for payload in payloads:
            index.apply(engine, decode_payload(payload).events)
    return timed(index, [[*doc[: tokens - 7], 1, 2, 3, 4, 5, 6, 7] for _ in range(queries)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--swa-queries", type=int, default=30)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    rng = random.Random(args.seed)

    # A fleet-like population: 8k-token conversations, 8 shared system prompts of 1k tokens,
    # a quarter of conversations resident on 2-3 engines, plus 128k-token documents on 4 engines.
    systems = [make_chain(rng, 1024) for _ in range(8)]
    conv_tokens = 8192
    per_conv = conv_tokens // BLOCK
    long_tokens = 131_072
    long_docs = [make_chain(rng, long_tokens) for _ in range(2)]
    long_blocks = len(long_docs) * 4 * (long_tokens // BLOCK)
    target = args.blocks - long_blocks
    engines = [(f"http://worker-{i}:8000", 0) for i in range(args.workers)]
    placements: list[tuple[int, list[int]]] = []  # (engine idx, chain)
    conversations: list[list[int]] = []
    placed = 0
    while placed < target:
        chain = make_chain(rng, conv_tokens, rng.choice(systems))
        conversations.append(chain)
        copies = rng.choice((1, 1, 1, 2, 3))
        for w in rng.sample(range(args.workers), copies):
            placements.append((w, chain))
            placed += per_conv - 64 // 2  # system prompts are often already cached
    for doc in long_docs:
        for w in rng.sample(range(args.workers), 4):
            placements.append((w, doc))
    rng.shuffle(placements)
    cached: list[set[int]] = [set() for _ in engines]
    payloads = [
        (engines[w], p) for w, chain in placements for p in chain_payloads(chain, cached[w], 0)
    ]
    del cached
    total_blocks = sum(len(msgspec.msgpack.decode(p)[1][0]["block_hashes"]) for _, p in payloads)

    # Steady state of a full cache: every step evicts as many blocks as it stores. vLLM sends
    # one single-hash BlockRemoved per evicted block (tail first), in the same batch as the
    # new request's BlockStored. Churn = stored + removed blocks per second.
    churn_payloads = []
    victims = placements[: len(placements) // 4]
    for w, chain in victims:
        hashes = block_hashes(chain)
        fresh = make_chain(rng, len(chain))
        fresh_hashes = block_hashes(fresh)
        for start in range(0, len(hashes), BLOCKS_PER_EVENT):
            gone = hashes[::-1][start : start + BLOCKS_PER_EVENT]
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
            churn_payloads.append((engines[w], msgspec.msgpack.encode([time.time(), events, 0])))
    churn_blocks = sum(
        len(e["block_hashes"]) for _, p in churn_payloads for e in msgspec.msgpack.decode(p)[1]
    )

    index = PrefixIndex(unit=16, max_entries=10_000_000)
    for e in engines:
        index.add_engine(e, MODEL)
    # The collector runs as under `kvrouter serve` (router/serving.py): enabled, with the
    # start-up objects (here: the pre-encoded payloads) frozen out of its reach.
    gc.collect()
    gc.freeze()
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    for engine, payload in payloads:
        index.apply(engine, decode_payload(payload).events)
    ingest_s = time.perf_counter() - t0
    gc.collect()
    rss1 = rss_bytes()
    resident = index.total_entries

    t0 = time.perf_counter()
    for engine, payload in churn_payloads:
        index.apply(engine, decode_payload(payload).events)
    churn_s = time.perf_counter() - t0

    q8 = []
    for _ in range(args.queries):
        base = rng.choice(conversations)
        cut = rng.randrange(BLOCK * 8, conv_tokens)
        q8.append(base[:cut] + make_chain(rng, conv_tokens - cut))
    t8, h8 = timed(index, q8)
    q128 = [[*rng.choice(long_docs)[: long_tokens - 7], 1, 2, 3, 4, 5, 6, 7] for _ in range(30)]
    t128, h128 = timed(index, q128)
    k8, k128 = timed_keys(index, q8), timed_keys(index, q128)
    del index
    gc.collect()
    tswa, hswa = hybrid_swa_case(args.workers, args.swa_queries, random.Random(args.seed + 1))
    result = {
        "workers": args.workers,
        "resident_blocks": resident,
        "stored_blocks": total_blocks,
        "ingest_s": round(ingest_s, 3),
        "ingest_blocks_per_s": round(total_blocks / ingest_s),
        "churn_blocks_per_s": round(churn_blocks / churn_s),
        "match_p50_ms_8k": round(statistics.median(t8), 3),
        "match_p99_ms_8k": round(sorted(t8)[int(len(t8) * 0.99) - 1], 3),
        "match_p50_ms_128k": round(statistics.median(t128), 3),
        "match_keys_p50_ms_8k": round(statistics.median(k8), 3),
        "match_keys_p50_ms_128k": round(statistics.median(k128), 3),
        "match_8k_mean_hit_tokens": round(statistics.mean(h8)),
        "match_128k_hit_tokens": min(h128),
        "match_p50_ms_128k_swa": round(statistics.median(tswa), 3),
        "match_128k_swa_hit_tokens": min(hswa),
        "bytes_per_block": round((rss1 - rss0) / max(resident, 1), 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
