"""The admin views of a router: ``/debug/index`` (its whole state) and ``/debug/route`` (why a
request would go where it goes). Both are JSON documents whose keys are a contract with
operators' tools and the tests; the Prometheus view is ``router.metrics``, the page for people
``router.status_page`` (it renders ``/debug/index``)."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import msgspec

from indexer.subscriber import SourceStatus
from router.core import Router, RouteResult
from router.load import EngineLoad
from router.policy import KvRouterPolicy
from router.status import rows
from router.workers import Worker

__all__ = ["debug_index", "explain"]


def debug_index(router: Router) -> dict[str, Any]:
    """Every worker and engine (index residency, event source, load, verification, self-check)
    and the router's totals, model names, shared state and discovery."""
    status = router.subscriber_status()
    out = []
    total_blocks = 0
    for w in router.registry.workers.values():
        engines = _engines(router, w, status.get(w.url, []))
        total_blocks += sum(x["resident_blocks"] for x in engines)
        out.append(
            {
                "url": w.url,
                "healthy": w.healthy,
                "health_error": w.last_health_error,
                "stalled": w.stalled,
                "stalled_ranks": sorted(w.stalled_ranks),
                "events_endpoint": w.events_endpoint,
                "replay_endpoint": w.replay_endpoint,
                "subscribed": w.subscribed,
                "dp_size": w.dp_size,
                "unseen_ranks": w.unseen_ranks,
                "degraded": any(x["degraded"] for x in engines),
                "resident_blocks": sum(x["resident_blocks"] for x in engines),
                "engines": engines,
                "unverified": any(
                    (x["verify"] or {}).get("state") == "unverified" for x in engines
                ),
                "selfcheck": router.selfcheck.debug(w.url) if router.selfcheck else None,
            }
        )
    tokenizer = router.tokenizer
    models = router.registry.models
    doc = {
        "workers": out,
        "totals": {
            "workers": len(out),
            "healthy_workers": sum(1 for w in out if w["healthy"]),
            "resident_blocks": total_blocks,
            "index_entries": router.index.total_entries,
            "speculative_keys": len(router.speculative),
            "tokenizer_cache_entries": len(tokenizer),
            "tokenizer_stats": dict(tokenizer.stats),
        },
        "model": {
            "namespace": models.base,
            "aliases": sorted(models.aliases),
            "loras": sorted(models.loras),
            # learned from /tokenize's refusal: workers on vLLM's Mistral tokenizer
            "tool_call_ids_cut": sorted(m for m in tokenizer.short_tool_call_ids.models if m),
        },
        "policy": router.cfg.policy.name,
        "shared_state": router.shared.status(),
        "discovery": router.discovery.debug() if router.discovery is not None else None,
        "admission": router.admission.status() if router.admission is not None else None,
        "process_rss_bytes": _rss_bytes(),
        "uptime_s": round(time.time() - router.started, 3),
        "recent": {
            "decisions": router.recorder.decisions(),
            "hit_rate_per_minute": router.recorder.hit_rate(),
        },
    }
    # One row per engine as `kvrouter status` prints it: the status page shows the same.
    doc["engine_rows"] = rows(doc)
    return doc


def _load_view(ld: EngineLoad, now: float) -> dict[str, Any]:
    """An engine's load as shown: its fields, and ``head_age_s``, how long the engine has been
    on the head of this router's queue there (None without one): ``head_since`` is a reading
    of the router's monotonic clock, which means nothing outside the process."""
    out = msgspec.structs.asdict(ld)
    out["head_age_s"] = round(max(now - ld.head_since, 0.0), 3) if ld.head_tokens else None
    return out


