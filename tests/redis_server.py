"""Test helper: a real ``redis-server`` on a free loopback port (no persistence).

    from redis_server import redis_server, RedisServer

    with redis_server() as srv:          # context manager
        srv.url                           # redis://127.0.0.1:PORT/0
        srv.kill(); srv.restart()         # same port, for outage tests

    def test_x(redis_url): ...            # pytest fixture (conftest-free: import the fixture)

Tests are skipped with a clear reason when the ``redis-server`` binary is absent (CI installs
Debian's ``redis-server`` through ``scripts/setup.sh --with-redis``). Start-up is bounded: the
server must answer PING within ``timeout`` seconds or the helper raises.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest

from simulator.testing import find_port_block

__all__ = ["RedisServer", "redis_server", "redis_url", "require_redis_server"]

BINARY = "redis-server"


def require_redis_server() -> str:
    path = shutil.which(BINARY)
    if path is None:
        pytest.fail(
            "redis-server binary not found on PATH (install Debian's redis-server, e.g. "
            "'scripts/setup.sh --with-redis' or 'apt-get install -y redis-server')"
        )
    return path


def _ping(port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` subprocess; ``kill()`` and ``restart()`` keep the port."""

    def __init__(self, binary: str, port: int | None = None, timeout: float = 10.0) -> None:
        self.binary = binary
        self.port = port or find_port_block(1)
        self.timeout = timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="kvrouter-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        cmd = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir.name,
            "--protected-mode", "no",
            "--loglevel", "warning",
        ]  # fmt: skip
        last = ""
        for _ in range(3):
            self.proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
            )
            deadline = time.monotonic() + self.timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                if _ping(self.port):
                    return
                time.sleep(0.02)
            last = self._reap()
            if "Address already in use" in last:
                self.port = find_port_block(1)  # lost a race for the port: try another one
                continue
            break
        raise RuntimeError(f"redis-server did not answer PING on port {self.port}: {last[-1000:]}")

    def _reap(self) -> str:
        out = b""
        proc, self.proc = self.proc, None
        if proc is None:
            return ""
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(Exception):
            out, _ = proc.communicate(timeout=5)
        return (out or b"").decode(errors="replace")

    def kill(self) -> None:
        """SIGKILL (no goodbye to clients) and wait until the port is closed."""
        self._reap()
        deadline = time.monotonic() + 5
        while _ping(self.port) and time.monotonic() < deadline:
            time.sleep(0.02)

    def restart(self) -> None:
        self.kill()
        port = self.port
        self.start()
        if self.port != port:  # pragma: no cover - only if another process grabbed it
            raise RuntimeError(f"redis-server could not get its port {port} back")

    def close(self) -> None:
        self._reap()
        self._dir.cleanup()


@contextlib.contextmanager
def redis_server(timeout: float = 10.0) -> Iterator[RedisServer]:
    srv = RedisServer(require_redis_server(), timeout=timeout)
    try:
        srv.start()
        yield srv
    finally:
        srv.close()


@pytest.fixture
def redis_url() -> Iterator[str]:
    with redis_server() as srv:
        yield srv.url
