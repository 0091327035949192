"""A protocol-exact test stand-in for vLLM 0.33's ``ZmqEventPublisher`` (docs/vllm-reference.md §2).

* PUB socket: binds when the endpoint contains ``*`` or ``::`` (or is ipc/inproc), otherwise
  connects (the inverted topology), as vLLM's ``_is_bind_endpoint`` decides.
* Every batch is one message ``[topic, seq (8 bytes BE), payload]``, seq from 0;
  payload = msgpack of ``[ts, [event maps...], dp_rank]`` with event maps exactly as §1.1 shows.
* Replay: a bound ROUTER; requests ``[identity, b"", start8]`` (anything else dropped); reply
  ``[identity, b"", topic, seq8, payload]`` per buffered batch with seq >= start, then
  ``[identity, b"", b"", ff*8, b""]``. ``legacy_replay=True`` gives vLLM <= 0.24's 2-frame body
  ``[identity, b"", seq8, payload]`` and end ``[identity, b"", ff*8, b""]``. Only the last
  ``buffer_steps`` batches are kept.

Deviations, for tests only: ``publish`` sends from the caller's thread (vLLM uses a publisher
thread; the wire is the same), the replay ROUTER is serviced by its own thread (so a slow replay,
``replay_delay_s``, overlaps live publishing), ``drop=True`` keeps a batch in the replay buffer
without sending it (a message lost on the way), ``mute_replay`` ignores replay requests.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)

_encoder = msgspec.msgpack.Encoder()


def block_stored(
    hashes: list[int],
    parent: int | None,
    tokens: list[int],
    block_size: int = 16,
    group_idx: int = 0,
    medium: str = "GPU",
) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        "group_idx": group_idx,
        "kv_cache_spec_kind": "full_attention",
    }


def block_removed(hashes: list[int], group_idx: int = 0, medium: str = "GPU") -> dict[str, Any]:
    return {
        "type": "BlockRemoved",
        "block_hashes": hashes,
        "medium": medium,
        "group_idx": group_idx,
    }


def all_blocks_cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def encode_batch(events: list[dict[str, Any]], dp_rank: int | None = 0, ts: float | None = None):
    return _encoder.encode([time.time() if ts is None else ts, events, dp_rank])


def _is_bind_endpoint(endpoint: str) -> bool:
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


class VllmPublisher:
    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:*",
        replay_endpoint: str | None = "tcp://127.0.0.1:*",
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        dp_rank: int = 0,
        hwm: int = 100_000,
        legacy_replay: bool = False,
        replay_delay_s: float = 0.0,
    ) -> None:
        self.ctx = zmq.Context()
        self.topic = topic.encode()
        self.dp_rank = dp_rank
        self.legacy_replay = legacy_replay
        self.replay_delay_s = replay_delay_s
        self.mute_replay = False
        self.replay_requests: list[int] = []
        self.replay_spans: list[tuple[float, float]] = []  # (monotonic start, end) served
        self.seq = 0
        self.sent: list[tuple[int, bytes]] = []  # every batch in seq order (also dropped ones)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.set_hwm(hwm)
        if _is_bind_endpoint(endpoint):
            self.pub.bind(endpoint)
            self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self.pub.connect(endpoint)
            self.endpoint = endpoint
        self.replay_endpoint: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay_endpoint is not None:
            self._router = self.ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
            self._router.bind(replay_endpoint)
            self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])

    # ------------------------------------------------------------------ live stream

    def publish(
        self,
        events: list[dict[str, Any]],
        *,
        drop: bool = False,
        ts: float | None = None,
        live_payload: bytes | None = None,
    ) -> int:
        """Publish one batch; returns its seq. ``drop``: buffer it but do not send it.
        ``live_payload``: send these bytes on PUB instead (the buffer keeps the real batch)."""
        payload = encode_batch(events, self.dp_rank, ts)
        return self.publish_payload(payload, drop=drop, live_payload=live_payload)

    def publish_payload(
        self, payload: bytes, *, drop: bool = False, live_payload: bytes | None = None
    ) -> int:
        seq = self.seq
        self.seq += 1
        with self._lock:
            self._buffer.append((seq, payload))
        self.sent.append((seq, payload))
        if not drop:
            live = payload if live_payload is None else live_payload
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), live], copy=False)
        return seq

    def send_raw(self, frames: list[bytes]) -> None:
        """Anything at all on the PUB socket (garbage, probes); does not touch seq or buffer."""
        self.pub.send_multipart(frames)

    # ------------------------------------------------------------------ replay

    def _serve_replay(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(20):
                continue
            frames = self._router.recv_multipart()
            if len(frames) != 3:
                continue  # vLLM drops malformed requests
            identity, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            self.replay_requests.append(start)
            if self.mute_replay:
                continue
            t0 = time.monotonic()
            with self._lock:
                batches = [(s, p) for s, p in self._buffer if s >= start]
            for seq, payload in batches:
                if self._stop.is_set():
                    return
                if self.replay_delay_s:
                    time.sleep(self.replay_delay_s)
                body = [seq.to_bytes(8, "big"), payload]
                if not self.legacy_replay:
                    body.insert(0, self.topic)
                self._router.send_multipart([identity, b"", *body])
            end = [END_SEQ, b""] if self.legacy_replay else [b"", END_SEQ, b""]
            self._router.send_multipart([identity, b"", *end])
            self.replay_spans.append((t0, time.monotonic()))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._router.close(linger=0)
        self.pub.close(linger=0)
        self.ctx.term()


class Chains:
    """Deterministic request chains: each request is a fresh prompt of whole 16-token blocks,
    published as one or more chained ``BlockStored`` events (parent = previous event's last
    hash), like chunked prefill."""

    def __init__(self, seed: int = 0, block_size: int = 16) -> None:
        self.rng = random.Random(seed)
        self.block_size = block_size
        self.prompts: list[list[int]] = []
        self.hashes: list[list[int]] = []

    def request(self, n_blocks: int = 4, chunks: int = 1) -> list[dict[str, Any]]:
        rng, bs = self.rng, self.block_size
        tokens = [rng.randrange(50_000) for _ in range(n_blocks * bs)]
        hashes = [rng.getrandbits(64) for _ in range(n_blocks)]
        self.prompts.append(tokens)
        self.hashes.append(hashes)
        events = []
        per = max(n_blocks // chunks, 1)
        parent = None
        for i in range(0, n_blocks, per):
            hs = hashes[i : i + per]
            events.append(block_stored(hs, parent, tokens[i * bs : (i + len(hs)) * bs], bs))
            parent = hs[-1]
        return events

    def evict(self, req: int, n_tail: int = 1) -> dict[str, Any]:
        """Remove the last ``n_tail`` blocks of request ``req`` (vLLM evicts from the tail)."""
        hs = self.hashes[req][-n_tail:]
        self.hashes[req] = self.hashes[req][:-n_tail]
        return block_removed(hs)
