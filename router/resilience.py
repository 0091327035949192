"""Worker failure handling that sits between the registry, the proxy and the subscriber.

* **A dead worker's index state is dropped.** :class:`WorkerWatch` looks at the registry's health
  flags every ``interval_s``. A worker that is unhealthy because it refused a connection (the
  process is gone), or that has stayed unhealthy for ``drop_after_s`` (hung: probes time out),
  has every rank cleared from the index and marked degraded
  (:meth:`indexer.subscriber.Subscriber.drop_worker_state`): the router must not route to a cache
  that may no longer exist. Its event sockets stay subscribed; when the worker returns, its
  health probe makes it routable again, its event sockets are dialled at once (ZMQ's own retries
  have backed off to seconds by then, and a PUB drops what no one takes), and its index is
  rebuilt from its events: a restarted
  worker is recognised by its sequence numbers starting over (exact again from seq 0), a worker
  that was only unreachable stays degraded (routed by load) until rebuilt.
* **A stream that broke mid-response re-probes its worker at once** (:meth:`probe_soon`), so a
  dead worker leaves the candidate set within one probe round trip instead of one poll interval.
* **Degraded engines are routed by load** (:func:`load_only`): their index under-reports, and
  after a reset it may still miss blocks that exist; predicted hits on them are zeroed so that
  no decision is made on a cache the router cannot vouch for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from indexer.index import EngineId
from indexer.subscriber import Subscriber
from router.workers import Worker, WorkerRegistry

__all__ = ["WORKER_DOWN", "WorkerWatch", "load_only"]

log = logging.getLogger("kvrouter.resilience")

WORKER_DOWN = "worker unhealthy"
_DEAD_ERRORS = ("ConnectError", "RemoteProtocolError", "ReadError")


class WorkerWatch:
    """Drops the index state of workers that went down; re-probes a worker on request.

    ``drop_worker_state(url, reason)`` clears every rank of a worker from the index and marks
    them degraded, returning how many ranks it affected
    (:meth:`indexer.subscriber.Subscriber.drop_worker_state`); ``redial(url)`` dials the event
    sockets of a worker that answers again (:meth:`indexer.subscriber.Subscriber.redial_worker`)."""

    def __init__(
        self,
        registry: WorkerRegistry,
        drop_worker_state: Callable[[str, str], int],
        redial: Callable[[str], int] | None = None,
        *,
        interval_s: float = 0.2,
        drop_after_s: float = 2.0,
    ) -> None:
        self.registry = registry
        self.drop_worker_state = drop_worker_state
        self.redial = redial
        self.redials = 0
        self.interval_s = interval_s
        self.drop_after_s = drop_after_s
        self.drops = 0
        self.probes = 0
        self._down_since: dict[str, float] = {}
        self._dropped: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._probing: dict[str, asyncio.Task[None]] = {}

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="kvrouter-worker-watch")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._probing.values()) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        self._task = None
        self._probing.clear()

    def probe_soon(self, w: Worker) -> None:
        """Re-check ``w``'s health now (a stream from it broke)."""
        if w.url in self._probing:
            return

        async def probe() -> None:
            try:
                self.probes += 1
                await self.registry.check(w)
                self.tick()
            except Exception:  # pragma: no cover - the poll loop probes again anyway
                log.debug("probe of %s failed", w.url, exc_info=True)
            finally:
                self._probing.pop(w.url, None)

        self._probing[w.url] = asyncio.create_task(probe())

    async def _loop(self) -> None:
        while True:
            try:
                self.tick()
            except Exception:  # pragma: no cover - never stop watching
                log.exception("worker watch")
            await asyncio.sleep(self.interval_s)

    def tick(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        seen = set()
        for w in list(self.registry.workers.values()):
            seen.add(w.url)
            if w.healthy:
                if self._down_since.pop(w.url, None) is not None and self.redial is not None:
                    self.redials += self.redial(w.url)
                self._dropped.discard(w.url)
                continue
            since = self._down_since.setdefault(w.url, now)
            if w.url in self._dropped:
                continue
            err = w.last_health_error or ""
            if err.startswith(_DEAD_ERRORS) or now - since >= self.drop_after_s:
                self._dropped.add(w.url)
                self._drop(w.url, err)
        for url in list(self._down_since):
            if url not in seen:
                self._down_since.pop(url, None)
                self._dropped.discard(url)

    def _drop(self, url: str, why: str) -> None:
        n = self.drop_worker_state(url, WORKER_DOWN)
        if n:
            self.drops += 1
            log.warning("worker %s is down (%s): its index state is dropped", url, why)


def load_only(subscriber: Subscriber, engine: EngineId) -> bool:
    """True when ``engine``'s index state cannot be trusted for hits (degraded)."""
    try:
        return bool(subscriber.is_degraded(engine))
    except Exception:  # pragma: no cover
        return False
