"""A model's :class:`~router.anthropic.TemplateTraits`, learned from a worker as vLLM learns
them from its own chat template, by rendering probes.

vLLM 0.32 (``AnthropicServingMessages``):

* merges inline system messages into the leading one when its template fails to render
  ``[system, user, system, user]`` without a generation prompt (Qwen's templates, for one,
  raise on a system message that is not first). The router sends the same conversation to
  ``POST /tokenize``: a refusal (4xx) is a failed render. vLLM renders its probe in a bare
  jinja environment, and also with the template it would pick for an empty tool list; a
  template that fails only there (one calling a helper only vLLM's renderer defines, or a
  tokenizer with a separate tool-use template that refuses it) is read differently.
* makes ``thinking: {"type": "disabled"}`` reasoning effort ``"none"``, or ``"low"`` when the
  template refuses ``"none"`` or renders it as it renders one of the efforts (a template that
  ignores the effort). The router tokenizes the same one-turn chat ("Hi") with each effort.

The answers are kept per model for :data:`TTL_S` seconds (a redeploy may change the
template) and for at most :data:`MAX_MODELS` models; a probe that could not reach a worker is
not kept, and the request that needed it is routed by load. Concurrent requests for the same
model share one probe.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from router.anthropic import TemplateTraits
from router.tokenize import TokenIds, TokenizeError, TokenizeRefused

__all__ = ["MAX_MODELS", "TTL_S", "TemplateProbe"]

TTL_S = 300.0
MAX_MODELS = 256
EFFORTS = ("low", "medium", "high", "xhigh", "max")
"""vLLM 0.32's ``AnthropicEffort``."""

Tokenize = Callable[[dict[str, Any]], Awaitable[TokenIds]]
"""Tokenize a chat body (``model``, ``messages`` and chat fields) on a worker serving it."""

_PROBE_TURNS = [
    {"role": "system", "content": "t"},
    {"role": "user", "content": "t"},
    {"role": "system", "content": "t"},
    {"role": "user", "content": "t"},
]


class TemplateProbe:
    """Per-model template traits, probed on first need and kept :data:`TTL_S` seconds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._known: OrderedDict[str, tuple[TemplateTraits, float]] = OrderedDict()
        self._pending: dict[str, asyncio.Future[TemplateTraits | None]] = {}

    async def traits(self, model: str, tokenize: Tokenize) -> TemplateTraits | None:
        """``model``'s traits, or None when no worker could be asked."""
        now = self._clock()
        got = self._known.get(model)
        if got is not None and got[1] > now:
            return got[0]
        pending = self._pending.get(model)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[TemplateTraits | None] = asyncio.get_running_loop().create_future()
        self._pending[model] = fut
        try:
            found = await _probe(model, tokenize)
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: waiters re-raise it, none left unobserved
            raise
        else:
            fut.set_result(found)
        finally:
            del self._pending[model]
        if found is not None:
            self._known[model] = (found, self._clock() + TTL_S)
            self._known.move_to_end(model)
            while len(self._known) > MAX_MODELS:
                self._known.popitem(last=False)
        return found


async def _probe(model: str, tokenize: Tokenize) -> TemplateTraits | None:
    try:
        body = {"model": model, "messages": _PROBE_TURNS, "add_generation_prompt": False}
        merge = await _render(tokenize, body) is None
        effort = await _disabled_effort(model, tokenize)
    except TokenizeError:
        return None
    return TemplateTraits(merge_inline_system=merge, disabled_thinking_effort=effort)


async def _render(tokenize: Tokenize, body: dict[str, Any]) -> list[int] | None:
    """The tokens a worker renders for ``body``; None when it refuses (a failed render)."""
    try:
        return (await tokenize(body)).tolist()
    except TokenizeRefused:
        return None


async def _disabled_effort(model: str, tokenize: Tokenize) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}]}
    none = await _render(tokenize, {**body, "reasoning_effort": "none"})
    if none is None:
        return "low"
    for effort in EFFORTS:
        if await _render(tokenize, {**body, "reasoning_effort": effort}) == none:
            return "low"
    return "none"
