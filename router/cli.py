"""``kvrouter serve``: run the gateway.

    kvrouter serve --config kvrouter.yaml
    kvrouter serve --port 8000 --worker http://h1:8000 \\
        --worker 'http://h2:8000;events=tcp://h2:5557;replay=tcp://h2:5558'

The ``kvrouter`` console script (``kvrouter.cli``) adds the ``demo`` subcommand; ``python -m
router.cli serve ...`` runs the gateway alone.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from router.config import Config, ConfigError, load_config, parse_worker_arg
from router.config_rules import validate
from router.logs import configure as configure_logging
from router.serving import serve

__all__ = ["add_serve_parser", "build_config", "main", "run_serve"]


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
    if ns.log_format is not None:
        cfg.server.log_format = ns.log_format
    # Re-validate with the command-line values applied (same messages as the YAML path).
    validate(cfg)
    if not cfg.workers and not cfg.discovery.kubernetes.enabled:
        raise ConfigError("workers: no workers configured (give --worker URL or workers: in YAML)")
    return cfg


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument("--log-format", default=None, help="text | json (server.log_format)")


def run_serve(ns: argparse.Namespace) -> int:
    try:
        cfg = build_config(ns)
    except ConfigError as exc:
        print(f"kvrouter: configuration error: {exc}", file=sys.stderr)
        return 2
    configure_logging(cfg.server.log_level, cfg.server.log_format)
    try:
        asyncio.run(serve(cfg))
    except KeyboardInterrupt:
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvrouter", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_serve_parser(sub)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
