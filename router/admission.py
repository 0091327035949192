"""Admission: a bounded router-side queue for requests that arrive while the fleet is full.

With ``admission.queued_prefill_tokens_threshold`` set, a completion or chat request is routed
at once while some engine serving its model has room: less queued prefill than the threshold
(``EngineLoad.queued_prefill_tokens``: prompt tokens this router and the other replicas sent
there that have no first token yet). Otherwise, and whenever requests are already waiting, it
waits in a queue (:class:`FairQueue`):

* ordered by the request's ``priority`` (vLLM's field, forwarded unchanged: lower first), then,
  with ``admission.order: fair`` (the default), round robin between the API keys of one
  priority (each key's next request in turn, so one key's burst cannot starve another key) and
  first come first served within a key (:class:`FairQueue`); with ``order: shortest_prompt``,
  the request with the smallest body first (its size in bytes, a stand-in for its prompt's
  length, known before tokenizing), except that one waiting ``shortest_first_max_wait_s`` or
  longer goes ahead of every later arrival (:class:`ShortestFirstQueue`). Each engine runs its
  queue first come first served, so a short prompt sent behind a long one waits for all of its
  prefill; holding both here and sending the short one first saves it that wait and costs the
  long one one short prefill;
* bounded: with ``max_queue`` requests waiting a new one is refused at once (429,
  ``queue_full``), and a request still waiting after ``max_wait_s`` is refused (429,
  ``deadline``), both with ``Retry-After``: how long the requests ahead take to leave at the
  rate the queue has been seen admitting (``retry_after_s`` until a rate is known);
* a request whose client disconnects leaves the queue.

A waiting request is admitted as soon as its model's engines have room again
(:func:`headroom`): each first token of a request this router sent wakes the queue (the proxy
calls :meth:`Admission.wake`), and a re-check every ``RECHECK_S`` catches load that changes
elsewhere (other replicas, workers that leave or recover). An admitted request's prompt
reaches an engine's count only once its route is chosen, so until then it holds a
:class:`Pass` that counts against the room: the queue admits as many requests as the engines'
headroom below the threshold holds prompts of the size seen so far, not the whole queue at the
first free token.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from starlette.requests import ClientDisconnect
from starlette.types import Receive

from router.errors import BodyError
from router.metrics import AdmissionMetrics
from router.quotas import retry_after

if TYPE_CHECKING:
    from router.config import AdmissionConfig
    from router.core import Router

__all__ = [
    "Admission",
    "FairQueue",
    "Pass",
    "ShortestFirstQueue",
    "headroom",
    "make_admission",
    "make_queue",
    "priority_of",
]

RECHECK_S = 0.25
"""While requests wait, room is re-checked this often besides the wake-ups on first tokens."""
RATE_WINDOW_S = 60.0
"""Admissions older than this no longer count toward the queue's drain rate."""
MAX_RETRY_AFTER_S = 300.0
"""Retry-After never says more: a rate seen while the fleet stalled would say hours."""
PROMPT_GUESS_TOKENS = 1024.0
"""The prompt size an admitted request is assumed to bring until sizes have been seen."""

T = TypeVar("T")


class _Queue(Generic[T]):
    """What both orders share: the count, and how many items may go before a new one."""

    _n = 0

    def __len__(self) -> int:
        return self._n

    def depths(self) -> dict[int, int]:
        """Waiting items per priority."""
        raise NotImplementedError

    def ahead_of(self, priority: int) -> int:
        """Items that may go before a new item of ``priority`` (its own level included: the
        order puts it somewhere among them)."""
        return sum(n for p, n in self.depths().items() if p <= priority)


