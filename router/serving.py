"""The gateway's uvicorn servers: the API app and, when ``server.admin_port`` is set, the admin app.

``kvrouter serve`` and the demo both build their servers here, so both get the same bind
address, log level, shutdown timeout and request-head bounds from one ``Config``.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Sequence
from typing import Any

import uvicorn

from router.config import Config
from router.limits import uvicorn_options

__all__ = ["bound_port", "build_servers", "serve", "wait_started"]


def build_servers(cfg: Config, app: Any, admin: Any | None) -> list[uvicorn.Server]:
    """One server for ``app`` on ``server.port``; a second for ``admin`` on ``server.admin_port``
    when both are given. The admin app has no lifespan of its own: the API app's starts and
    stops the router they share."""
    level = cfg.server.log_level.lower()
    head = uvicorn_options(cfg.server.max_header_bytes)
    servers = [
        uvicorn.Server(
            uvicorn.Config(
                app,
                host=cfg.server.host,
                port=cfg.server.port,
                log_level=level,
                access_log=False,
                lifespan="on",
                timeout_graceful_shutdown=3,
                **head,
            )
        )
    ]
    if admin is not None and cfg.server.admin_port is not None:
        servers.append(
            uvicorn.Server(
                uvicorn.Config(
                    admin,
                    host=cfg.server.host,
                    port=cfg.server.admin_port,
                    log_level=level,
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

    app, admin, _router = create_apps(cfg)
    servers = build_servers(cfg, app, admin)
    tasks = [asyncio.create_task(s.serve()) for s in servers]

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
    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    freezer.cancel()
    trimmer.cancel()
    for s in servers:
        s.should_exit = True
    await asyncio.gather(*tasks, return_exceptions=True)
    for t in done:
        if t.exception() is not None:
            raise t.exception()  # type: ignore[misc]
