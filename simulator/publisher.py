"""ZMQ event publisher with replay, wire-compatible with vLLM's ``ZmqEventPublisher``
(``vllm/distributed/kv_events.py`` L313, 0.33).

- PUB socket binds when the endpoint has ``*``/``::`` or is ipc/inproc, else connects
  (``_is_bind_endpoint`` L461). Live frames: ``[topic, seq 8-byte BE, payload]`` (L511).
- Sequence numbers start at 0 per publisher (``itertools.count()``), assigned by the
  publisher thread as it sends; a restart starts again at 0 with an empty buffer.
- Replay: ROUTER, always bound, SNDHWM ``2*(buffer_steps+1)`` (L370). A request must be
  exactly ``[identity, b"", start_seq8]``; the reply is one message per buffered batch with
  ``seq >= start``: ``[identity, b"", topic, seq8, payload]``, then the end marker
  ``[identity, b"", b"", ff*8, b""]`` (``_service_replay`` L521). The buffer keeps the last
  ``buffer_steps`` batches.
- A bounded queue (``max_queue_size``) feeds the thread; vLLM blocks when it is full, the
  simulator drops and counts instead (the engine must not stall an event loop).
"""

from __future__ import annotations

import contextlib
import queue
import random
import threading
import time
from collections import deque

import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def is_bind_endpoint(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def offset_endpoint_port(endpoint: str, rank: int) -> str:
    """``offset_endpoint_port`` L542: tcp port + rank (port 0 unchanged), inproc suffix."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        if port == "0":
            return endpoint
        return f"{host}:{int(port) + rank}"
    raise ValueError("only tcp:// and inproc:// endpoints support DP offsets")


class ZmqPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        ctx: zmq.Context | None = None,
        legacy_replay: bool = False,
        bind_retry_s: float = 0.0,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.topic_bytes = topic.encode()
        self.buffer_steps = buffer_steps
        self.hwm = hwm
        self.max_queue_size = max_queue_size
        self.legacy_replay = legacy_replay  # vLLM 0.23/0.24: replay bodies [seq, payload]
        self.bind_retry_s = bind_retry_s
        self.drop_fraction = 0.0
        self.dropped = 0
        self.queue_full_drops = 0
        self._rng = random.Random(12345)
        self._ctx = ctx or zmq.Context.instance()
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="sim-kv-pub", daemon=True)
        self._thread.start()
        self._ready.wait(20)
        if self._error is not None:
            raise RuntimeError(f"publisher failed to start: {self._error}") from self._error

    # ---- API -------------------------------------------------------------------------------
    def publish(self, payload: bytes) -> None:
        try:
            self._queue.put_nowait(payload)
        except queue.Full:
            self.queue_full_drops += 1

    def flush(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not self._queue.empty() and time.monotonic() < deadline:
            time.sleep(0.002)

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        self._thread.join(5)

    @property
    def next_seq(self) -> int:
        return self._seq

    # ---- thread ------------------------------------------------------------------------------
    def _bind_or_connect(self, sock: zmq.Socket, endpoint: str, bind: bool) -> None:
        deadline = time.monotonic() + self.bind_retry_s
        while True:
            try:
                sock.bind(endpoint) if bind else sock.connect(endpoint)
                return
            except zmq.ZMQError as e:  # a just-closed socket may hold the port briefly
                if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _run(self) -> None:
        pub = replay = None
        try:
            pub = self._ctx.socket(zmq.PUB)
            pub.set_hwm(self.hwm)
            pub.setsockopt(zmq.LINGER, 0)
            self._bind_or_connect(pub, self.endpoint, is_bind_endpoint(self.endpoint))
            if self.replay_endpoint:
                replay = self._ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.SNDHWM, 2 * (self.buffer_steps + 1))
                replay.setsockopt(zmq.LINGER, 0)
                self._bind_or_connect(replay, self.replay_endpoint, True)
        except BaseException as e:  # reported to the constructor
            self._error = e
            for s in (pub, replay):
                if s is not None:
                    s.close(0)
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if replay is not None and poller.poll(0):
                    self._service_replay(replay)
                try:
                    payload = self._queue.get(timeout=0.01)
                except queue.Empty:
                    continue
                if payload is None:
                    break
                seq = self._seq
                self._seq += 1
                seq_bytes = seq.to_bytes(8, "big")
                self._buffer.append((seq, payload))
                if self.drop_fraction and self._rng.random() < self.drop_fraction:
                    self.dropped += 1  # a gap the subscriber can fill by replay
                    continue
                pub.send_multipart((self.topic_bytes, seq_bytes, payload), copy=False)
        finally:
            pub.close(0)
            if replay is not None:
                replay.close(0)

    def _service_replay(self, sock: zmq.Socket) -> None:
        frames = sock.recv_multipart()
        if len(frames) != 3:
            return  # vLLM drops malformed requests
        identity, _, start_b = frames
        if len(start_b) != 8:
            return
        start = int.from_bytes(start_b, "big")
        if self.legacy_replay:  # before PR #45177: no topic frame
            for seq, payload in list(self._buffer):
                if seq >= start:
                    sock.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
            sock.send_multipart((identity, b"", END_SEQ, b""))
            return
        for seq, payload in list(self._buffer):
            if seq >= start:
                sock.send_multipart(
                    (identity, b"", self.topic_bytes, seq.to_bytes(8, "big"), payload)
                )
        sock.send_multipart((identity, b"", b"", END_SEQ, b""))