class FairQueue(_Queue[T]):
    """Items by priority (lowest value first), round robin between keys within a priority,
    first in first out within a key. Pure data structure: no clock, no I/O."""

    def __init__(self) -> None:
        self._levels: dict[int, dict[Hashable, deque[T]]] = {}
        self._n = 0

    def push(
        self, priority: int, key: Hashable, item: T, size: int = 0, since: float = 0.0
    ) -> None:
        """``size`` and ``since`` are :class:`ShortestFirstQueue`'s; this order ignores them."""
        level = self._levels.setdefault(priority, {})
        q = level.get(key)
        if q is None:
            q = level[key] = deque()  # a new key joins the end of the rotation
        q.append(item)
        self._n += 1

    def pop_first(self, ok: Callable[[T], bool] = lambda _: True, now: float = 0.0) -> T | None:
        """The first item in order whose ``ok`` is true, removed; None if there is none. Only
        each key's oldest item is offered (FIFO within a key); the key served goes to the end
        of its priority's rotation. ``now`` is :class:`ShortestFirstQueue`'s."""
        for priority in sorted(self._levels):
            level = self._levels[priority]
            for key, q in level.items():
                item = q[0]
                if not ok(item):
                    continue
                q.popleft()
                del level[key]
                if q:
                    level[key] = q
                elif not level:
                    del self._levels[priority]
                self._n -= 1
                return item
        return None

    def remove(self, priority: int, key: Hashable, item: T) -> bool:
        """Take ``item`` out wherever it is (a client that left); False if it is not queued."""
        level = self._levels.get(priority)
        q = level.get(key) if level is not None else None
        if q is None or item not in q:
            return False
        q.remove(item)
        if not q:
            del level[key]  # type: ignore[union-attr]
            if not level:
                del self._levels[priority]
        self._n -= 1
        return True

    def depths(self) -> dict[int, int]:
        """Waiting items per priority."""
        return {p: sum(map(len, lv.values())) for p, lv in sorted(self._levels.items())}


class ShortestFirstQueue(_Queue[T]):
    """Items by priority (lowest value first), then the smallest ``size`` first; an item
    waiting ``max_wait_s`` or longer goes ahead of every item that arrived after it, so no
    item is passed over for longer than that. Pure data structure: ``now`` is an argument.

    Bounds: a pop looks at every item of the first priority that has one ``ok`` accepts, so it
    costs O(n log n) in the queue's length (``admission.max_queue`` bounds n)."""

    def __init__(self, max_wait_s: float) -> None:
        self.max_wait_s = max_wait_s
        self._items: dict[int, list[tuple[float, int, int, Hashable, T]]] = {}
        """Per priority: (since, arrival number, size, key, item), in arrival order."""
        self._seq = itertools.count()
        self._n = 0

    def push(
        self, priority: int, key: Hashable, item: T, size: int = 0, since: float = 0.0
    ) -> None:
        self._items.setdefault(priority, []).append((since, next(self._seq), size, key, item))
        self._n += 1

    def pop_first(self, ok: Callable[[T], bool] = lambda _: True, now: float = 0.0) -> T | None:
        """The first item in order whose ``ok`` is true, removed; None if there is none."""
        for priority in sorted(self._items):
            level = self._items[priority]
            for i in _shortest_first(level, now - self.max_wait_s):
                item = level[i][4]
                if ok(item):
                    del level[i]
                    if not level:
                        del self._items[priority]
                    self._n -= 1
                    return item
        return None

    def remove(self, priority: int, key: Hashable, item: T) -> bool:
        """Take ``item`` out wherever it is (a client that left); False if it is not queued."""
        level = self._items.get(priority, [])
        for i, x in enumerate(level):
            if x[4] is item:
                del level[i]
                if not level:
                    del self._items[priority]
                self._n -= 1
                return True
        return False

    def depths(self) -> dict[int, int]:
        """Waiting items per priority."""
        return {p: len(v) for p, v in sorted(self._items.items())}


def _shortest_first(
    level: list[tuple[float, int, int, Hashable, Any]], overdue: float
) -> list[int]:
    """Positions in ``level`` in the order they go: those waiting since ``overdue`` or earlier
    in arrival order, then the rest by size (ties: arrival)."""

    def rank(i: int) -> tuple[int, int, int]:
        since, seq, size, _, _ = level[i]
        return (0, 0, seq) if since <= overdue else (1, size, seq)

    return sorted(range(len(level)), key=rank)


def make_queue(cfg: AdmissionConfig) -> FairQueue[Any] | ShortestFirstQueue[Any]:
    """The queue ``admission.order`` names."""
    if cfg.order == "shortest_prompt":
        return ShortestFirstQueue(cfg.shortest_first_max_wait_s)
    return FairQueue()


def headroom(queued: Iterable[int], threshold: int, in_transit_tokens: float = 0.0) -> float:
    """Room below ``threshold`` on a model's engines (``queued``: each one's queued prefill
    tokens), in tokens, less ``in_transit_tokens`` (admitted requests not yet routed). > 0:
    one more request may be routed now. No engine at all counts as room: routing answers."""
    loads = list(queued)
    if not loads:
        return 1.0
    return sum(threshold - q for q in loads if q < threshold) - in_transit_tokens


