"""One ZMQ SUB socket of the subscriber: configured, monitored, and read without blocking.

The reader is a loop callback on the socket's (edge-triggered) ZMQ_FD: it takes at most
``recv_batch`` messages, or ``recv_budget_s`` of time (checked after every message, so one huge
message is enough), per loop turn and then reschedules itself with ``call_soon``, so a flood on
one socket never starves the event loop, and no future or task is created per message. Each
message goes to ``on_message`` (whose exceptions are logged: nothing a socket delivers may stop
the reader), then ``on_read`` runs once per turn that read something.

A socket monitor counts the connected ``peers`` and calls ``on_reconnect`` on every handshake
after the first one. ZMQ reconnects by itself (``reconnect_backoff_s``) and ZMTP heartbeats
(``heartbeat_s``) detect dead peers. The monitor is read without blocking by its own loop
callback *and*, whenever its FD signals, after each message the reader takes: libzmq queues a
connection's handshake event before any message of that connection, so ``on_reconnect`` runs
before the first message of the new connection is routed, whichever socket the loop serves
first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from indexer.pacer import Pacer

__all__ = ["Feed", "FeedOptions"]

log = logging.getLogger("indexer.subscriber")  # a feed logs as part of its subscriber

_MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
"""Plain ints: the reader passes them per message, and an enum member costs a lookup each time."""


@dataclass(frozen=True, slots=True)
class FeedOptions:
    topic: str
    """Subscription prefix."""
    hwm: int
    """ZMQ receive high-water mark (messages)."""
    reconnect_backoff_s: tuple[float, float]
    heartbeat_s: float
    """ZMTP heartbeat interval (0: none); a peer silent for 3 intervals is dropped."""
    recv_batch: int
    recv_budget_s: float
    """Checked after every message."""


class Feed:
    """One SUB socket, bound (``bind``) or connected to ``endpoint``, read from the running loop
    as soon as it is created (see the module docstring)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        options: FeedOptions,
        *,
        bind: bool,
        on_message: Callable[[list[bytes]], None],
        on_read: Callable[[], None],
        on_reconnect: Callable[[], None] | None = None,
        pacer: Pacer | None = None,
    ) -> None:
        self.options = options
        self.pacer = pacer
        self.on_message = on_message
        self.on_read = on_read
        self.on_reconnect = on_reconnect
        self.peers = 0
        self.handshakes = 0
        self.closed = False
        self.bound = bind
        sock = ctx.socket(zmq.SUB)
        lo, hi = options.reconnect_backoff_s
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, options.hwm)
        sock.setsockopt(zmq.RECONNECT_IVL, max(1, int(lo * 1000)))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, max(1, int(hi * 1000)))
        if options.heartbeat_s > 0:
            sock.setsockopt(zmq.HEARTBEAT_IVL, int(options.heartbeat_s * 1000))
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(options.heartbeat_s * 3000))
        sock.setsockopt(zmq.SUBSCRIBE, options.topic.encode())
        self.sock = sock
        self.raw = zmq.Socket.shadow(sock.underlying)
        """Synchronous view of the socket: NOBLOCK reads without a future per message."""
        self._monitor_owner = sock.get_monitor_socket(_MONITOR_EVENTS)
        self.monitor = zmq.Socket.shadow(self._monitor_owner.underlying)
        """Synchronous view of the monitor socket (read with NOBLOCK, see the module docstring)."""
        self._monitor_signal = select.poll()
        """Its ZMQ_FD: readable once an event arrived after the last :meth:`_poll_monitor`
        (which drains to empty, so libzmq signals the next one): a syscall cheaper than
        reading ZMQ_EVENTS after every message."""
        self._monitor_signal.register(self.monitor.FD, select.POLLIN)
        if bind:
            sock.bind(endpoint)
            endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            sock.connect(endpoint)
        self.endpoint = endpoint
        """The connected endpoint, or the bound one with the port the OS chose."""
        loop = asyncio.get_running_loop()
        loop.add_reader(self.monitor.FD, self._poll_monitor)
        loop.add_reader(self.raw.FD, self._on_readable)
        loop.call_soon(self._poll_monitor)  # anything queued before the readers were added
        loop.call_soon(self._on_readable)
        if pacer is not None:
            pacer.add(self)

    def has_input(self) -> bool:
        """A message is waiting on the socket."""
        raw = self.raw
        return not raw.closed and bool(raw.get(zmq.EVENTS) & zmq.POLLIN)

    def pause(self) -> None:
        """Stop reading on FD wakeups: a :class:`~indexer.pacer.Pacer` polls instead."""
        if not (self.closed or self.raw.closed):
            asyncio.get_running_loop().remove_reader(self.raw.FD)

    def resume(self) -> None:
        """Read on FD wakeups again; read now if a message waits (its edge may be gone)."""
        if self.closed or self.raw.closed:
            return
        loop = asyncio.get_running_loop()
        loop.add_reader(self.raw.FD, self._on_readable)
        if self.has_input():
            loop.call_soon(self._on_readable)

    def poll(self) -> int:
        """Read what waits (as an FD wakeup would); the number of messages read."""
        if self.closed or not self.has_input():
            return 0
        return self._read()

    def redial(self) -> bool:
        """Dial the endpoint now if no peer is connected; True when it did.

        While a publisher is down, ZMQ's retries back off to ``reconnect_backoff_s[1]``; once its
        worker is known to be back, waiting out that interval loses every batch published
        meanwhile (a PUB drops what no subscriber takes). The new connection's handshake is a
        reconnect like any other (``on_reconnect``)."""
        if self.closed or self.bound or self.peers > 0:
            return False
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disconnect(self.endpoint)
        self.sock.connect(self.endpoint)
        return True

    def close(self) -> None:
        """Close the sockets and stop reading them."""
        self.closed = True
        if self.pacer is not None:
            self.pacer.discard(self)
        for raw in (self.raw, self.monitor):
            if not raw.closed:
                with contextlib.suppress(Exception):
                    asyncio.get_running_loop().remove_reader(raw.FD)
        if not self.sock.closed:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disable_monitor()
            self.sock.close(linger=0)
        if not self._monitor_owner.closed:
            self._monitor_owner.close(linger=0)
        self.peers = 0

    def _poll_monitor(self) -> None:
        """Handle every monitor event already queued, without blocking."""
        mon = self.monitor
        while not (mon.closed or self.closed):
            try:
                if not mon.get(zmq.EVENTS) & zmq.POLLIN:
                    return  # reading EVENTS also re-arms the edge-triggered FD
                event = parse_monitor_message(mon.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                return
            except Exception:  # a monitor hiccup must not stop the subscriber
                log.debug("monitor of %s", self.endpoint, exc_info=True)
                return
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.peers += 1
                self.handshakes += 1
                if self.on_reconnect is not None and self.handshakes > 1:
                    try:
                        self.on_reconnect()
                    except Exception:
                        log.exception("reconnect of %s", self.endpoint)
            elif event == zmq.EVENT_DISCONNECTED:
                self.peers = max(self.peers - 1, 0)

    def _on_readable(self) -> None:
        if self._read() and self.pacer is not None:
            self.pacer.woke()

    def _read(self) -> int:
        """Drain up to ``recv_batch`` messages without blocking; reschedule if more remain;
        return the number read.

        Called by the loop when the socket's ZMQ_FD fires (a message is almost always there),
        and by itself via ``call_soon`` when it stopped at the budget. After each message it
        asks ``ZMQ_EVENTS`` whether another is waiting rather than reading until ``zmq.Again``:
        a raised ``Again`` costs several times the question, and the question also re-arms the
        edge-triggered FD.
        """
        raw = self.raw
        if raw.closed or self.closed:
            return 0
        route = self.on_message
        events = raw.get
        recv = raw.recv
        monitor_signal = self._monitor_signal
        clock = time.perf_counter
        limit = self.options.recv_batch
        n = 0
        more = True
        try:
            t_end = clock() + self.options.recv_budget_s
            while True:
                # Frame by frame, asking each frame whether another follows: pyzmq's
                # recv_multipart asks the socket (ZMQ_RCVMORE) instead, at several times the cost.
                frame = recv(_NOBLOCK, copy=False)
                frames = [frame.bytes]
                while frame.more:
                    frame = recv(_NOBLOCK, copy=False)
                    frames.append(frame.bytes)
                n += 1
                if monitor_signal.poll(0):  # a handshake queued by now precedes it
                    self._poll_monitor()
                try:
                    route(frames)
                except Exception:  # nothing a socket delivers may stop the reader
                    log.exception("routing a message from %s", self.endpoint)
                if n >= limit or clock() > t_end:  # per message: one huge batch is enough
                    break  # budget spent: rescheduled below (more is True)
                if not events(_EVENTS) & _POLLIN:
                    more = False
                    break
        except zmq.Again:
            # Reading EVENTS re-arms the edge-triggered FD; a message may have slipped in.
            more = bool(events(_EVENTS) & _POLLIN)
        except zmq.ZMQError as exc:
            if raw.closed or self.closed:
                return n
            log.warning("recv on %s: %s", self.endpoint, exc)
        if n:
            self.on_read()
        if more:
            asyncio.get_running_loop().call_soon(self._on_readable)
        return n
