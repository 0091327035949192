"""indexer._native against its Python fallbacks, on one 8,192-token request.

    python bench/native_bench.py           # a few seconds; last line is one JSON object

The two loops every routed request runs (indexer/native.py): turning a vLLM ``/tokenize``
answer's ``"tokens"`` array (8,192 ids in [0, 32000), ~45 KB of JSON) into uint32 bytes, and
chaining the 512 content keys of 16-token units over those bytes. p50 over many runs, in us.
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

from indexer.keys import _chain_keys_py, tokens_to_bytes
from indexer.native import _ids_from_json_py

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
    }
    if _native is not None:
        assert _native.ids_from_json(raw) == _ids_from_json_py(raw) == data
        assert _native.chain_keys(seed, data, UNIT, None) == _chain_keys_py(seed, data, UNIT, None)
        result["ids_from_json_native_us"] = p50_us(lambda: _native.ids_from_json(raw))
        result["chain_keys_native_us"] = p50_us(lambda: _native.chain_keys(seed, data, UNIT, None))
        before = result["ids_from_json_fallback_us"] + result["chain_keys_fallback_us"]
        after = result["ids_from_json_native_us"] + result["chain_keys_native_us"]
        result["total_fallback_us"] = round(before, 2)
        result["total_native_us"] = round(after, 2)
        result["speedup"] = round(before / after, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