def priority_of(value: Any) -> int:
    """A request's ``priority`` for ordering: its integer, else 0 (vLLM's default; vLLM itself
    answers a malformed one)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return 0


@dataclass(eq=False, slots=True)
class _Waiter:
    priority: int
    key: str | None
    model: Hashable
    since: float
    fut: asyncio.Future[Pass] = field(default=None)  # type: ignore[assignment]


class Pass:
    """An admitted request that has no route yet: counts against its model's room until
    :meth:`release` (idempotent), which also says how many prompt tokens it brought."""

    __slots__ = ("_admission", "_done", "model")

    def __init__(self, admission: Admission, model: Hashable) -> None:
        self._admission = admission
        self.model = model
        self._done = False
        admission._transit[model] = admission._transit.get(model, 0) + 1

    def release(self, prompt_tokens: int | None = None) -> None:
        if self._done:
            return
        self._done = True
        a = self._admission
        left = a._transit[self.model] - 1
        if left:
            a._transit[self.model] = left
        else:
            del a._transit[self.model]
        if prompt_tokens:
            a._prompt_tokens += 0.1 * (prompt_tokens - a._prompt_tokens)
        a.wake()


class Admission:
    """The queue and the rule that admits from it (see the module docstring)."""

    def __init__(
        self,
        cfg: AdmissionConfig,
        queued: Callable[[Any], list[int]],
        metrics: AdmissionMetrics | None = None,
    ) -> None:
        assert cfg.queued_prefill_tokens_threshold is not None
        self.threshold = cfg.queued_prefill_tokens_threshold
        self.cfg = cfg
        self._queued = queued
        """Queued prefill tokens of each engine serving a model ([] when none does)."""
        self.queue: FairQueue[_Waiter] | ShortestFirstQueue[_Waiter] = make_queue(cfg)
        self.metrics = metrics
        self._transit: dict[Hashable, int] = {}
        self._prompt_tokens = PROMPT_GUESS_TOKENS
        """Mean prompt tokens of admitted requests (moving average): the room a pass takes."""
        self._admits: deque[float] = deque(maxlen=512)
        """When requests left the queue admitted (the drain rate for Retry-After)."""
        self._pending = False
        self._timer: asyncio.TimerHandle | None = None
        self.counts = {"direct": 0, "queue": 0, "queue_full": 0, "deadline": 0, "abandoned": 0}

    # ---------------------------------------------------------------- the request's side

    async def admit(
        self, model: Any, priority: Any, key: str | None, receive: Receive, size: int = 0
    ) -> Pass:
        """Return once the request may be routed. BodyError 429 when the queue is full or the
        wait ran out; ClientDisconnect when the client left while waiting. ``size``: the
        request body's bytes (the ``shortest_prompt`` order's key)."""
        m = model if isinstance(model, str) else None
        if not self.queue and self._room(m) > 0:
            self._count("direct")
            return Pass(self, m)
        prio = priority_of(priority)
        if len(self.queue) >= self.cfg.max_queue:
            raise self._refuse("queue_full", self.queue.ahead_of(prio))
        w = _Waiter(prio, key, m, time.monotonic())
        w.fut = asyncio.get_running_loop().create_future()
        self.queue.push(prio, key, w, size, w.since)
        self.wake()
        return await self._wait(w, receive)

    async def _wait(self, w: _Waiter, receive: Receive) -> Pass:
        gone = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait(
                {w.fut, gone}, timeout=self.cfg.max_wait_s, return_when=asyncio.FIRST_COMPLETED
            )
        except BaseException:  # cancelled: the request is over, its place too
            self._leave(w)
            raise
        finally:
            if gone.done():
                if not gone.cancelled():
                    gone.exception()  # retrieved, so asyncio does not log it as lost
            else:
                gone.cancel()
        if w.fut.done():
            p = w.fut.result()
            if gone.done():  # admitted and gone in the same turn: nothing to route
                p.release()
                raise self._abandoned()
            return p
        self._leave(w)
        if gone.done():
            raise self._abandoned()
        raise self._refuse("deadline", self.queue.ahead_of(w.priority))

    def _leave(self, w: _Waiter) -> None:
        """``w`` stops waiting: out of the queue, or its pass back if it was admitted."""
        if w.fut.done():
            if not w.fut.cancelled():
                w.fut.result().release()
            return
        w.fut.cancel()
        self.queue.remove(w.priority, w.key, w)

    def _abandoned(self) -> ClientDisconnect:
        self._count("abandoned")
        return ClientDisconnect()

    def _refuse(self, reason: str, ahead: int) -> BodyError:
        self._count(reason)
        wait = self.retry_after_s(ahead)
        what = (
            f"the router's admission queue is full ({self.cfg.max_queue} requests waiting)"
            if reason == "queue_full"
            else f"no capacity freed within admission.max_wait_s ({self.cfg.max_wait_s:g} s)"
        )
        err = BodyError(429, f"{what}; retry after {retry_after(wait)} s", "rate_limit_exceeded")
        err.headers = {"retry-after": retry_after(wait)}
        return err

    def _count(self, what: str) -> None:
        self.counts[what] += 1
        if self.metrics is not None:
            self.metrics.count(what)

    # ---------------------------------------------------------------- the queue's side

    def wake(self) -> None:
        """Load may have dropped: look for room at the next loop turn (coalesced)."""
        if self.queue and not self._pending:
            self._pending = True
            asyncio.get_running_loop().call_soon(self._dispatch)

    def _room(self, model: Hashable) -> float:
        """Headroom below the threshold on ``model``'s engines, in tokens, less what the
        admitted requests without a route yet are expected to bring. > 0: admit one more."""
        transit = self._transit.get(model, 0) * self._prompt_tokens
        return headroom(self._queued(model), self.threshold, transit)

    def _dispatch(self) -> None:
        self._pending = False
        room: dict[Hashable, float] = {}

        def fits(w: _Waiter) -> bool:
            if w.model not in room:
                room[w.model] = self._room(w.model)
            return room[w.model] > 0

        now = time.monotonic()
        while self.queue:
            w = self.queue.pop_first(fits, now)
            if w is None:
                break
            room.pop(w.model)  # its pass takes some of it
            w.fut.set_result(Pass(self, w.model))
            self._admits.append(now)
            self._count("queue")
            if self.metrics is not None:
                self.metrics.wait.observe(now - w.since)
        if self.queue and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(RECHECK_S, self._recheck)

    def _recheck(self) -> None:
        self._timer = None
        self.wake()

    # ---------------------------------------------------------------- views

    def drain_rate(self, now: float | None = None) -> float | None:
        """Requests per second the queue has been admitting (None before two admissions in the
        last ``RATE_WINDOW_S``)."""
        t = time.monotonic() if now is None else now
        while self._admits and self._admits[0] < t - RATE_WINDOW_S:
            self._admits.popleft()
        if len(self._admits) < 2 or t <= self._admits[0]:
            return None
        return len(self._admits) / (t - self._admits[0])

    def retry_after_s(self, ahead: int) -> float:
        """Seconds until ``ahead`` waiting requests and one more have left at the drain rate."""
        rate = self.drain_rate()
        if rate is None:
            return self.cfg.retry_after_s
        return min((ahead + 1) / rate, MAX_RETRY_AFTER_S)

    def status(self) -> dict[str, Any]:
        """The queue for ``/debug/index``."""
        rate = self.drain_rate()
        return {
            "queued_prefill_tokens_threshold": self.threshold,
            "order": self.cfg.order,
            "max_queue": self.cfg.max_queue,
            "max_wait_s": self.cfg.max_wait_s,
            "waiting": len(self.queue),
            "waiting_by_priority": {str(p): n for p, n in self.queue.depths().items()},
            "admitted_without_route": sum(self._transit.values()),
            "drain_rate_per_s": None if rate is None else round(rate, 3),
            "counts": dict(self.counts),
        }


async def _until_disconnect(receive: Receive) -> None:
    while True:
        if (await receive())["type"] == "http.disconnect":
            return


def queued_view(
    serving: Callable[[Any], Iterable[Any]], remote: Callable[[], Mapping[Any, Any]]
) -> Callable[[Any], list[int]]:
    """Queued prefill tokens of each engine that may take a request for a model: this router's
    own count plus the other replicas' (``serving``: Router._serving, which raises BodyError
    for a model the fleet does not serve; ``remote``: the shared state's loads)."""

    def queued(model: Any) -> list[int]:
        try:
            workers = serving(model)
        except BodyError:
            return []
        others = remote()
        out = []
        for w in workers:
            for e in w.engines():
                r = others.get(e)
                own = w.load(e[1]).queued_prefill_tokens
                out.append(own + (r.queued_prefill_tokens if r is not None else 0))
        return out

    return queued


def make_admission(router: Router) -> Admission | None:
    """The router's admission queue, or None when ``admission`` is off (no threshold)."""
    cfg = router.cfg.admission
    if cfg.queued_prefill_tokens_threshold is None:
        return None
    adm: Admission | None = None

    def depths() -> Mapping[int, int]:
        return adm.queue.depths() if adm is not None else {}

    metrics = AdmissionMetrics(router.metrics.registry, depths)
    adm = Admission(cfg, queued_view(router._serving, router.shared.remote_loads), metrics)
    return adm
