"""Workloads for the routing benchmark: the Mooncake trace and synthetic chat / agentic loops.

A request's prompt is a list of *segments* ``(seed, length)``: segment ``seed`` always expands
to the same pseudo-random token ids (numpy generator seeded with ``seed``), so requests that
list the same leading segments share exactly that token prefix, and nothing else. Token lists
are built lazily at arrival time (the full Mooncake trace is ~145 M prompt tokens) from a
bounded cache of segment token lists.

* ``mooncake``: the Mooncake FAST'25 trace format (``timestamp`` ms, ``input_length``,
  ``output_length``, ``hash_ids`` of 512-token blocks). Block id ``h`` becomes 512 tokens from a
  generator seeded with ``h``; the last block is cut to ``input_length`` (traces/README.md).
* ``chat``: conversations with shared system prompts (Zipf popularity), each turn = previous
  prompt + previous answer + a new user message, think time between turns.
* ``agentic``: agent loops: a shared tool/system preamble, a task prompt, then many steps
  each appending the model's tool call and a (long) tool result: contexts grow to 10^4-10^5.

Arrival times are in seconds at speed 1; the benchmark divides them by a speed-up factor.
"""

from __future__ import annotations

import json
import math
import random
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["Req", "TokenSource", "TraceError", "agentic", "chat", "load_workload", "mooncake"]

VOCAB_LO, VOCAB_HI = 100, 32000
MOONCAKE_BLOCK = 512
# Synthetic workloads draw segment seeds from disjoint ranges so they never collide with each
# other (Mooncake block ids are < 2**31).
_SYS_BASE = 1 << 40
_MSG_BASE = 1 << 41


