"""What rendering GPT-OSS chats in harmony costs the router.

    python bench/harmony_bench.py          # ~5 s; last line is one JSON object

The router renders a GPT-OSS model's chats itself (router/harmony.py), on the request path,
where a template model's chats cost one ``/tokenize`` round trip to a worker. Measured through
the product's path, :class:`router.tokenize.PromptTokenizer` with a
:class:`router.harmony.HarmonyChats`:

* ``renderer_load_s``, ``renderer_rss_mb``: the first harmony chat loads the renderer (the
  o200k vocabulary); what that takes and what it adds to the process's resident memory. A fleet
  without GPT-OSS never loads it.
* ``turn_ms``: per conversation size (the prompt's tokens), p50 of tokenizing the conversation's
  next turn after its earlier turn went through the same router (each run a different last
  message, so no run is served from the tokenizer's prompt cache): the new messages rendered,
  the earlier ones' ids from the renderer's message cache, the content keys, the earlier turn's
  keys reused as the product reuses them.
* ``first_sight_ms``: the same turn where the router has seen none of the conversation (a new
  replica, a conversation a balancer sent elsewhere until now): every message rendered.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from router.harmony import HarmonyChats
from router.tokenize import PromptTokenizer

RUNS = 7
TURN_WORDS = 80
"""Words per user message (about 160 harmony tokens with its framing)."""


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def conversation(turns: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful assistant."}]
    for i in range(turns):
        words = " ".join(f"w{i}x{j}" for j in range(TURN_WORDS))
        msgs += [{"role": "user", "content": words}, {"role": "assistant", "content": "ok " * 20}]
    return msgs


async def main() -> dict[str, Any]:
    tok = PromptTokenizer(16, harmony=HarmonyChats("2026-01-01", everywhere=True))
    before = rss_mb()
    t = time.perf_counter()
    first = await tok.tokenize({"messages": [{"role": "user", "content": "Hi"}]}, True, 0, None)
    load_s = time.perf_counter() - t
    assert first.source == "harmony", first.source
    out: dict[str, Any] = {
        "renderer_load_s": round(load_s, 3),
        "renderer_rss_mb": round(rss_mb() - before, 1),
        "turn_ms": {},
    }
    out["first_sight_ms"] = {}
    for turns in (4, 32, 128, 384):
        history = conversation(turns)
        cold = []
        for run in range(3):
            fresh = PromptTokenizer(16, harmony=HarmonyChats("2026-01-01", everywhere=True))
            await fresh.tokenize({"messages": [{"role": "user", "content": "Hi"}]}, True, 0, None)
            body = {"messages": [*history, {"role": "user", "content": f"next {run}"}]}
            t = time.perf_counter()
            await fresh.tokenize(body, True, 0, None)
            cold.append(time.perf_counter() - t)
        await tok.tokenize({"messages": history[:-1]}, True, 0, None)  # the earlier turn
        times, n = [], 0
        for run in range(RUNS):
            body = {"messages": [*history, {"role": "user", "content": f"next {run}"}]}
            t = time.perf_counter()
            got = await tok.tokenize(body, True, 0, None)
            times.append(time.perf_counter() - t)
            assert got.source.startswith("harmony"), got.source
            n = got.n_tokens
        out["turn_ms"][str(n)] = round(statistics.median(times) * 1000, 2)
        out["first_sight_ms"][str(n)] = round(statistics.median(cold) * 1000, 2)
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())))
