"""indexer._native against its Python fallbacks, on one 8,192-token request.

    python bench/native_bench.py           # a few seconds; last line is one JSON object

The loops every routed request runs (indexer/native.py): turning a vLLM ``/tokenize``
answer's ``"tokens"`` array (8,192 ids in [0, 32000), ~45 KB of JSON) into uint32 bytes,
chaining the 512 content keys of 16-token units over those bytes, and
``full_attention_run`` over those keys (``full_run_us``). p50 over many runs, in us.

``full_run_us``: a real PrefixIndex (engines fed ``BlockStored`` events as tests/test_index.py
does) where 1 or 16 engines each hold all 512 blocks of the prompt (the longest scan: no engine
drops out), ``full_attention_run`` timed with ``indexer.hit_rules.run_scan`` set to C ("native")
and to the Python fallback (as fast as the loop it replaced: 38 us both, measured once). The same
512 entries are looked up on every run, so they stay in the CPU caches: in a large index most
lookups miss them and every variant is slower by about the same number of memory accesses.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import indexer.hit_rules
from indexer.hit_rules import full_attention_run
from indexer.index import PrefixIndex
from indexer.keys import _chain_keys_py, tokens_to_bytes
from indexer.native import _ids_from_json_py, _ids_to_json_py, _run_scan_py
from indexer.types import GPU
from indexer.wire import BlockStored

try:
    from indexer import _native
except ImportError:
    _native = None

TOKENS = 8192
UNIT = 16
REPS = 2000


def p50_us(fn: Callable[[], object], reps: int = REPS) -> float:
    for _ in range(reps // 10):  # warm up
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return round(statistics.median(times) / 1000, 2)


def full_run_us(n_engines: int, rng: random.Random) -> dict[str, float]:
    """p50 of full_attention_run for a 512-block prompt that every one of n_engines holds whole."""
    bs = UNIT
    tokens = [rng.randrange(32000) for _ in range(TOKENS)]
    index = PrefixIndex()
    for i in range(n_engines):
        engine = (f"http://w{i}", 0)
        index.add_engine(engine, "m")
        event = BlockStored(
            block_hashes=[i * 10_000 + b for b in range(TOKENS // bs)],
            parent_block_hash=None,
            token_ids=tokens,
            block_size=bs,
            lora_id=None,
            medium=GPU,
            lora_name=None,
            extra_keys=None,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
            kv_cache_spec_sliding_window=None,
        )
        index.apply(engine, [event])
    query = [*tokens, 7]  # 8,193 tokens: the hit is capped at 8,192, all 512 blocks
    keys = index.prompt_keys(query, index.root("m"))
    res = index._residency.tables[(0, GPU)]
    alive = (1 << n_engines) - 1
    limit = TOKENS
    want = dict.fromkeys(range(n_engines), TOKENS)
    out: dict[str, float] = {}
    impls = {"fallback": _run_scan_py}
    if _native is not None:
        impls["native"] = _native.run_scan
    for name, impl in impls.items():
        indexer.hit_rules.run_scan = impl  # type: ignore[assignment]
        assert full_attention_run(res, keys, bs, UNIT, limit, alive) == want
        out[name] = p50_us(lambda: full_attention_run(res, keys, bs, UNIT, limit, alive))
    return out


def main() -> None:
    rng = random.Random(0)
    ids = [rng.randrange(32000) for _ in range(TOKENS)]
    answer = json.dumps(
        {"count": TOKENS, "max_model_len": 32768, "tokens": ids}, separators=(",", ":")
    ).encode()
    raw = msgspec.json.decode(answer, type=dict[str, msgspec.Raw])["tokens"]
    data = tokens_to_bytes(ids)
    seed = 0x9E3779B97F4A7C15
    decode = msgspec.json.Decoder(list[int]).decode
    result: dict[str, object] = {
        "tokens": TOKENS,
        "json_bytes": len(raw),
        "keys": TOKENS // UNIT,
        "native_built": _native is not None,
        # what the request path did before: msgspec list[int], then array("I")
        "ids_decode_then_pack_us": p50_us(lambda: tokens_to_bytes(decode(raw))),
        "ids_from_json_fallback_us": p50_us(lambda: _ids_from_json_py(raw)),
        "chain_keys_fallback_us": p50_us(lambda: _chain_keys_py(seed, data, UNIT, None)),
        # a cached prompt's ids written into the upstream body
        "ids_to_json_fallback_us": p50_us(lambda: _ids_to_json_py(data)),
    }
    if _native is not None:
        assert _native.ids_from_json(raw) == _ids_from_json_py(raw) == data
        assert _native.chain_keys(seed, data, UNIT, None) == _chain_keys_py(seed, data, UNIT, None)
        result["ids_from_json_native_us"] = p50_us(lambda: _native.ids_from_json(raw))
        result["chain_keys_native_us"] = p50_us(lambda: _native.chain_keys(seed, data, UNIT, None))
        assert _native.ids_to_json(data) == _ids_to_json_py(data)
        result["ids_to_json_native_us"] = p50_us(lambda: _native.ids_to_json(data))
        before = result["ids_from_json_fallback_us"] + result["chain_keys_fallback_us"]
        after = result["ids_from_json_native_us"] + result["chain_keys_native_us"]
        result["total_fallback_us"] = round(before, 2)
        result["total_native_us"] = round(after, 2)
        result["speedup"] = round(before / after, 1)
    saved = indexer.hit_rules.run_scan
    try:
        result["full_run_us"] = {f"engines_{n}": full_run_us(n, random.Random(n)) for n in (1, 16)}
    finally:
        indexer.hit_rules.run_scan = saved
    print(json.dumps(result))


if __name__ == "__main__":
    main()
