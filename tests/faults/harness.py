"""Helpers for the fault suite: one simulator process per worker (so one can be killed and
restarted on the same ports), router state probes, latency percentiles."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from simulator.testing import _flags, _stop, find_port_block

FAST = {"decode_ms": 1, "prefill_tps": 400000, "step_overhead_ms": 0.1}


@dataclass
class SimProc:
    """A single-worker ``kvrouter-sim`` process on fixed ports (killable, restartable)."""

    flags: dict[str, Any] = field(default_factory=dict)
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        if not self.port:
            self.port = find_port_block(3)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port + 1}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port + 2}"

    def start(self, timeout: float = 30.0) -> SimProc:
        cmd = [
            sys.executable, "-m", "simulator.cli", "--workers", "1", "--host", "127.0.0.1",
            "--base-port", str(self.port), "--event-base-port", str(self.port + 1),
            "--replay-base-port", str(self.port + 2), *_flags(self.flags),
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=1.0) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"simulator on {self.port} exited: {self.proc.returncode}")
                try:
                    if c.get(self.url + "/health").status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
        raise RuntimeError(f"simulator on {self.port} did not become healthy")

    def kill(self) -> None:
        """SIGKILL: no graceful shutdown, sockets reset, like a crashed or OOM-killed worker."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)
            self.proc = None

    def __enter__(self) -> SimProc:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def engine_row(debug_index: dict[str, Any], url: str) -> dict[str, Any]:
    w = next(x for x in debug_index["workers"] if x["url"] == url)
    return w["engines"][0]


def all_connected(router: Any) -> bool:
    """Every worker subscribed and every event socket connected (no slow-joiner loss)."""
    if not all(w.subscribed for w in router.registry.workers.values()):
        return False
    rows = router.subscriber.status()
    return len(rows) >= len(router.registry.workers) and all(r.connected for r in rows)


def flood(endpoint: str, topic: bytes, seconds: float, seed: int, out: Any) -> None:
    """(Child process.) Connect a PUB to ``endpoint`` and send random malformed frames as fast
    as possible for ``seconds``: unknown topics, the real topic with a wrong frame count, the
    real topic with a sequence frame that is not 8 bytes. ``out.value`` = messages sent."""
    import random as _random

    import zmq

    rng = _random.Random(seed)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.set_hwm(1_000_000)
    pub.connect(endpoint)
    time.sleep(0.3)  # (the child's own PUB handshake; the parent syncs on counters)
    n = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(200):
            kind = rng.randrange(3)
            body = [rng.randbytes(rng.randrange(0, 120)) for _ in range(rng.randrange(1, 5))]
            if kind == 0:
                frames = [b"\xff" + rng.randbytes(rng.randrange(0, 12)), *body]
            elif kind == 1:
                frames = [topic, *body[:1]] if rng.random() < 0.5 else [topic, *body, b"", b""]
            else:
                frames = [topic, rng.randbytes(rng.choice((0, 4, 7, 9, 16))), *body[:1]]
            try:
                pub.send_multipart(frames, zmq.NOBLOCK)
                n += 1
            except zmq.Again:
                pass
    out.value = n
    pub.close(0)
    ctx.term()
