"""``POST /reset_prefix_cache`` on the gateway: vLLM's own endpoint, sent to every worker.

A reinforcement-learning loop resets every engine's prefix cache after each weight update (the
cached blocks were computed with the old weights). Through the gateway that is one call: each
worker gets vLLM's ``POST /reset_prefix_cache`` with the same query (``reset_running_requests``,
``reset_external``), every worker's answer is reported, and the index forgets the engines of
each worker whose reset vLLM confirms, at once. Left to the events, it would learn of the reset
only with the engine's next step (vLLM publishes ``AllBlocksCleared`` in that step's batch:
docs/vllm-reference.md §2.5), so the first request routed there would be credited blocks that
are gone. ``?model=NAME`` (kvrouter's, not forwarded) limits the call to the workers serving
that model. vLLM serves the endpoint only when started with ``VLLM_SERVER_DEV_MODE=1``; a worker
that answers 404 is reported with that fix.

vLLM refuses a reset while blocks are held (``{"success": false}``, running requests or KV
transfers) unless ``reset_running_requests=true``; the index then forgets nothing there.
Other router replicas learn of the reset from the events, with the engine's next step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import httpx

from router.errors import BodyError

if TYPE_CHECKING:
    from router.core import Router
    from router.workers import Worker

__all__ = ["FORWARDED", "RESET_TIMEOUT_S", "reset_prefix_caches"]

FORWARDED = ("reset_running_requests", "reset_external")
"""vLLM's query parameters of the endpoint, passed to every worker as given."""

RESET_TIMEOUT_S = 60.0
"""Per worker: with ``reset_running_requests`` vLLM preempts every running request first."""


async def reset_prefix_caches(router: Router, query: Mapping[str, str]) -> dict[str, Any]:
    """Reset every (matching) worker's prefix cache; ``{"success": all confirmed, "workers":
    {url: {"success": bool, ...}}}``. BodyError 404 when no worker serves ``?model=``."""
    model = query.get("model")
    params = {k: query[k] for k in FORWARDED if k in query}
    workers = [w for w in router.registry.workers.values() if model is None or w.serves(model)]
    if not workers:
        raise BodyError(404, f"no worker serves the model `{model}`", "NotFoundError")
    answers = await asyncio.gather(*(_reset(router, w, params) for w in workers))
    return {
        "success": all(a["success"] for a in answers),
        "workers": {w.url: a for w, a in zip(workers, answers, strict=True)},
    }


async def _reset(router: Router, w: Worker, params: dict[str, str]) -> dict[str, Any]:
    try:
        r = await router.registry.post_admin(w, "/reset_prefix_cache", params, RESET_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return {"success": False, "error": f"{type(exc).__name__}: {exc}"}
    if r.status_code == 404:
        return {
            "success": False,
            "status": 404,
            "error": "no /reset_prefix_cache there: start vLLM with VLLM_SERVER_DEV_MODE=1",
        }
    try:
        ok = r.status_code == 200 and r.json().get("success") is True
    except ValueError:
        ok = False
    if not ok:
        return {"success": False, "status": r.status_code, "answer": r.text[:500]}
    for engine in w.engines():
        router.index.clear_engine(engine)
    return {"success": True}
