"""Read many sockets on one timer while messages arrive faster than the timer, per message else.

A socket read per message costs a loop wakeup per message: an ``epoll_wait`` return, a loop
turn, the reader callback, and in the ZMQ I/O thread an eventfd write to wake us. At a few
thousand messages a second over tens of sockets that is a large share of the subscriber's CPU
(docs/benchmarks.md, "A/B: paced reads and growth spread over insertions"). Network cards
solve the same problem the same way (interrupt coalescing, Linux NAPI): wake on the first
packet, then poll while busy.

The :class:`Pacer` starts *event-driven*: each socket's reader runs when its FD fires. When
``enter_after`` reader wakeups fall inside one ``interval_s``, it goes *paced*: every socket's
reader is removed and one timer reads all the sockets that have input every ``interval_s``. After
``idle_ticks`` ticks that read nothing it goes back to event-driven. The price is latency: a
message waits at most ``interval_s`` longer before it is read (the bound is the interval; nothing
is dropped, the sockets' queues hold it).

A tick's cost grows with the number of sockets (one ``ZMQ_EVENTS`` read each, 1.8 us for an
idle socket through pyzmq): the interval grows with them, ``max(interval_s, sockets *
per_socket_s)`` with 20 us per socket, ten times that cost, so polling a large fleet's quiet
sockets takes at most about a tenth of a core while paced.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

__all__ = ["Paceable", "Pacer"]


class Paceable(Protocol):
    """What the pacer needs of a socket reader."""

    def pause(self) -> None:
        """Stop reading on FD wakeups."""

    def resume(self) -> None:
        """Read on FD wakeups again (and now, if input waits)."""

    def poll(self) -> int:
        """Read what waits, without blocking; return the number of messages read."""


class Pacer:
    """Switch a set of readers between event-driven and timer-driven reads (module docstring)."""

    def __init__(
        self,
        interval_s: float = 0.002,
        *,
        enter_after: int = 3,
        idle_ticks: int = 3,
        per_socket_s: float = 0.00002,
    ) -> None:
        if interval_s < 0 or enter_after < 2 or idle_ticks < 1 or per_socket_s < 0:
            raise ValueError(
                "need interval_s >= 0, enter_after >= 2, idle_ticks >= 1, per_socket_s >= 0"
            )
        self.interval_s = interval_s
        """0: never paced."""
        self.enter_after = enter_after
        self.idle_ticks = idle_ticks
        self.per_socket_s = per_socket_s
        self.paced = False
        self.ticks = 0
        """Timer reads so far."""
        self.entered = 0
        """Times it went paced."""
        self._readers: dict[Paceable, None] = {}
        self._window_start = float("-inf")
        self._wakeups = 0
        self._idle = 0
        self._timer: asyncio.TimerHandle | None = None

    @property
    def tick_s(self) -> float:
        """The interval between timer reads for the readers registered now."""
        return max(self.interval_s, len(self._readers) * self.per_socket_s)

    def add(self, reader: Paceable) -> None:
        self._readers[reader] = None
        if self.paced:
            reader.pause()

    def discard(self, reader: Paceable) -> None:
        self._readers.pop(reader, None)

    def woke(self) -> None:
        """A reader read something on an FD wakeup: count it, go paced when they come fast."""
        if self.paced or self.interval_s <= 0:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        if now - self._window_start > self.interval_s:
            self._window_start = now
            self._wakeups = 0
        self._wakeups += 1
        if self._wakeups >= self.enter_after:
            self.paced = True
            self.entered += 1
            self._idle = 0
            for reader in list(self._readers):
                reader.pause()
            self._timer = loop.call_later(self.tick_s, self._tick)

    def close(self) -> None:
        """Cancel the timer; the readers are left as they are (their owner closes them)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.paced = False
        self._readers.clear()

    def _tick(self) -> None:
        self._timer = None
        self.ticks += 1
        read = 0
        for reader in list(self._readers):
            read += reader.poll()
        self._idle = 0 if read else self._idle + 1
        if self._idle < self.idle_ticks:
            self._timer = asyncio.get_running_loop().call_later(self.tick_s, self._tick)
            return
        self.paced = False
        self._window_start = float("-inf")
        for reader in list(self._readers):
            reader.resume()