def _engines(router: Router, w: Worker, rows: list[SourceStatus]) -> list[dict[str, Any]]:
    index = router.index
    out = []
    for e in w.engines():
        st = index.engine_stats(e)
        srow = next((s for s in rows if s.dp_rank == e[1]), None)
        degraded = False
        with contextlib.suppress(Exception):
            degraded = bool(router.subscriber.is_degraded(e))
        out.append(
            {
                "dp_rank": e[1],
                "resident_blocks": index.resident_blocks(e),
                "resident": st.resident if st else {},
                "groups": st.groups if st else {},
                "hashes": st.hashes if st else 0,
                "counters": st.counters if st else {},
                "degraded": degraded,
                "subscriber": msgspec.structs.asdict(srow) if srow is not None else None,
                "load": _load_view(w.load(e[1]), time.monotonic()),
                "verify": router.verifier.debug(e) if router.verifier is not None else None,
            }
        )
    return out


def explain(
    router: Router,
    res: RouteResult,
    chat: bool,
    elapsed: float,
    body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``/debug/route``: the decision for one request and every candidate's inputs and cost.
    ``body``: a completion's, whose ``priority`` ``policy.prefill_priority`` may write (None for
    the rest of vLLM's API, forwarded untouched)."""
    d = res.decision
    now = time.monotonic()
    costs = {c.engine: c for c in d.costs}
    rank = {e: i for i, e in enumerate(d.ranked)}
    workers = []
    for c in res.candidates:
        url, dp = c.engine
        m = res.matches.get(c.engine)
        wc = costs.get(c.engine)
        workers.append(
            {
                "url": url,
                "dp_rank": dp,
                "rank": rank.get(c.engine),
                "gpu_hit_tokens": c.gpu_hit_tokens,
                "cpu_hit_tokens": c.cpu_hit_tokens,
                "speculative_hit_tokens": c.speculative_tokens,
                "adapter_tokens": c.adapter_tokens,
                "groups": [msgspec.structs.asdict(g) for g in m.groups] if m else [],
                "load": _load_view(c.load, now),
                "cost": None
                if wc is None
                else {
                    "tokens": round(wc.cost_tokens, 3),
                    "uncached_tokens": wc.uncached_tokens,
                    "cpu_tokens": wc.cpu_hit_tokens,
                    "queued_tokens": wc.queued_tokens,
                    "metrics_tokens": round(wc.metrics_tokens, 3),
                    "follow_on_tokens": round(wc.follow_on_tokens, 3),
                    "junction_tokens": wc.junction_tokens,
                    "new_holder_tokens": round(wc.new_holder_tokens, 3),
                    "expected_ttft_s": round(wc.expected_ttft_s, 6),
                    "prefill_tokens_per_s": round(wc.prefill_tokens_per_s, 1),
                    "prefill_rate": "learned" if wc.rate_learned else "configured",
                    "speculative": wc.speculative,
                },
            }
        )
    tok = res.tokens
    p = router.policy
    hit_loss = None
    if isinstance(p, KvRouterPolicy):
        hit_loss = {
            "budget": p.params.hit_loss_budget,
            "debt_tokens": round(p.hit_debt_tokens, 1),
            "added_weight": round(p.hit_loss_weight(), 4),
        }
    chosen = costs.get(d.engine)
    written = None
    if body is not None and chosen is not None:
        written = router.prioritized(body, d.ranked[:2], chosen.uncached_tokens, record=False)
    return {
        "kind": "chat" if chat else "completion",
        "policy": router.policy.name,
        "hit_loss": hit_loss,
        "prefill_priority": written["priority"] if written else None,
        "namespace": res.namespace,
        "prompt_tokens": tok.n_tokens if tok else None,
        "tokenization": tok.source if tok else "failed",
        "tokenize_error": res.tokenize_error,
        "chosen": d.engine[0],
        "chosen_dp_rank": d.engine[1],
        "reason": d.reason,
        "predicted_hit_tokens": d.predicted_hit_tokens,
        "decision_seconds": round(elapsed, 6),
        "workers": workers,
    }


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # pragma: no cover - non-Linux
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
