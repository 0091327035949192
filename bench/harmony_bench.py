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
* ``first_sight_stall_ms``: the longest the event loop went without a turn for anything else
  during that first-sight tokenization (a task that only yields, timed between its turns): the
  library holds the GIL while it renders, so this is what other requests wait.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable
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


async def timed_with_stall(work: Awaitable[Any]) -> tuple[float, float]:
    """How long ``work`` took, and the longest the event loop went meanwhile without a turn for
    a task that does nothing but yield."""
    stall = 0.0
    done = False

    async def others() -> None:
        nonlocal stall
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0)
            now = time.perf_counter()
            stall = max(stall, now - last)
            last = now

    ticker = asyncio.create_task(others())
    await asyncio.sleep(0)
    t = time.perf_counter()
    await work
    elapsed = time.perf_counter() - t
    done = True
    await ticker
    return elapsed, stall


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
        "first_sight_ms": {},
        "first_sight_stall_ms": {},
    }
    for turns in (4, 32, 128, 384):
        history = conversation(turns)
        cold, stalls = [], []
        for run in range(3):
            fresh = PromptTokenizer(16, harmony=HarmonyChats("2026-01-01", everywhere=True))
            await fresh.tokenize({"messages": [{"role": "user", "content": "Hi"}]}, True, 0, None)
            body = {"messages": [*history, {"role": "user", "content": f"next {run}"}]}
            elapsed, stall = await timed_with_stall(fresh.tokenize(body, True, 0, None))
            cold.append(elapsed)
            stalls.append(stall)
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
        out["first_sight_stall_ms"][str(n)] = round(statistics.median(stalls) * 1000, 2)
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())))
