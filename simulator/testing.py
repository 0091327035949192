"""Test helpers: start ``kvrouter-sim`` as a subprocess on free loopback ports, and wait for
an HTTP server to answer.

    from simulator.testing import running_fleet
    with running_fleet(2, block_size=16, num_gpu_blocks=256) as workers:
        workers[0].url, workers[0].events_endpoint, workers[0].replay_endpoint

    wait_http_ok("http://127.0.0.1:8000/ready", timeout=30, proc=router_process)

Keyword flags map to CLI flags (``block_size=16`` -> ``--block-size 16``; ``True`` -> a bare
flag; ``False``/``None`` -> omitted; lists repeat the flag). Ports: a contiguous block of
free ports is found by binding them all first, outside the kernel's ephemeral range (a port
from that range can be handed to any outgoing connection between the check and the server's
bind); if the subprocess still fails to bind (a race with another process) it is retried on a
new block. Startup is bounded (``timeout``).

Benches and the demo use ``wait_http_ok`` too: they import the simulator anyway, and
``router`` must not.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True)
class WorkerInfo:
    url: str  # http://127.0.0.1:PORT
    events_endpoint: str  # tcp://127.0.0.1:PORT (DP rank 0)
    replay_endpoint: str  # tcp://127.0.0.1:PORT (DP rank 0)
    port: int
    dp_size: int = 1

    def rank_endpoints(self, rank: int) -> tuple[str, str]:
        """(events, replay) of DP rank ``rank`` (ports + rank, as vLLM)."""

        def off(ep: str) -> str:
            host, _, port = ep.rpartition(":")
            return f"{host}:{int(port) + rank}"

        return off(self.events_endpoint), off(self.replay_endpoint)


def _ports_free(ports: list[int]) -> bool:
    socks: list[socket.socket] = []
    try:
        for p in ports:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind(("0.0.0.0", p))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()


# Linux's default ephemeral range and the BSDs' (49152-65535) together, for when the kernel's
# own cannot be read.
_FALLBACK_EPHEMERAL = (32768, 65535)


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return _FALLBACK_EPHEMERAL


def find_port_block(n: int, lo: int = 20000, hi: int = 65535) -> int:
    """Base of ``n`` consecutive currently-free TCP ports in ``[lo, hi]``, none of them in the
    kernel's ephemeral range (where an outgoing connection could take one before the caller
    binds it)."""
    eph_lo, eph_hi = _ephemeral_range()
    bases = [
        b
        for b in (range(lo, min(eph_lo, hi + 1) - n + 1), range(max(lo, eph_hi + 1), hi - n + 2))
        if len(b)
    ]
    if not bases:
        raise RuntimeError(
            f"no {n} ports in {lo}-{hi} outside the ephemeral range {eph_lo}-{eph_hi}"
        )
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    weights = [len(b) for b in bases]
    for _ in range(200):
        span = rng.choices(bases, weights)[0]
        base = rng.choice(span)
        if _ports_free(list(range(base, base + n))):
            return base
    raise RuntimeError("no free port block found")


def _flags(kw: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        if v is None or v is False:
            continue
        if v is True:
            out.append(flag)
        elif isinstance(v, (list, tuple)):
            for item in v:
                out += [flag, str(item)]
        else:
            out += [flag, str(v)]
    return out


@contextlib.contextmanager
def running_fleet(
    n: int = 1, *, timeout: float = 20.0, attempts: int = 3, **flags: Any
) -> Iterator[list[WorkerInfo]]:
    """Run ``n`` simulated workers in one ``kvrouter-sim`` subprocess; yields their info."""
    dp = int(flags.get("dp_size", 1) or 1)
    last_err = ""
    for _ in range(attempts):
        span = n * dp
        base = find_port_block(n + 2 * span)
        ev_base, rp_base = base + n, base + n + span
        cmd = [
            sys.executable,
            "-m",
            "simulator.cli",
            "--workers",
            str(n),
            "--host",
            "127.0.0.1",
            "--base-port",
            str(base),
            "--event-base-port",
            str(ev_base),
            "--replay-base-port",
            str(rp_base),
            *_flags(flags),
        ]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        try:
            ok = _wait_healthy(proc, [base + i for i in range(n)], timeout)
            if not ok:
                last_err = _stop(proc)
                continue
            infos = [
                WorkerInfo(
                    f"http://127.0.0.1:{base + i}",
                    f"tcp://127.0.0.1:{ev_base + i * dp}",
                    f"tcp://127.0.0.1:{rp_base + i * dp}",
                    base + i,
                    dp,
                )
                for i in range(n)
            ]
            yield infos
            return
        finally:
            _stop(proc)
    raise RuntimeError(f"kvrouter-sim did not become healthy: {last_err[-2000:]}")


def wait_http_ok(
    url: str,
    *,
    timeout: float,
    proc: subprocess.Popen[bytes] | None = None,
    content: bytes | None = None,
    interval: float = 0.1,
) -> bool:
    """Poll ``url`` until it answers 200 (GET, or POST of ``content``); False when ``timeout``
    seconds pass or ``proc``, the process that should serve it, exits first."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=1.0) as client:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                return False
            try:
                r = client.get(url) if content is None else client.post(url, content=content)
                if r.status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(interval)
    return False


def _wait_healthy(proc: subprocess.Popen[bytes], ports: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    return all(
        wait_http_ok(
            f"http://127.0.0.1:{port}/health",
            timeout=deadline - time.monotonic(),
            proc=proc,
            interval=0.05,
        )
        for port in ports
    )


def _stop(proc: subprocess.Popen[bytes]) -> str:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    err = b""
    if proc.stderr is not None:
        with contextlib.suppress(Exception):
            err = proc.stderr.read() or b""
        proc.stderr.close()
    return err.decode(errors="replace")
