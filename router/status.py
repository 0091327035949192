"""``kvrouter status URL``: a running router's fleet as a terminal table.

It reads the router's ``GET /debug/index`` (the admin port when ``server.admin_port`` is set;
``--token`` for ``server.admin_token`` or an API key) and prints one row per engine (worker, DP
rank): health, event subscription, whether its predictions are trusted, how often they were
exact, what it holds per medium and what is queued on it. ``--json`` prints the raw document.
Exit code 0 when every engine is healthy, subscribed and trusted; 1 otherwise; 2 when the
router cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import httpx

__all__ = ["format_status", "main", "rows"]

_COLUMNS = (
    ("worker", "<"),
    ("dp", ">"),
    ("health", "<"),
    ("events", "<"),
    ("trust", "<"),
    ("exact", ">"),
    ("GPU blocks", ">"),
    ("CPU blocks", ">"),
    ("in flight", ">"),
    ("queued", ">"),
)


def rows(doc: dict[str, Any]) -> list[dict[str, str]]:
    """One row per engine of a ``/debug/index`` document, as strings for the table."""
    out = []
    for w in doc.get("workers", []):
        engines = w.get("engines") or [{"dp_rank": 0}]
        for e in engines:
            sub = e.get("subscriber") or {}
            verify = e.get("verify") or {}
            load = e.get("load") or {}
            resident = e.get("resident") or {}
            out.append(
                {
                    "worker": w.get("url", "?"),
                    "dp": str(e.get("dp_rank", 0)),
                    "health": "ok" if w.get("healthy") else f"DOWN {w.get('health_error') or ''}",
                    "events": _events(w, e, sub),
                    "trust": _trust(verify),
                    "exact": _exact(verify),
                    "GPU blocks": str(_medium(resident, "GPU")),
                    "CPU blocks": str(_medium(resident, "CPU")),
                    "in flight": str(load.get("inflight_requests", 0)),
                    "queued": str(load.get("queued_prefill_tokens", 0)),
                    # Not table columns: the status page (router/status_page.py) shows them.
                    "reason": _reason(w, e, sub, verify),
                    "resident": _resident(resident, e.get("groups") or {}),
                }
            )
    return out


def _reason(w: dict[str, Any], e: dict[str, Any], sub: dict[str, Any], v: dict[str, Any]) -> str:
    """Why an engine is down, degraded or unverified ("" when it is none of them)."""
    out = []
    if not w.get("healthy") and w.get("health_error"):
        out.append(f"health: {w['health_error']}")
    if e.get("degraded"):
        out.append(f"degraded: {sub.get('degraded_reason') or '?'}")
    if v.get("state") == "unverified":
        detail = v.get("cause_detail")
        out.append(f"unverified: {v.get('cause') or '?'}" + (f" ({detail})" if detail else ""))
    return "; ".join(out)


def _resident(resident: dict[str, int], groups: dict[Any, Any]) -> str:
    """Resident blocks per KV cache group and medium, e.g. ``full_attention/GPU 120`` (the group's
    index is added when there are several)."""
    kinds = {str(g): (spec or {}).get("kind", "group") for g, spec in groups.items()}
    parts = []
    for key, n in resident.items():
        group, _, medium = key.rpartition("/")
        name = kinds.get(group, "group")
        if len(kinds) > 1 or group not in kinds:
            name += f" {group}"
        parts.append(f"{name}/{medium} {n}")
    return ", ".join(parts)


def _events(w: dict[str, Any], e: dict[str, Any], sub: dict[str, Any]) -> str:
    if not w.get("subscribed"):
        return "none" if w.get("events_endpoint") is None else "pending"
    if e.get("degraded"):
        return "degraded"
    if sub.get("replaying"):
        return "replaying"
    return "live" if sub.get("connected") else "disconnected"


def _trust(verify: dict[str, Any]) -> str:
    state = verify.get("state", "unmeasured")
    if state == "unverified":
        return f"UNVERIFIED ({verify.get('cause') or '?'})"
    return str(state)


def _exact(verify: dict[str, Any]) -> str:
    samples = verify.get("samples") or 0
    if not samples:
        return "-"
    return f"{verify.get('exact', 0)}/{samples}"


def _medium(resident: dict[str, int], medium: str) -> int:
    return sum(n for key, n in resident.items() if key.rsplit("/", 1)[-1] == medium)


def healthy(doc: dict[str, Any]) -> bool:
    return all(
        r["health"] == "ok" and r["events"] == "live" and not r["trust"].startswith("UNVERIFIED")
        for r in rows(doc)
    ) and bool(doc.get("workers"))


def format_status(doc: dict[str, Any]) -> str:
    table = rows(doc)
    widths = {name: max([len(name), *(len(r[name]) for r in table)]) for name, _align in _COLUMNS}
    lines = ["  ".join(f"{name:{a}{widths[name]}}" for name, a in _COLUMNS)]
    lines.append("  ".join("-" * widths[name] for name, _ in _COLUMNS))
    for r in table:
        lines.append("  ".join(f"{r[name]:{a}{widths[name]}}" for name, a in _COLUMNS))
    t = doc.get("totals", {})
    lines.append("")
    lines.append(
        f"{t.get('healthy_workers', 0)}/{t.get('workers', 0)} workers healthy, "
        f"{t.get('resident_blocks', 0)} resident blocks, policy {doc.get('policy', '?')}, "
        f"shared state {(doc.get('shared_state') or {}).get('backend', 'local')}, "
        f"up {doc.get('uptime_s', 0):.0f} s"
    )
    if not table:
        lines.append("no workers")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvrouter status", description=__doc__)
    ap.add_argument("url", help="the router's base URL (its admin port if it has one)")
    ap.add_argument("--token", help="server.admin_token, or an API key without one")
    ap.add_argument("--json", action="store_true", help="print /debug/index as JSON")
    ap.add_argument("--timeout", type=float, default=5.0)
    ns = ap.parse_args(argv)
    headers = {"authorization": f"Bearer {ns.token}"} if ns.token else {}
    url = ns.url.rstrip("/") + "/debug/index"
    try:
        r = httpx.get(url, headers=headers, timeout=ns.timeout)
    except httpx.HTTPError as exc:
        print(f"kvrouter status: cannot reach {url}: {exc}", file=sys.stderr)
        return 2
    if r.status_code in (401, 403):
        print(f"kvrouter status: {url} needs a token (--token)", file=sys.stderr)
        return 2
    if r.status_code != 200:
        print(f"kvrouter status: {url} answered {r.status_code}", file=sys.stderr)
        return 2
    doc = r.json()
    print(json.dumps(doc, indent=1) if ns.json else format_status(doc))
    return 0 if healthy(doc) else 1
