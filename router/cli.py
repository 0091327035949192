"""``kvrouter`` command line: ``serve`` (the gateway) and ``demo`` (simulated fleet + load).

    kvrouter serve --config kvrouter.yaml
    kvrouter serve --port 8000 --worker http://h1:8000 \\
        --worker 'http://h2:8000;events=tcp://h2:5557;replay=tcp://h2:5558'
    kvrouter demo [--json] [--serve --port 8000]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import sys

import uvicorn

from router.config import Config, ConfigError, load_config, parse_worker_arg

__all__ = ["build_config", "main", "serve"]


def build_config(ns: argparse.Namespace) -> Config:
    cfg = load_config(ns.config)
    if ns.worker:
        cfg.workers = [parse_worker_arg(w) for w in ns.worker]
    if ns.port is not None:
        cfg.server.port = ns.port
    if ns.host is not None:
        cfg.server.host = ns.host
    if ns.policy is not None:
        cfg.policy.name = ns.policy
    if ns.log_level is not None:
        cfg.server.log_level = ns.log_level
    # Re-validate with the command-line values applied (same messages as the YAML path).
    from router.config import _validate

    _validate(cfg)
    if not cfg.workers and not cfg.discovery.kubernetes.enabled:
        raise ConfigError("workers: no workers configured (give --worker URL or workers: in YAML)")
    return cfg


async def serve(cfg: Config, *, started: asyncio.Event | None = None) -> None:
    from router.app import create_apps
    from router.heap import trim_heap_forever
    from router.limits import uvicorn_options

    app, admin, _router = create_apps(cfg)
    level = cfg.server.log_level.lower()
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
                **uvicorn_options(cfg.server.max_header_bytes),
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
                    **uvicorn_options(cfg.server.max_header_bytes),
                )
            )
        )
    tasks = [asyncio.create_task(s.serve()) for s in servers]

    async def freeze_startup_objects() -> None:
        # Everything built at start-up (modules, the app, config, clients) lives as long as the
        # process: move it out of the cyclic GC's reach, so full collections scan only what came
        # after (a full collection of the started router took ~20 ms, measured).
        while not all(s.started for s in servers) and not any(t.done() for t in tasks):
            await asyncio.sleep(0.05)
        gc.collect()
        gc.freeze()

    freezer = asyncio.create_task(freeze_startup_objects())
    trimmer = asyncio.create_task(trim_heap_forever())  # router/heap.py says why
    if started is not None:
        while not all(s.started for s in servers) and not any(t.done() for t in tasks):
            await asyncio.sleep(0.02)
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


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the gateway")
    p.add_argument("--config", default=os.environ.get("KVROUTER_CONFIG"), help="YAML config")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--host", default=None)
    p.add_argument(
        "--worker",
        action="append",
        default=[],
        help="worker base URL, optionally ';events=tcp://..;replay=tcp://..;dp_size=N;topic=T'",
    )
    p.add_argument("--policy", default=None, help="kvrouter | round_robin | least_loaded | random")
    p.add_argument("--log-level", default=None)


def _demo_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="simulated fleet + kvrouter vs round-robin on the same load")
    p.add_argument("--serve", action="store_true", help="keep fleet and router running")
    p.add_argument("--port", type=int, default=8000, help="router port with --serve")
    p.add_argument("--json", action="store_true", help="end with one JSON object")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--duration", type=float, default=20.0, help="seconds of load per policy")
    p.add_argument("--concurrency", type=int, default=8)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvrouter", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    _serve_parser(sub)
    _demo_parser(sub)
    ns = parser.parse_args(argv)
    if ns.cmd == "serve":
        try:
            cfg = build_config(ns)
        except ConfigError as exc:
            print(f"kvrouter: configuration error: {exc}", file=sys.stderr)
            return 2
        logging.basicConfig(
            level=cfg.server.log_level.upper() if cfg.server.log_level != "trace" else "DEBUG",
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        logging.getLogger("httpx").setLevel(logging.WARNING)
        try:
            asyncio.run(serve(cfg))
        except KeyboardInterrupt:
            pass
        return 0
    if ns.cmd == "demo":
        from router.demo import run_demo

        return run_demo(ns)
    return 2


if __name__ == "__main__":
    sys.exit(main())
