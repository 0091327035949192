"""A worker that answers at once, for measuring the router's own cost (bench/proxy_bench.py).

Raw ASGI under uvicorn: ``POST /tokenize`` returns the same 8,191 token ids for every prompt,
``POST /v1/completions`` a fixed one-token completion, ``/health``, ``/v1/models`` and
``/metrics`` the least the router asks for; it publishes no KV events. Routed minus direct
latency against it is the router's own work plus one extra loopback round trip, with no
tokenization or engine time on either side.

    python bench/instant_worker.py PORT
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any

import uvicorn

IDS = [random.Random(0).randrange(100, 32000) for _ in range(8191)]
_TOKENIZE = json.dumps({"count": len(IDS), "max_model_len": 131072, "tokens": IDS}).encode()
_COMPLETION = json.dumps(
    {
        "id": "cmpl-instant",
        "object": "text_completion",
        "created": 0,
        "model": "sim-model",
        "choices": [{"index": 0, "text": " a", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": len(IDS), "completion_tokens": 1, "total_tokens": len(IDS) + 1},
    }
).encode()
_MODELS = json.dumps(
    {"object": "list", "data": [{"id": "sim-model", "object": "model", "root": "sim-model"}]}
).encode()
_BODIES = {"/tokenize": _TOKENIZE, "/v1/completions": _COMPLETION, "/v1/models": _MODELS}


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    more = True
    while more:  # drain the request body
        more = (await receive()).get("more_body", False)
    body = _BODIES.get(scope["path"], b"{}" if scope["path"] != "/metrics" else b"")
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
