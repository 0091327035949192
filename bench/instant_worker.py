"""A worker that answers at once, for measuring the router's own cost (bench/proxy_bench.py).

Raw ASGI under uvicorn: ``POST /tokenize`` returns the same 8,191 token ids for every prompt,
``POST /v1/completions`` a fixed one-token completion, ``/health``, ``/v1/models``,
``/metrics`` and ``/kv_event_sources`` the least the router asks for. Routed minus direct
latency against it is the router's own work plus one extra loopback round trip, with no
tokenization or engine time on either side.

With ``--events PORT`` it also publishes KV events as vLLM does (``simulator.publisher``, replay
on ``PORT + 1``) so that the router works on a warm index, as in production: ``--hold N``
stores the first ``N`` of those token ids (the prompts' prefix: every completion then reports
``cached_tokens`` = ``N``, what the router predicts, so verification stays on and agrees), and
``--filler B`` stores ``B`` blocks of unrelated prefixes beside them.

    python bench/instant_worker.py PORT [--events PORT --hold N --filler B]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from typing import Any

import uvicorn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

IDS = [random.Random(0).randrange(100, 32000) for _ in range(8191)]
BLOCK = 16
_TOKENIZE = json.dumps({"count": len(IDS), "max_model_len": 131072, "tokens": IDS}).encode()
_MODELS = json.dumps(
    {"object": "list", "data": [{"id": "sim-model", "object": "model", "root": "sim-model"}]}
).encode()


def completion(cached: int) -> bytes:
    usage = {
        "prompt_tokens": len(IDS),
        "completion_tokens": 1,
        "total_tokens": len(IDS) + 1,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    return json.dumps(
        {
            "id": "cmpl-instant",
            "object": "text_completion",
            "created": 0,
            "model": "sim-model",
            "choices": [{"index": 0, "text": " a", "logprobs": None, "finish_reason": "length"}],
            "usage": usage,
        }
    ).encode()


def make_app(bodies: dict[str, bytes]) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:  # drain the request body
            more = (await receive()).get("more_body", False)
        body = bodies.get(scope["path"], b"{}" if scope["path"] != "/metrics" else b"")
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


def publish_warm_index(port: int, hold: int, filler: int) -> None:
    """Store ``IDS[:hold]`` and ``filler`` unrelated blocks, then keep the stream alive so a
    router that connects later sees a gap and replays everything from sequence 0."""
    from simulator.events import BlockStored, KVEventBatch
    from simulator.publisher import ZmqPublisher

    pub = ZmqPublisher(f"tcp://*:{port}", f"tcp://*:{port + 1}", buffer_steps=1_000_000)
    rng = random.Random(port)
    next_hash = iter(range(1, 1 << 62))

    def chain(tokens: list[int], per_event: int = 64) -> None:
        parent = None
        for start in range(0, len(tokens) - len(tokens) % BLOCK, per_event * BLOCK):
            part = tokens[start : start + per_event * BLOCK]
            hashes = [next(next_hash) for _ in range(len(part) // BLOCK)]
            ev = BlockStored(hashes, parent, part, BLOCK, None, "GPU", None)
            pub.publish(_encode(KVEventBatch(time.time(), [ev], 0)))
            parent = hashes[-1]

    chain(IDS[:hold])
    while filler > 0:
        n = min(filler, 256)
        chain([rng.randrange(100, 32000) for _ in range(n * BLOCK)])
        filler -= n
    while True:  # an empty batch now and then: the router's first message shows the gap
        pub.publish(_encode(KVEventBatch(time.time(), [], 0)))
        time.sleep(0.5)


def _encode(batch: Any) -> bytes:
    import msgspec

    return msgspec.msgpack.encode(batch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("port", type=int)
    ap.add_argument("--events", type=int, default=None, help="PUB port (replay on port + 1)")
    ap.add_argument("--hold", type=int, default=0, help="prefix tokens of the prompts held")
    ap.add_argument("--filler", type=int, default=0, help="unrelated blocks held")
    ns = ap.parse_args()
    cached = min(ns.hold, len(IDS) - 1) // BLOCK * BLOCK if ns.events is not None else 0
    bodies = {"/tokenize": _TOKENIZE, "/v1/completions": completion(cached), "/v1/models": _MODELS}
    if ns.events is not None:
        sources = {"0": {"endpoint": f"tcp://*:{ns.events}", "topic": ""}}
        sources["0"]["replay_endpoint"] = f"tcp://*:{ns.events + 1}"
        bodies["/kv_event_sources"] = json.dumps(sources).encode()
        threading.Thread(
            target=publish_warm_index, args=(ns.events, ns.hold, ns.filler), daemon=True
        ).start()
    uvicorn.run(make_app(bodies), host="127.0.0.1", port=ns.port, log_level="warning")


if __name__ == "__main__":
    main()
