"""Workloads for the routing benchmark: the Mooncake trace and synthetic chat / agentic loops.

A request's prompt is a list of *segments* ``(seed, length)``: segment ``seed`` always expands
to the same pseudo-random token ids (numpy generator seeded with ``seed``), so requests that
list the same leading segments share exactly that token prefix, and nothing else. Token lists
are built lazily at arrival time (the full Mooncake trace is ~145 M prompt tokens) from a
bounded cache of segment token lists.

* ``mooncake``: the Mooncake FAST'25 trace format (``timestamp`` ms, ``input_length``,
  ``output_length``, ``hash_ids`` of 512-token blocks), and the same fields as Alibaba's Qwen
  Bailian traces write them (timestamps in seconds, 16-token blocks; :func:`read_trace`). Block
  id ``h`` becomes a block of tokens from a generator seeded with ``h``; the last block is cut
  to ``input_length``.
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
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

__all__ = [
    "Req",
    "TokenSource",
    "TraceError",
    "TraceFormat",
    "agentic",
    "chat",
    "infer_block_tokens",
    "load_workload",
    "mooncake",
    "read_trace",
    "spread_arrivals",
]

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
    """Expands segments to token ids; an LRU of segment token lists, ``max_tokens`` in all.

    numpy draws bounded integers one after another from the seeded stream, so ``length``
    tokens of seed ``h`` are the prefix of any longer draw of ``h``: a trace's last block, cut
    to its request's ``input_length``, is the prefix of the same block listed whole elsewhere.
    """

    def __init__(self, max_tokens: int = 10_000_000) -> None:
        self.max_tokens = max_tokens
        self._held = 0
        self._cache: OrderedDict[tuple[int, int], list[int]] = OrderedDict()

    def segment(self, seed: int, length: int) -> list[int]:
        key = (seed, length)
        toks = self._cache.get(key)
        if toks is not None:
            self._cache.move_to_end(key)
            return toks
        toks = np.random.default_rng(seed).integers(VOCAB_LO, VOCAB_HI, length).tolist()
        self._cache[key] = toks
        self._held += length
        while self._held > self.max_tokens and len(self._cache) > 1:
            self._held -= len(self._cache.popitem(last=False)[1])
        return toks

    def tokens(self, req: Req) -> list[int]:
        out: list[int] = []
        for seed, length in req.segments:
            out += self.segment(seed, length)
        return out


@dataclass(frozen=True, slots=True)
class TraceFormat:
    """How a trace's lines read: tokens per ``hash_ids`` entry, and the timestamps' unit."""

    block_tokens: int
    block_tokens_from: str
    """``"inferred"`` (from the lines' lengths) or ``"given"``."""
    time_unit: str
    """``"ms"`` (Mooncake) or ``"s"`` (Alibaba's Qwen Bailian traces)."""
    time_unit_from: str


BLOCK_CANDIDATES = tuple(1 << k for k in range(4, 15))  # 16 .. 16384 tokens per hash id
# Trace block ids at or above this are renumbered below it (first seen, first numbered), so a
# trace of 64-bit hashes never reaches the synthetic workloads' seed ranges.
_TRACE_ID_LIMIT = 1 << 39


def infer_block_tokens(lines: list[tuple[int, int]]) -> int | None:
    """Tokens per hash id: the candidate for which ``len(hash_ids) == ceil(input_length / B)``
    on the most lines of ``(input_length, len(hash_ids))``, larger first on a tie (one-block
    lines fit every candidate above their length). None when no line has two or more ids."""
    if not any(k >= 2 for _, k in lines):
        return None
    votes = dict.fromkeys(BLOCK_CANDIDATES, 0)
    for n, k in lines:
        if k >= 2:
            for b in BLOCK_CANDIDATES:
                votes[b] += -(-n // b) == k
    return max(BLOCK_CANDIDATES, key=lambda b: (votes[b], b))


def read_trace(
    path: str | Path,
    limit: int | None = None,
    block_tokens: int | None = None,
    time_unit: str | None = None,
) -> tuple[list[Req], TraceFormat]:
    """Requests of a Mooncake-format trace (first ``limit`` lines), arrival in seconds.

    Mooncake's traces list 512-token blocks and millisecond timestamps; Alibaba's Qwen Bailian
    traces (``chat_id``, ``parent_chat_id``, ``turn``, ``type`` besides) list 16-token blocks
    and timestamps in seconds. Unless given, the block size is inferred from the lines
    (:func:`infer_block_tokens`; 512 when no line lists two blocks) and the unit is seconds
    exactly when the lines carry ``chat_id``.
    """
    if block_tokens is not None and block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    if time_unit not in (None, "ms", "s"):
        raise ValueError(f"time_unit must be 'ms' or 's', got {time_unit!r}")
    rows: list[tuple[float, int, int, list[int]]] = []
    bailian = False
    with open(path) as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                break
            if not line.strip():
                continue
            try:
                ts, n, out, hashes, has_chat_id = _mooncake_fields(line)
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceError(f"{path}: line {i + 1}: {exc}") from None
            bailian = bailian or has_chat_id
            rows.append((ts, n, out, hashes))
    fmt = TraceFormat(
        block_tokens=block_tokens
        or infer_block_tokens([(n, len(h)) for _, n, _, h in rows])
        or MOONCAKE_BLOCK,
        block_tokens_from="given" if block_tokens else "inferred",
        time_unit=time_unit or ("s" if bailian else "ms"),
        time_unit_from="given" if time_unit else "inferred",
    )
    per_s = 1.0 if fmt.time_unit == "s" else 1000.0
    renumbered: dict[int, int] = {}
    reqs: list[Req] = []
    for i, (ts, n, out, hashes) in enumerate(rows):
        segs = []
        left = n
        for h in hashes:
            if left <= 0:
                break
            if h >= _TRACE_ID_LIMIT:
                h = renumbered.setdefault(h, _TRACE_ID_LIMIT - 1 - len(renumbered))
            take = min(fmt.block_tokens, left)
            segs.append((h, take))
            left -= take
        if left > 0:  # input_length longer than the listed blocks: unique filler
            segs.append((_MSG_BASE + (1 << 30) + i, left))
        reqs.append(Req(f"m{i}", ts / per_s, tuple(segs), n, max(1, out)))
    reqs.sort(key=lambda q: q.arrival_s)
    return reqs, fmt


def mooncake(path: str | Path, limit: int | None = None) -> list[Req]:
    """Requests of a Mooncake-format trace, its format inferred (:func:`read_trace`)."""
    return read_trace(path, limit)[0]


def _mooncake_fields(line: str) -> tuple[float, int, int, list[int], bool]:
    """``(timestamp, input_length, output_length, hash_ids, has chat_id)`` of one trace line."""
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
    return float(ts), int(n), int(out), hashes, "chat_id" in r


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


def spread_arrivals(reqs: list[Req], spread_s: float, seed: int = 0) -> list[Req]:
    """``reqs`` with each arrival moved later by a uniform draw from ``[0, spread_s)``, in
    arrival order. For a trace whose timestamps are rounded (the Mooncake conversation trace's
    come in steps of 3 s, so nine requests share an instant on average): spread over their step,
    they arrive as the rounding hid. Seeded, so every policy sees the same arrivals."""
    if spread_s <= 0:
        return reqs
    rng = random.Random(seed)
    out = [replace(r, arrival_s=r.arrival_s + rng.uniform(0, spread_s)) for r in reqs]
    out.sort(key=lambda q: q.arrival_s)
    return out


def load_workload(
    name: str,
    trace: str | None = None,
    limit: int | None = None,
    seed: int = 0,
    scale: float = 1.0,
    trace_block_tokens: int | None = None,
    trace_time_unit: str | None = None,
) -> tuple[list[Req], TraceFormat | None]:
    """The requests, and how the trace read (None for a synthetic workload). ``scale``
    multiplies the number of conversations / tasks of synthetic workloads."""
    if name == "mooncake":
        if trace is None:
            raise ValueError("mooncake workload needs a trace path")
        return read_trace(trace, limit, trace_block_tokens, trace_time_unit)
    if name == "chat":
        reqs = chat(n_conversations=max(1, int(600 * scale)), seed=seed)
    elif name == "agentic":
        reqs = agentic(n_tasks=max(1, int(120 * scale)), seed=seed)
    else:
        raise ValueError(f"unknown workload {name!r}")
    return (reqs[:limit] if limit is not None else reqs), None
