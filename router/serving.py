"""The gateway's uvicorn servers: the API app and, when ``server.admin_port`` is set, the admin app.

``kvrouter serve`` and the demo both build their servers here, so both get the same bind
address, log level and format and request-head bounds from one ``Config``.

**Draining.** uvicorn's own SIGTERM handling closes the listener at once and cuts whatever still
runs a few seconds later, while a streamed completion may need a minute. :func:`serve` handles
SIGTERM and SIGINT itself: ``/ready`` answers 503 at once (the router is draining), new requests
are still accepted for ``server.drain_delay_s`` while load balancers take the replica out, then
the listeners close and requests in flight get the rest of ``server.drain_timeout_s`` (counted
from the signal) to finish. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import time
from collections.abc import Iterator, Sequence
from typing import Any

import uvicorn

from router.config import Config
from router.limits import uvicorn_options
from router.logs import uvicorn_log_config

__all__ = ["bound_port", "build_servers", "serve", "wait_started"]

log = logging.getLogger("kvrouter")


class _Server(uvicorn.Server):
    """A uvicorn server that leaves SIGTERM and SIGINT to its owner (:func:`serve` drains;
    the demo ends its simulated fleet)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def build_servers(cfg: Config, app: Any, admin: Any | None) -> list[uvicorn.Server]:
    """One server for ``app`` on ``server.port``; a second for ``admin`` on ``server.admin_port``
    when both are given. The admin app has no lifespan of its own: the API app's starts and
    stops the router they share."""
    level = cfg.server.log_level.lower()
    head = uvicorn_options(cfg.server.max_header_bytes)
    # uvicorn's records in server.log_format, like the router's own.
    log_config = uvicorn_log_config(cfg.server.log_format)
    servers: list[uvicorn.Server] = [
        _Server(
            uvicorn.Config(
                app,
                host=cfg.server.host,
                port=cfg.server.port,
                log_level=level,
                log_config=log_config,
                access_log=False,
                lifespan="on",
                # A stop without a signal (the demo, tests) waits briefly; a SIGTERM drain
                # sets the time left of server.drain_timeout_s instead.
                timeout_graceful_shutdown=3,
                **head,
            )
        )
    ]
    if admin is not None and cfg.server.admin_port is not None:
        servers.append(
            _Server(
                uvicorn.Config(
                    admin,
                    host=cfg.server.host,
                    port=cfg.server.admin_port,
                    log_level=level,
                    log_config=log_config,
                    access_log=False,
                    lifespan="off",
                    **head,
                )
            )
        )
    return servers


async def wait_started(
    servers: Sequence[uvicorn.Server],
    tasks: Sequence[asyncio.Task[Any]],
    interval: float = 0.02,
) -> None:
    """Return once every server listens, or as soon as one of their tasks has ended."""
    while not all(s.started for s in servers) and not any(t.done() for t in tasks):
        await asyncio.sleep(interval)


def bound_port(server: uvicorn.Server) -> int:
    """The port a started server listens on (the real one when it was asked for port 0)."""
    return int(server.servers[0].sockets[0].getsockname()[1])


async def serve(cfg: Config, *, started: asyncio.Event | None = None) -> None:
    """Run the gateway until a server stops; ``started`` is set once all of them listen."""
    from router.app import create_apps
    from router.heap import trim_heap_forever

    app, admin, router = create_apps(cfg)
    servers = build_servers(cfg, app, admin)
    tasks = [asyncio.create_task(s.serve()) for s in servers]
    drain = _Drain(cfg, router, servers)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, drain.signal, sig)

    async def freeze_startup_objects() -> None:
        # Everything built at start-up (modules, the app, config, clients) lives as long as the
        # process: move it out of the cyclic GC's reach, so full collections scan only what came
        # after.
        await wait_started(servers, tasks, interval=0.05)
        gc.collect()
        gc.freeze()

    freezer = asyncio.create_task(freeze_startup_objects())
    trimmer = asyncio.create_task(trim_heap_forever())  # router/heap.py says why
    if started is not None:
        await wait_started(servers, tasks)
        started.set()
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    freezer.cancel()
    trimmer.cancel()
    for s in servers:
        s.should_exit = True
    await asyncio.gather(*tasks, return_exceptions=True)
    for t in done:
        if t.exception() is not None:
            raise t.exception()  # type: ignore[misc]


class _Drain:
    """What :func:`serve` does on SIGTERM / SIGINT (see the module docstring)."""

    def __init__(self, cfg: Config, router: Any, servers: Sequence[uvicorn.Server]) -> None:
        self.delay_s = min(cfg.server.drain_delay_s, cfg.server.drain_timeout_s)
        self.timeout_s = cfg.server.drain_timeout_s
        self.router = router
        self.servers = servers
        self.started_at: float | None = None
        self._task: asyncio.Task[None] | None = None

    def signal(self, sig: int) -> None:
        if self.started_at is not None:
            log.warning("second %s: stopping now", signal.Signals(sig).name)
            for s in self.servers:
                s.force_exit = s.should_exit = True
            return
        self.started_at = time.monotonic()
        self.router.draining = True
        log.info(
            "%s: draining (ready 503; accepting for %.1f s, in-flight requests get %.1f s)",
            signal.Signals(sig).name,
            self.delay_s,
            self.timeout_s,
        )
        self._task = asyncio.get_running_loop().create_task(self._close_listeners())

    async def _close_listeners(self) -> None:
        await asyncio.sleep(self.delay_s)
        assert self.started_at is not None
        left = max(self.timeout_s - (time.monotonic() - self.started_at), 0.0)
        for s in self.servers:
            s.config.timeout_graceful_shutdown = left
            s.should_exit = True
