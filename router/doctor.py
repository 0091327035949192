"""``kvrouter doctor URL...``: check vLLM workers before pointing kvrouter at them.

Each worker is checked on its own (``router/doctor_probe.py``: reachability, models, tokenizer,
KV events and their block size, DP ranks and clock, replay, ``cached_tokens`` and prefix
caching), all workers at once; then the fleet is compared (``_fleet``): among workers of the
same model the same tokenization and LoRA adapters, and one block size throughout. Every
failing check names the flag that fixes it. The exit code is 0 only when the fleet is
routable exactly (``router/doctor_report.py`` says what each status means).

Every wait is bounded: each HTTP call, ZMQ connect and replay by ``--timeout``, the probe's
events by ``--events-wait``, the whole run by ``--deadline``.

The router's own start-up check (``router/selfcheck.py``) runs inside a live router, on its
index and subscriber; the doctor runs before there is one, so it opens its own short-lived
subscription and compares what it sees directly.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter
from collections.abc import Sequence

import httpx
import zmq.asyncio

from router.config import ConfigError, WorkerSpec, load_config, parse_worker_arg
from router.doctor_probe import Options, WorkerProbe
from router.doctor_report import (
    FAIL,
    FIX,
    OK,
    WARN,
    Finding,
    Report,
    WorkerReport,
    render_json,
    render_table,
)

__all__ = ["Options", "Report", "WorkerReport", "diagnose", "main"]


async def diagnose(urls: Sequence[str | WorkerSpec], options: Options | None = None) -> Report:
    """Check every worker (a URL, optionally ``;events=..;replay=..;dp_size=N;topic=T``, or a
    ``WorkerSpec``) and the fleet they form, within ``options.deadline_s``."""
    opts = options or Options()
    specs = [u if isinstance(u, WorkerSpec) else parse_worker_arg(u) for u in urls]
    t0 = time.monotonic()
    ctx = zmq.asyncio.Context()
    clients = [httpx.AsyncClient(base_url=s.url.rstrip("/"), timeout=opts.timeout_s) for s in specs]
    probes = [WorkerProbe(s, opts, c, ctx) for s, c in zip(specs, clients, strict=True)]
    try:
        tasks = [asyncio.create_task(p.run()) for p in probes]
        _, pending = await asyncio.wait(tasks, timeout=opts.deadline_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for p, t in zip(probes, tasks, strict=True):
            if t in pending:
                why = f"checks unfinished after the {opts.deadline_s:g}s deadline"
                p.report.add("deadline", FAIL, why, FIX["deadline"])
            elif t.exception() is not None:
                exc = t.exception()
                p.report.add("error", FAIL, f"{type(exc).__name__}: {exc}"[:200])
    finally:
        for c in clients:
            await c.aclose()
        ctx.destroy(linger=0)
    fleet = _fleet(probes)
    workers = [p.report for p in probes]
    for w in workers:
        w.checks = w.ordered()
    ok = not any(f.status == FAIL for w in workers for f in w.checks) and all(
        f.status != FAIL for f in fleet
    )
    return Report(ok, 0 if ok else 1, round(time.monotonic() - t0, 3), workers, fleet)


# ---------------------------------------------------------------- fleet


def _fleet(probes: list[WorkerProbe]) -> list[Finding]:
    return [_fleet_tokenizer(probes), *_fleet_models(probes), _fleet_block_size(probes)]


def _model_groups(probes: list[WorkerProbe]) -> dict[tuple[str, ...], list[WorkerProbe]]:
    """Workers by the base models they serve: a request only ever goes to workers of its
    model, so tokenizers and adapters are compared within a group, never across groups."""
    groups: dict[tuple[str, ...], list[WorkerProbe]] = {}
    for p in probes:
        groups.setdefault(tuple(sorted(p.report.models)), []).append(p)
    return groups


def _fleet_tokenizer(probes: list[WorkerProbe]) -> Finding:
    compared = 0
    differing: list[str] = []
    for group in _model_groups(probes).values():
        prints = {p.report.url: p.fingerprint for p in group if p.fingerprint is not None}
        compared += len(prints)
        counts = Counter(prints.values())
        if len(counts) <= 1:
            continue
        top = counts.most_common(1)[0][0]
        for p in group:
            fp = p.fingerprint
            if fp is None or fp == top:
                continue
            parts = [
                k for k, a, b in (("prompt", fp[0], top[0]), ("chat", fp[1], top[1])) if a != b
            ]
            p.report.add(
                "tokenizer",
                FAIL,
                f"tokenizes the {' and '.join(parts)} probe differently from {counts[top]} "
                "other worker(s) of its model",
                FIX["tokenizer"],
            )
        model = ", ".join(group[0].report.models) or "no model"
        differing.append(f"{len(counts)} among {len(prints)} workers of {model}")
    if differing:
        detail = f"different tokenizations: {'; '.join(differing)}"
        return Finding("tokenizer", FAIL, detail, FIX["tokenizer"])
    return Finding("tokenizer", OK, f"{compared} worker(s) tokenize the probes alike per model")


def _fleet_models(probes: list[WorkerProbe]) -> list[Finding]:
    """Several models are fine (each request goes to the workers of its model); a model on one
    worker has no failover, and an adapter missing from some workers of its base model sends
    every request for it to the others (or to ``lora.dynamic_loading``)."""
    groups = {m: g for m, g in _model_groups(probes).items() if m}
    for g in groups.values():
        loras = sorted({name for p in g for name in p.report.loras})
        for p in g:
            w = p.report
            lacking = [n for n in loras if n not in w.loras]
            lora = f"; LoRA: {', '.join(w.loras)}" if w.loras else ""
            w.add("models", OK, f"{', '.join(w.models)}{lora}")
            if lacking:
                w.add(
                    "loras",
                    WARN,
                    f"lacks LoRA adapter(s) {', '.join(lacking)} that other workers of "
                    f"{', '.join(w.models)} serve",
                    FIX["lora"],
                )
    each = "; ".join(f"{', '.join(m)} on {len(g)} worker(s)" for m, g in groups.items())
    if len(groups) > 1:
        alone = [", ".join(m) for m, g in groups.items() if len(g) == 1]
        note = f" ({', '.join(alone)}: a single worker, no failover)" if alone else ""
        out = [Finding("models", WARN, f"{len(groups)} models: {each}{note}", FIX["models"])]
    else:
        out = [Finding("models", OK, each or "none")]
    partial = sorted(
        {n for g in groups.values() for p in g for n in p.report.loras}
        - {n for g in groups.values() for n in _on_all(g)}
    )
    adapters = sorted({n for g in groups.values() for p in g for n in p.report.loras})
    if partial:
        out.append(
            Finding(
                "loras",
                WARN,
                f"not on every worker of their model: {', '.join(partial)} (requests for "
                "them go only to the workers that have them)",
                FIX["lora"],
            )
        )
    elif adapters:
        out.append(Finding("loras", OK, f"{', '.join(adapters)} on every worker of their model"))
    return out


def _on_all(group: list[WorkerProbe]) -> set[str]:
    sets = [set(p.report.loras) for p in group]
    return set.intersection(*sets) if sets else set()


def _fleet_block_size(probes: list[WorkerProbe]) -> Finding:
    sizes = {p.report.url: tuple(p.report.block_sizes) for p in probes if p.report.block_sizes}
    distinct = set(sizes.values())
    if len(distinct) > 1:
        each = ", ".join(f"{u} {'/'.join(map(str, s))}" for u, s in sizes.items())
        return Finding("block-size", FAIL, f"block sizes differ: {each}", FIX["block_size"])
    if not distinct:
        return Finding("block-size", OK, "no worker's events showed a block size")
    return Finding(
        "block-size", OK, f"{'/'.join(map(str, distinct.pop()))} on {len(sizes)} worker(s)"
    )


# ---------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvrouter doctor",
        description="Check vLLM workers before pointing kvrouter at them; every failing check "
        "names the flag that fixes it. Exit code 0 only when the fleet is routable exactly.",
    )
    p.add_argument(
        "urls",
        nargs="*",
        metavar="URL",
        help="worker base URL, optionally ';events=tcp://..;replay=tcp://..;dp_size=N;topic=T'",
    )
    p.add_argument("--config", default=None, help="also check the workers of this kvrouter config")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    d = Options()
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds per HTTP/ZMQ call")
    p.add_argument(
        "--events-wait", type=float, default=d.events_wait_s, help="seconds for the probe's events"
    )
    p.add_argument("--deadline", type=float, default=d.deadline_s, help="seconds for everything")
    p.add_argument(
        "--max-skew", type=float, default=d.max_skew_s, help="tolerated event clock skew (s)"
    )
    p.add_argument("--probe-tokens", type=int, default=d.probe_tokens)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        specs = [parse_worker_arg(u) for u in ns.urls]
        if ns.config:
            specs += list(load_config(ns.config).workers)
    except ConfigError as exc:
        print(f"kvrouter doctor: {exc}", file=sys.stderr)
        return 2
    if not specs:
        print("kvrouter doctor: give at least one worker URL (or --config)", file=sys.stderr)
        return 2
    values = (ns.timeout, ns.events_wait, ns.deadline, ns.max_skew, ns.probe_tokens)
    if min(values) <= 0:
        print("kvrouter doctor: timeouts, skew and probe tokens must be > 0", file=sys.stderr)
        return 2
    opts = Options(ns.timeout, ns.events_wait, ns.deadline, ns.max_skew, ns.probe_tokens)
    report = asyncio.run(diagnose(specs, opts))
    print(render_json(report) if ns.json else render_table(report))
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