class TraceError(ValueError):
    """A trace line that is not a Mooncake request; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class Req:
    rid: str
    arrival_s: float
    segments: tuple[tuple[int, int], ...]
    """``(seed, length)`` of each prompt segment, in order."""
    n_tokens: int
    max_tokens: int


class TokenSource:
    """Expands segments to token ids; a bounded LRU of segment token lists."""

    def __init__(self, max_segments: int = 20_000) -> None:
        self.max_segments = max_segments
        self._cache: OrderedDict[tuple[int, int], list[int]] = OrderedDict()

    def segment(self, seed: int, length: int) -> list[int]:
        key = (seed, length)
        toks = self._cache.get(key)
        if toks is not None:
            self._cache.move_to_end(key)
            return toks
        full = max(length, MOONCAKE_BLOCK) if seed < _SYS_BASE else length
        # A cut Mooncake block is the prefix of the full block (same seed, same stream).
        toks = (
            np.random.default_rng(seed).integers(VOCAB_LO, VOCAB_HI, full, dtype=np.int64)[:length]
        ).tolist()
        self._cache[key] = toks
        if len(self._cache) > self.max_segments:
            self._cache.popitem(last=False)
        return toks

    def tokens(self, req: Req) -> list[int]:
        out: list[int] = []
        for seed, length in req.segments:
            out += self.segment(seed, length)
        return out


def mooncake(path: str | Path, limit: int | None = None) -> list[Req]:
    """Requests of a Mooncake-format trace (first ``limit`` lines), arrival in seconds."""
    reqs: list[Req] = []
    with open(path) as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                break
            if not line.strip():
                continue
            try:
                ts, n, out, hashes = _mooncake_fields(line)
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceError(f"{path}: line {i + 1}: {exc}") from None
            segs = []
            left = n
            for h in hashes:
                if left <= 0:
                    break
                take = min(MOONCAKE_BLOCK, left)
                segs.append((int(h), take))
                left -= take
            if left > 0:  # input_length longer than the listed blocks: unique filler
                segs.append((_MSG_BASE + (1 << 30) + i, left))
            reqs.append(Req(f"m{i}", ts / 1000.0, tuple(segs), n, max(1, out)))
    reqs.sort(key=lambda q: q.arrival_s)
    return reqs


def _mooncake_fields(line: str) -> tuple[float, int, int, list[int]]:
    """``(timestamp ms, input_length, output_length, hash_ids)`` of one trace line."""
    try:
        r = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc.msg} at column {exc.colno}") from None
    if not isinstance(r, dict):
        raise ValueError(f"expected a JSON object, got {type(r).__name__}")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in r]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    ts, n, out, hashes = r["timestamp"], r["input_length"], r["output_length"], r["hash_ids"]
    for name, v in (("timestamp", ts), ("input_length", n), ("output_length", out)):
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < math.inf:
            raise ValueError(f"{name} must be a finite non-negative number, got {v!r}")
    if not isinstance(hashes, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hashes
    ):
        raise ValueError("hash_ids must be a list of non-negative integers")
    return float(ts), int(n), int(out), hashes


def _zipf_pick(rng: random.Random, n: int, s: float = 1.1) -> int:
    weights = [1.0 / (k + 1) ** s for k in range(n)]
    return rng.choices(range(n), weights)[0]


def chat(
    n_conversations: int = 600,
    seed: int = 0,
    system_prompts: int = 16,
    system_tokens: tuple[int, int] = (1000, 4000),
    turns_mean: float = 5.0,
    user_tokens: tuple[int, int] = (50, 600),
    answer_tokens: tuple[int, int] = (50, 500),
    rate_conversations_s: float = 1.0,
    think_s: float = 30.0,
    max_context: int = 32000,
) -> list[Req]:
    """Multi-turn chat: shared system prompts, growing conversations, open-loop arrivals."""
    rng = random.Random(seed)
    sys_len = [rng.randint(*system_tokens) for _ in range(system_prompts)]
    reqs: list[Req] = []
    msg = _MSG_BASE + seed * (1 << 32)
    t = 0.0
    for c in range(n_conversations):
        t += rng.expovariate(rate_conversations_s)
        s = _zipf_pick(rng, system_prompts)
        segs: list[tuple[int, int]] = [(_SYS_BASE + s, sys_len[s])]
        n = sys_len[s]
        arrival = t
        turns = max(1, int(rng.expovariate(1.0 / turns_mean)) + 1)
        for k in range(turns):
            u = rng.randint(*user_tokens)
            msg += 1
            segs.append((msg, u))
            n += u
            if n >= max_context:
                break
            out = rng.randint(*answer_tokens)
            reqs.append(Req(f"c{c}.{k}", arrival, tuple(segs), n, out))
            msg += 1
            segs.append((msg, out))  # the answer, as the next turn's template renders it
            n += out
            arrival += rng.expovariate(1.0 / think_s)
    reqs.sort(key=lambda q: q.arrival_s)
    return reqs


def agentic(
    n_tasks: int = 120,
    seed: int = 0,
    preambles: int = 4,
    preamble_tokens: tuple[int, int] = (4000, 8000),
    task_tokens: tuple[int, int] = (300, 2000),
    steps: tuple[int, int] = (5, 30),
    call_tokens: tuple[int, int] = (30, 200),
    result_tokens: tuple[int, int] = (200, 3000),
    rate_tasks_s: float = 0.2,
    step_gap_s: float = 4.0,
    max_context: int = 100_000,
) -> list[Req]:
    """Agent loops: each step re-sends the whole growing context plus the last tool result."""
    rng = random.Random(seed)
    pre_len = [rng.randint(*preamble_tokens) for _ in range(preambles)]
    reqs: list[Req] = []
    msg = _MSG_BASE + (seed + 7919) * (1 << 32)
    t = 0.0
    for a in range(n_tasks):
        t += rng.expovariate(rate_tasks_s)
        p = rng.randrange(preambles)
        msg += 1
        task = rng.randint(*task_tokens)
        segs: list[tuple[int, int]] = [(_SYS_BASE + 1000 + p, pre_len[p]), (msg, task)]
        n = pre_len[p] + task
        arrival = t
        for k in range(rng.randint(*steps)):
            out = rng.randint(*call_tokens)
            reqs.append(Req(f"a{a}.{k}", arrival, tuple(segs), n, out))
            res = rng.randint(*result_tokens)
            msg += 2
            segs += [(msg - 1, out), (msg, res)]
            n += out + res
            if n >= max_context:
                break
            arrival += rng.expovariate(1.0 / step_gap_s) + 0.5
    reqs.sort(key=lambda q: q.arrival_s)
    return reqs


def load_workload(
    name: str, trace: str | None = None, limit: int | None = None, seed: int = 0, scale: float = 1.0
) -> list[Req]:
    """``scale`` multiplies the number of conversations / tasks of synthetic workloads."""
    if name == "mooncake":
        if trace is None:
            raise ValueError("mooncake workload needs a trace path")
        return mooncake(trace, limit)
    if name == "chat":
        reqs = chat(n_conversations=max(1, int(600 * scale)), seed=seed)
    elif name == "agentic":
        reqs = agentic(n_tasks=max(1, int(120 * scale)), seed=seed)
    else:
        raise ValueError(f"unknown workload {name!r}")
    return reqs[:limit] if limit is not None else reqs
