"""``kvrouter`` command line: ``serve`` (the gateway), ``demo`` (simulated fleet + load), and the
``status`` and ``doctor`` tools.

    kvrouter serve --config kvrouter.yaml
    kvrouter serve --port 8000 --worker http://h1:8000 \\
        --worker 'http://h2:8000;events=tcp://h2:5557;replay=tcp://h2:5558'
    kvrouter demo [--json] [--serve --port 8000]
    kvrouter status http://router:8001 [--token T] [--json]
    kvrouter doctor http://vllm-0:8000 http://vllm-1:8000 [--json]
"""

from __future__ import annotations

import argparse
import signal
import sys
from types import FrameType

from router.cli import add_serve_parser, run_serve

__all__ = ["main"]


def _demo_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="simulated fleet + kvrouter vs round-robin on the same load")
    p.add_argument("--serve", action="store_true", help="keep fleet and router running")
    p.add_argument("--port", type=int, default=8000, help="router port with --serve")
    p.add_argument("--json", action="store_true", help="end with one JSON object")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--duration", type=float, default=20.0, help="seconds of load per policy")
    p.add_argument("--concurrency", type=int, default=8)


_TOOLS = {
    "status": "a running router's fleet as a table (router.status)",
    "doctor": "check vLLM workers before routing to them (router.doctor)",
}
"""Subcommands that are a module's ``main(argv)`` in router/."""


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in _TOOLS:  # before argparse: the tool owns every later argument
        import importlib

        return int(importlib.import_module(f"router.{args[0]}").main(args[1:]))
    parser = argparse.ArgumentParser(prog="kvrouter", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_serve_parser(sub)
    _demo_parser(sub)
    for name, text in _TOOLS.items():
        sub.add_parser(name, help=text)  # listed in --help; main() dispatches it first
    ns = parser.parse_args(args)
    if ns.cmd == "demo":
        # Imported here: `kvrouter serve` loads neither the demo's load generator nor the
        # simulator.
        from kvrouter.demo import run_demo

        # The simulated fleet runs in its own process session (a terminal's Ctrl-C must not
        # reach it before the demo stops it): SIGTERM unwinds like Ctrl-C, so the demo's
        # clean-up ends it too. While a router runs, the demo turns SIGTERM into a cancellation
        # of its own instead (kvrouter/demo.py, _with_router, says why).
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        return run_demo(ns)
    return run_serve(ns)


if __name__ == "__main__":
    sys.exit(main())
