"""Speculative entries: "this engine is about to hold this prefix", before its KV events arrive.

The router records a prompt's content keys for the engine it sends the prompt to; a sibling
routed before the worker's events arrive finds that prefix there (router/policy.py uses the hit
as a candidate's ``speculative_tokens``).
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence

from indexer.hit_rules import alignment
from indexer.matching import PrefixMatch
from indexer.types import FULL, MAMBA, SLIDING, GroupSpec

__all__ = [
    "SAMPLE_STRIDE",
    "Engine",
    "SpeculativeCache",
    "extension_credit",
    "junction_tokens",
    "retained_hit",
]

Engine = Hashable
"""An engine identity: the router uses ``(url, dp_rank)`` (``indexer.index.EngineId``); the
benchmark and the tests may use anything hashable."""


SAMPLE_STRIDE = 16
"""Records shared between replicas carry every ``SAMPLE_STRIDE``-th key of a prompt and its
deepest one (keys are chained, so each names its whole prefix): 33 keys instead of 512 for an
8k-token prompt. A sibling's hit from such a record is found at that stride (256 tokens at the
default unit of 16), which :meth:`SpeculativeCache.hit_tokens` searches first."""


class SpeculativeCache:
    """Short-lived "this engine is about to hold this prefix" entries, as content keys.

    ``record(engine, keys, now)`` after routing a prompt whose content keys (one per ``unit``
    tokens, chained) are ``keys``; ``hit_tokens(engine, keys, unit, now)`` returns how many
    leading tokens of another prompt such entries cover. Entries expire ``ttl`` after they
    were recorded (re-recording refreshes them, never shortens them). Keys are chained, so one
    key names a whole prefix: the covered run is found by a binary search over every
    ``SAMPLE_STRIDE``-th position (a record from another replica has those and its deepest
    key), then the deepest live key within the stride after the last covered one.

    Credit is a multiple of the engine's hit alignment (the LCM of its groups' block sizes, as
    its events declared them). Models with sliding-window or Mamba groups (``groups`` in
    :meth:`prompt_hits`) keep those groups' blocks only where a later prompt can hit by vLLM's
    default retention: at a prompt's replay boundary (its ``n - 1`` tokens, aligned) and at
    prefix junctions, the blocks a hit ending there needs. A sibling that shares only part of
    a recorded prompt finds the full-attention blocks there but not the sliding-window ones,
    and vLLM computes it from scratch; so on such an engine an entry credits a later prompt
    only where the kept blocks of the recorded prompts allow a hit (:func:`retained_hit`):
    at a replay boundary (``record(..., n_tokens=)``; a record without it, another replica's,
    counts its keys' tokens minus one), at a junction (``junction=``: where the prompt's
    full-attention hit on that engine ended beyond its whole hit, see
    :func:`junction_tokens`), which vLLM pins, or where the blocks two prompts kept meet.

    Layout, for the request path: every routed request records one key per 16 tokens (512 for
    an 8k prompt), so recording is one C-level ``dict.update``. Expiry is incremental: records
    sit in a heap by expiry time, and each ``record`` first retires the records whose time has
    passed, deleting their keys unless a later record refreshed them. Why: a periodic sweep of
    every entry stops the event loop for a time that grows with the number of keys held, once
    per sweep under load; and records of other replicas may carry another TTL, so expiry times
    do not arrive in order. Bounded by ``max_keys``: past it, the records closest to expiry are
    retired early, so at most ``max_keys`` keys are held after every ``record``. The key
    sequences are kept by reference (the tokenizer's cache holds them anyway) and must not be
    changed after recording.
    """

    def __init__(self, ttl_s: float = 2.0, max_keys: int = 1_000_000) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self.retention: int | None = 0
        """vLLM's ``--prefix-cache-retention-interval`` on the workers: 0 (its default) keeps
        sparse groups' blocks at replay boundaries and junctions only, ``N > 0`` also at every
        ``N`` tokens, None keeps them all (those engines are credited as dense ones)."""
        self.publish: Callable[[Engine, Sequence[int]], None] | None = None
        """Handed every record made here (not other replicas'): router/shared_state.py."""
        self.retention_of: Callable[[Engine], int | None] | None = None
        """Per engine, the interval its worker reports, when the router knows it (else
        ``retention``)."""
        self._entries: dict[Engine, dict[int, float]] = {}
        # Per engine, the key ending at each record's boundaries -> (expiry, the boundary in
        # tokens, or -1: the key's own end minus one); on engines with sparse groups, every key
        # of the blocks they keep below a boundary (_kept_marks: at most the longest run a
        # group reads, per boundary, two boundaries per record). See _boundaries.
        self._ends: dict[Engine, dict[int, tuple[float, int]]] = {}
        # (until, tie-break, engine, keys, boundary keys) per record, a heap: soonest expiry
        # first.
        self._records: list[tuple[float, int, Engine, Sequence[int], tuple[int, ...]]] = []
        self._count = itertools.count()
        self._latest = float("-inf")  # the latest expiry recorded so far
        self._size = 0  # keys held, over all engines

    def __len__(self) -> int:
        return self._size

    def record(
        self,
        engine: Engine,
        keys: Sequence[int],
        now: float,
        ttl_s: float | None = None,
        n_tokens: int | None = None,
        junction: int = 0,
        unit: int = 16,
        groups: Sequence[GroupSpec] = (),
        *,
        share: bool = True,
    ) -> None:
        """``n_tokens``: the prompt's length, which places its replay boundary exactly;
        ``junction``: its junction on ``engine`` in tokens (0: none), a multiple of ``unit``,
        the tokens per key; ``groups``: the engine's KV-cache groups when known
        (``PrefixIndex.group_specs``), so that the blocks its sparse groups keep at each
        boundary are marked where a later prompt sharing only part of them can find them.
        ``share``: hand the record to ``publish`` when set (False: another replica's)."""
        ttl = self.ttl_s if ttl_s is None else ttl_s
        if ttl <= 0 or not keys:
            return
        self.expire(now)
        until = now + ttl
        marks = [(keys[-1], -1 if n_tokens is None else max(n_tokens - 1, 0))]
        if 0 < junction // unit < len(keys):
            marks.append((keys[junction // unit - 1], junction // unit * unit))
        sparse = [s for s in groups if s.kind in (SLIDING, MAMBA)]
        retention = self._retention(engine) if sparse else 0
        if sparse and not _dense(sparse, retention):
            # Every N tokens of the prompt too: sliding windows keep those tails (Mamba's
            # periodic states are not modelled, so none are credited).
            if retention and n_tokens is not None and all(s.kind == SLIDING for s in sparse):
                n = retention
                marks += [(keys[at // unit - 1], at) for at in range(n, n_tokens + 1, n)]
            marks = _kept_marks(marks, keys, unit, groups)
        ends = self._ends.setdefault(engine, {})
        for k, boundary in marks:
            if ends.get(k, (-1.0, -1))[0] <= until:
                ends[k] = (until, boundary)
        entries = self._entries.setdefault(engine, {})
        before = len(entries)
        if until >= self._latest:  # the common case: later than every entry, one C-level pass
            entries.update(dict.fromkeys(keys, until))
            self._latest = until
        else:  # a shorter TTL (another replica's): refresh, never shorten
            get = entries.get
            for k in keys:
                if get(k, until) <= until:
                    entries[k] = until
        self._size += len(entries) - before
        bounds = tuple(k for k, _ in marks)
        heapq.heappush(self._records, (until, next(self._count), engine, keys, bounds))
        while self._size > self.max_keys and self._records:
            self._retire(*heapq.heappop(self._records))
        if share and self.publish is not None and self.ttl_s > 0:
            self.publish(engine, keys)

    def _retention(self, engine: Engine) -> int | None:
        return self.retention if self.retention_of is None else self.retention_of(engine)

    def expire(self, now: float) -> None:
        records = self._records
        while records and records[0][0] <= now:
            self._retire(*heapq.heappop(records))

    def _retire(
        self, until: float, _n: int, engine: Engine, keys: Sequence[int], bounds: tuple[int, ...]
    ) -> None:
        ends = self._ends.get(engine)
        if ends is not None:
            for k in bounds:
                if ends.get(k, (None,))[0] == until:  # not refreshed by a later record
                    del ends[k]
            if not ends:
                del self._ends[engine]
        entries = self._entries.get(engine)
        if entries is None:
            return
        before = len(entries)
        get = entries.get
        for k in keys:
            if get(k) == until:  # not refreshed by a later record
                del entries[k]
        self._size -= before - len(entries)
        if not entries:
            del self._entries[engine]

    def forget(self, engine: Engine) -> None:
        """Drop every entry of ``engine`` now: its cache was emptied (a reset, a restart), so
        nothing recorded there before is about to be held. Its records stay queued; retiring
        them later deletes nothing."""
        self._ends.pop(engine, None)
        entries = self._entries.pop(engine, None)
        if entries is not None:
            self._size -= len(entries)

    def withdraw(self, engine: Engine, keys: Sequence[int]) -> None:
        """Drop ``keys`` of ``engine`` now: the request that recorded them failed there, and
        siblings must not follow it to an engine that may not compute the prefix. Its record
        stays queued; retiring it later deletes nothing (the keys are gone)."""
        ends = self._ends.get(engine)
        if ends is not None:
            for k in keys:
                ends.pop(k, None)
            if not ends:
                del self._ends[engine]
        entries = self._entries.get(engine)
        if entries is None:
            return
        before = len(entries)
        pop = entries.pop
        for k in keys:
            pop(k, None)
        self._size -= before - len(entries)
        if not entries:
            del self._entries[engine]

    def hit_tokens(self, engine: Engine, keys: Sequence[int], unit: int, now: float) -> int:
        entries = self._entries.get(engine)
        if not entries or not keys:
            return 0

        def live(i: int) -> bool:
            t = entries.get(keys[i])
            return t is not None and t > now

        stride = SAMPLE_STRIDE
        lo, hi = 0, len(keys) // stride  # invariant: positions stride*j-1 live for j <= lo
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if live(mid * stride - 1):
                lo = mid
            else:
                hi = mid - 1
        covered = lo * stride
        # Within the next stride, the deepest live key wins: a key names its whole prefix, and
        # a record from another replica holds only its own deepest key there.
        for i in range(min(covered + stride - 1, len(keys) - 1), covered - 1, -1):
            if live(i):
                return (i + 1) * unit
        return covered * unit

    def _boundaries(
        self,
        engine: Engine,
        keys: Sequence[int],
        unit: int,
        now: float,
        within: int,
        align: int,
        top: int,
        tail: int,
    ) -> dict[int, int]:
        """The live boundaries of recorded prompts (replay boundaries and junctions, aligned
        down to ``align``) whose kept blocks ``keys`` shares within its first ``within`` tokens
        (a run covered by :meth:`hit_tokens`), each with how far the sharing is known to go:
        ``{boundary: shared up to}``. Those above ``top`` (their kept blocks may reach below
        it), the deepest at or below it (always a hit) and those within ``tail`` tokens under
        it (they lengthen the runs above it). Deepest first, so a prompt extending a recorded
        one stops after about ``tail / unit`` lookups."""
        ends = self._ends.get(engine)
        out: dict[int, int] = {}
        if not ends:
            return out
        get = ends.get
        floor = -1
        for i in range(min(within // unit, len(keys)) - 1, -1, -1):
            at = (i + 1) * unit
            if at <= floor:
                break
            end = get(keys[i])
            if end is not None and end[0] > now:
                b = (end[1] if end[1] >= 0 else at - 1) // align * align
                if b > 0:
                    if at > out.get(b, 0):  # deepest first: the first is the farthest shared
                        out[b] = at
                    if b <= top and floor < 0:
                        floor = b - tail
        return out

    def prompt_hits(
        self,
        engines: Iterable[Engine],
        keys: Sequence[int],
        n_tokens: int,
        unit: int,
        now: float,
        groups: Callable[[Engine], Sequence[GroupSpec]] | None = None,
        reach: dict[Engine, int] | None = None,
    ) -> dict[Engine, int]:
        """Per engine, the tokens of a prompt of ``n_tokens`` (content keys ``keys``) that
        speculative entries predict cached there, at most ``n - 1`` (the last prompt token is
        always computed). ``groups(engine)``: the engine's KV-cache groups as its events declared
        them (``PrefixIndex.group_specs``; asked only of engines an entry covers; empty while
        unknown): the credit is a multiple of their hit alignment, and on engines with
        sliding-window or Mamba groups only what vLLM's retention keeps counts (see the class
        and :func:`retained_hit`). ``reach`` (when given) receives, for those engines, what the
        entries cover all the same: the full-attention blocks, a junction once this prompt is
        computed there (``Candidate.junction_tokens``)."""
        cap = max(n_tokens - 1, 0)
        out: dict[Engine, int] = {}
        for e in engines:
            hit = self.hit_tokens(e, keys, unit, now)
            specs = groups(e) if hit and groups is not None else ()
            kept = functools.partial(self._boundaries, e, keys, unit, now, hit)
            retention = self._retention(e) if specs else 0
            out[e], full = _credit(specs, hit, cap, kept, retention)
            if full and reach is not None:
                reach[e] = full
        return out


Boundaries = Callable[[int, int, int], Mapping[int, int]]
"""``kept(align, top, tail)``: the boundaries whose kept blocks a prompt shares
(``SpeculativeCache._boundaries``)."""


def _credit(
    specs: Sequence[GroupSpec], covered: int, cap: int, kept: Boundaries, retention: int | None
) -> tuple[int, int]:
    """The hit a prompt whose first ``covered`` tokens an engine holds in full attention gets
    there, at most ``cap``, given the engine's groups ``specs`` (empty: unknown, no alignment
    applied) and vLLM's ``retention`` interval; and, on engines with sparse groups, what the
    full-attention blocks reach (0 elsewhere)."""
    if not specs:
        return min(covered, cap), 0
    align = alignment(specs)
    top = min(covered, cap) // align * align
    sparse = [s for s in specs if s.kind in (SLIDING, MAMBA)]
    if any(s.eagle for s in specs):
        # EAGLE recomputes the last matched block; on a sparse model it also moves the
        # boundaries vLLM keeps blocks at, which entries do not model: no credit there before
        # the events (the index's match models both).
        if sparse:
            return 0, top
        full = max((s.block_size for s in specs if s.kind == FULL), default=0)
        return max(top - full, 0) // align * align, 0
    if _dense(sparse, retention):
        return top, 0
    tail = max(_needed_blocks(s) * s.block_size for s in sparse)
    return retained_hit(sparse, kept(align, top, tail), top, align), top


def extension_credit(
    specs: Sequence[GroupSpec], n_recorded: int, n_tokens: int, retention: int | None = 0
) -> int:
    """The hit of a prompt of ``n_tokens`` extending a whole prompt of ``n_recorded`` tokens
    computed on an engine with groups ``specs``: its whole blocks, or on sparse groups its
    replay boundary (``n_recorded - 1``, aligned), the point vLLM keeps their blocks at
    (unless ``retention`` keeps them all)."""

    def kept(align: int, top: int, tail: int) -> dict[int, int]:
        b = max(n_recorded - 1, 0) // align * align
        return {b: b} if b else {}

    return _credit(specs, n_recorded, max(n_tokens - 1, 0), kept, retention)[0]


def retained_hit(
    sparse: Sequence[GroupSpec], boundaries: Mapping[int, int], top: int, align: int
) -> int:
    """The longest hit, a multiple of ``align`` and at most ``top``, that sliding-window and
    Mamba groups ``sparse`` allow when they keep only what vLLM's sparse retention keeps for
    the prompts computed there: at each boundary (an aligned token position), the blocks a hit
    ending there needs (``cdiv(W - 1, block)`` blocks of a window, the one state block of a
    Mamba group). ``boundaries``: ``{boundary: shared up to}``; only kept blocks ending
    within the shared part count. Boundaries of different prompts combine: a hit needs each
    group's blocks, whichever prompt kept them."""
    if all(m <= min(top, shared) for m, shared in boundaries.items()):
        # Each is a hit (it kept the blocks a hit there reads) and nothing kept above the
        # deepest could lengthen a run past it.
        return max(boundaries, default=0)
    runs = []  # per group: the kept blocks by end position -> whether a hit may end there
    for s in sparse:
        b = s.block_size
        need = _needed_blocks(s)
        ends = sorted(
            {
                m - k * b
                for m, shared in boundaries.items()
                for k in range(need)
                if 0 < m - k * b <= shared
            }
        )
        run: dict[int, int] = {}
        for x in ends:  # consecutive kept blocks ending at x; a run from token 0 always does
            run[x] = need if x == b else run.get(x - b, 0) + 1
        runs.append({x: r >= need for x, r in run.items()})
    # Every group needs the block ending at the point: the candidates are those ends.
    points = sorted(p for p, ok in runs[0].items() if ok and p <= top and p % align == 0)
    for p in reversed(points):
        if all(r.get(p, False) for r in runs):
            return p
    return 0


def _kept_marks(
    marks: list[tuple[int, int]], keys: Sequence[int], unit: int, groups: Sequence[GroupSpec]
) -> list[tuple[int, int]]:
    """A record's boundary marks on an engine with sparse groups: each boundary, aligned, is
    marked at every key of the blocks kept below it (the longest run a group reads), so that a
    prompt sharing the record only up to one of them still finds them
    (:meth:`SpeculativeCache._boundaries`). Marks of unknown length (-1) stay as they are."""
    align = alignment(groups)
    tail = max(_needed_blocks(s) * s.block_size for s in groups if s.kind in (SLIDING, MAMBA))
    out = []
    for key, boundary in marks:
        if boundary < 0:
            out.append((key, boundary))
            continue
        a = boundary // align * align
        for at in range(min(a, len(keys) * unit), max(a - tail, 0), -unit):
            out.append((keys[at // unit - 1], a))
    return out


def _dense(sparse: Sequence[GroupSpec], retention: int | None) -> bool:
    """Whether vLLM keeps every block of these sparse groups: retention None, or an interval
    no longer than the run each group reads (vLLM then caches them all)."""
    if retention is None or not sparse:
        return True
    return retention > 0 and all(retention <= _needed_blocks(s) * s.block_size for s in sparse)


def _needed_blocks(spec: GroupSpec) -> int:
    """Blocks of a sparse group a hit ending at a point needs: ``cdiv(W - 1, block)`` of a
    sliding window, the one state block of a Mamba group."""
    b = spec.block_size
    return -(-((spec.sliding_window or b) - 1) // b) if spec.kind == SLIDING else 1


def junction_tokens(match: PrefixMatch | None) -> int:
    """Where a prompt's shared prefix with an engine's cache ends, when one group alone (the
    full-attention run) reaches beyond the hit every group allows: vLLM keeps the sparse
    groups' blocks there once the prompt is computed, so a later prompt sharing that prefix
    hits it. 0 when the groups agree (no junction)."""
    if match is None:
        return 0
    longest = max((g.hit_tokens for g in match.groups), default=0)
    return longest if longest > match.gpu_tokens else 0
