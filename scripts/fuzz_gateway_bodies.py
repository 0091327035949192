"""Malformed request bodies against the router in front of one simulated worker: every answer
must come within a bound and none may be a 5xx.

Each body is a valid one for its API (chat completions with a tool round trip and
``tool_choice: "none"``, completions, Anthropic messages, Responses, ``/debug/route``) with a
few values replaced, removed or added at random (odd types, empty containers, huge ints,
unknown keys), sent over real HTTP; the worker tokenizes with a model folder whose template
renders tools, and the router tokenizes remotely or with that folder (``--local``). Afterwards
the worker must still answer ``/health`` and a completion. Prints a one-line JSON summary
(answers by path and status) and the first offending bodies:

    python scripts/fuzz_gateway_bodies.py --n 1500 --seed 1 [--local]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

ODD: list[Any] = [None, True, 0, -1, 1.5, "", "x", "none", [], {}, [1], ["a"], [{}], [None],
                  {"a": 1}, [[1, 2]], {"type": []}, 2**70]  # fmt: skip
KEYS = ["tools", "tool_choice", "messages", "content", "role", "type", "prompt", "max_tokens",
        "stream", "n", "chat_template_kwargs", "continue_final_message", "add_generation_prompt",
        "truncate_prompt_tokens", "priority", "cache_salt", "documents", "reasoning_effort",
        "input", "system", "instructions"]  # fmt: skip
TOOL = {"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}
CALL = {"id": "c", "type": "function", "function": {"name": "run", "arguments": "{}"}}
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "model": "sim-model",
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "a", "tool_calls": [CALL]},
                     {"role": "tool", "tool_call_id": "c", "content": "r"}],
        "tools": [TOOL], "tool_choice": "none", "max_tokens": 2,
    },
    "/v1/completions": {"model": "sim-model", "prompt": "hello there", "max_tokens": 2},
    "/v1/messages": {
        "model": "sim-model", "max_tokens": 2, "system": [{"type": "text", "text": "s"}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "tools": [{"name": "x", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "none"},
    },
    "/v1/responses": {
        "model": "sim-model", "input": [{"type": "message", "role": "user", "content": "hi"}],
        "tools": [{"type": "function", "name": "f", "parameters": {}}], "tool_choice": "none",
        "max_output_tokens": 2,
    },
    "/debug/route": {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}],
                     "tools": [TOOL], "tool_choice": "none"},
}  # fmt: skip
SLOW_S = 2.0


def mutate(rng: random.Random, v: Any, depth: int = 0) -> Any:
    if depth > 3 or rng.random() < 0.25:
        return rng.choice(ODD)
    if isinstance(v, dict):
        v = dict(v)
        if v and rng.random() < 0.6:
            k = rng.choice(list(v))
            v[k] = mutate(rng, v[k], depth + 1)
        elif v and rng.random() < 0.5:
            v.pop(rng.choice(list(v)))
        else:
            v[rng.choice(KEYS)] = rng.choice(ODD)
        return v
    if isinstance(v, list):
        v = list(v)
        if v and rng.random() < 0.6:
            i = rng.randrange(len(v))
            v[i] = mutate(rng, v[i], depth + 1)
        else:
            v.append(rng.choice(ODD))
        return v
    return rng.choice(ODD)


async def run(n: int, seed: int, local: bool) -> None:
    import httpx
    from test_router_support import TOOLS_TEMPLATE, config_for, serve_router, until, write_tokenizer

    from simulator.testing import running_fleet

    rng = random.Random(seed)
    model = write_tokenizer(Path(tempfile.mkdtemp()) / "model", template=TOOLS_TEMPLATE)
    fast = {"decode_ms": 1, "prefill_tps": 400000, "step_overhead_ms": 0.1}
    with running_fleet(1, tokenizer=model, **fast) as ws:
        cfg = config_for(ws, **({"tokenizer": {"mode": "local", "path": model}} if local else {}))
        async with serve_router(cfg) as (base, _), httpx.AsyncClient(timeout=20) as c:
            await until(lambda: c.get(base + "/ready"), 30)
            codes: Counter[str] = Counter()
            bad = []
            for _ in range(n):
                path = rng.choice(list(BODIES))
                body = mutate(rng, BODIES[path])
                t0 = time.monotonic()
                try:
                    r = await c.post(base + path, json=body)
                    status: Any = r.status_code
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                took = time.monotonic() - t0
                codes[f"{path} {status}"] += 1
                if not isinstance(status, int) or status >= 500 or took > SLOW_S:
                    bad.append({"path": path, "status": status, "s": round(took, 2), "body": body})
            worker = ws[0].url
            health = (await c.get(worker + "/health", timeout=5)).status_code
            probe = {"model": "sim-model", "prompt": "hi", "max_tokens": 2}
            served = (await c.post(worker + "/v1/completions", json=probe, timeout=5)).status_code
    summary = {
        "n": n,
        "bad": len(bad),
        "worker_after": [health, served],
        **dict(sorted(codes.items())),
    }
    print(json.dumps(summary))
    for b in bad[:5]:
        print(json.dumps(b)[:600])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--local", action="store_true", help="the router tokenizes with the folder")
    a = ap.parse_args()
    asyncio.run(run(a.n, a.seed, a.local))


if __name__ == "__main__":
    main()
