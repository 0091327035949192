"""The rest of vLLM's API behind the gateway: bodies and streams forwarded byte for byte.

``/v1/completions`` and ``/v1/chat/completions`` are the proxy's own routes (router/app.py).
Every other path here goes to one worker serving the request's ``model``:

* by cache, when a prompt prefix can be read from the body as chat messages: the Responses API
  (router/responses_input.py: instructions, messages, function calls and their output,
  reasoning, tools) and Anthropic's ``/v1/messages`` (router/anthropic.py: system, turns, tool
  calls and results, tools), each as vLLM converts it; the router tokenizes those through a
  worker's chat template, as for a chat completion;
* by load otherwise (embeddings, scoring, reranking, pooling, tokenization, token counting,
  audio), and ``/debug/route`` says so.

Bodies are never rewritten (no token ids are substituted), so an answer is exactly what the
worker sent. Predictions are verified as a chat's are, from the cached tokens each API's usage
reports (router/messages.py: ``input_tokens_details`` of a Responses answer,
``cache_read_input_tokens`` of an Anthropic one).
"""

from __future__ import annotations

from typing import Any

import msgspec

from router import anthropic, responses_input
from router.anthropic import TemplateTraits
from router.harmony_responses import INPUT as HARMONY_INPUT

__all__ = ["BY_CACHE", "DEFAULT_TRAITS", "PATHS", "chat_prompt", "describe", "routing_body"]

DEFAULT_TRAITS = TemplateTraits()

BY_CACHE = frozenset({"/v1/responses", "/v1/messages"})
"""Paths whose body carries a prompt the router can read as chat messages."""

PATHS = frozenset(
    {
        *BY_CACHE,
        "/v1/messages/count_tokens",
        "/v1/embeddings",
        "/v1/score",
        "/score",
        "/v1/rerank",
        "/rerank",
        "/v2/rerank",
        "/pooling",
        "/classify",
        "/tokenize",
        "/detokenize",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
    }
)
"""POST paths the gateway forwards besides the two completion APIs."""

_json = msgspec.json.Decoder()


def parse(data: bytes, content_type: str) -> dict[str, Any] | None:
    """The body as a JSON object when it is one (multipart audio uploads are not)."""
    if "json" not in content_type and not data.lstrip().startswith(b"{"):
        return None
    try:
        doc = _json.decode(data)
    except msgspec.DecodeError:
        return None
    return doc if isinstance(doc, dict) else None


def chat_prompt(
    path: str, body: dict[str, Any], traits: TemplateTraits = DEFAULT_TRAITS
) -> dict[str, Any] | None:
    """The body's prompt as the chat fields vLLM renders (``messages``, and ``tools`` for an
    Anthropic request), or None when it has none the router can read. ``traits``: the
    model's chat template as vLLM probes it (router/template_probe.py), for Anthropic bodies
    whose prompt depends on it (:func:`router.anthropic.template_dependent`)."""
    if path == "/v1/responses":
        got = responses_input.chat_request(body)
    elif path == "/v1/messages":
        got = anthropic.chat_request(body, traits.merge_inline_system)
    else:
        return None
    if got is None:
        return None
    msgs, tools = got
    return {"messages": msgs} if tools is None else {"messages": msgs, "tools": tools}


def routing_body(
    body: dict[str, Any] | None,
    prompt: dict[str, Any] | None,
    traits: TemplateTraits = DEFAULT_TRAITS,
) -> dict:
    """What the router routes such a request by: its model and, when it has them, its prompt
    as chat fields with what changes their tokens (``cache_salt``, template arguments, the
    reasoning effort, and for a Responses request its continuation and truncation), or for a
    Responses request to a GPT-OSS model its input as router/harmony_responses.py reads it."""
    model = body.get("model") if body is not None else None
    routed: dict[str, Any] = {"model": model} if model is not None else {}
    if prompt is not None and body is not None:
        routed |= prompt
        for k in ("cache_salt", "chat_template_kwargs"):
            if k in body:
                routed[k] = body[k]
        if HARMONY_INPUT in prompt:
            routed |= _responses_truncation(body)
        elif "input" in body:
            routed |= _responses_rendering(body)
        elif "messages" in body:
            routed |= _anthropic_rendering(body, traits)
    return routed


def _anthropic_rendering(body: dict[str, Any], traits: TemplateTraits) -> dict[str, Any]:
    """An Anthropic request's reasoning as vLLM hands it to the template (0.32
    ``AnthropicServingMessages``): ``output_config.effort`` is ``reasoning_effort``, and
    ``thinking: {"type": "disabled"}`` overrides it with the template's disabled effort;
    ``tool_choice: {"type": "none"}`` is the chat's ``"none"`` (its tools then reach no
    template on a worker excluding them)."""
    out: dict[str, Any] = {}
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "none":
        out["tool_choice"] = "none"
    effort = None
    output = body.get("output_config")
    if isinstance(output, dict) and output.get("effort") is not None:
        effort = output["effort"]
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        effort = traits.disabled_thinking_effort
    if effort is not None:
        out["reasoning_effort"] = effort
    return out


def _responses_rendering(body: dict[str, Any]) -> dict[str, Any]:
    """How vLLM renders a Responses request beyond its messages (0.32
    ``ResponsesRequest.build_chat_params``), as chat fields the router tokenizes by:
    ``reasoning.effort`` is the template's ``reasoning_effort``; ``tool_choice: "none"`` as a
    chat's (router/tokenize.py ``drops_tools``); a last input item still in
    progress is continued, not answered; ``truncation: auto`` is ``truncate_prompt_tokens: -1``
    (router/truncation.py: cut only past the model's context)."""
    out: dict[str, Any] = {}
    if body.get("tool_choice") == "none":
        out["tool_choice"] = "none"
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        out["reasoning_effort"] = reasoning["effort"]
    items = body.get("input")
    last = items[-1] if isinstance(items, list) and items else None
    if isinstance(last, dict) and last.get("status") in ("in_progress", "incomplete"):
        out |= {"continue_final_message": True, "add_generation_prompt": False}
    return out | _responses_truncation(body)


def _responses_truncation(body: dict[str, Any]) -> dict[str, Any]:
    """``truncation: auto`` as ``truncate_prompt_tokens: -1`` (vLLM's ``build_tok_params``:
    cut only past the model's context), whichever way the request is rendered."""
    if body.get("truncation", "disabled") not in (None, "disabled"):
        return {"truncate_prompt_tokens": -1}
    return {}


def describe(path: str, prompt: dict[str, Any] | None) -> str:
    """What ``/debug/route`` says of how a request on ``path`` is routed."""
    if prompt is not None and HARMONY_INPUT in prompt:
        return f"by cache: the {path} prompt rendered in harmony from its input items"
    if prompt is not None:
        tools = f" and {len(prompt['tools'])} tools" if prompt.get("tools") else ""
        return f"by cache: the {path} prompt read as {len(prompt['messages'])} chat messages{tools}"
    if path in BY_CACHE:
        return f"by load: no prompt the router can read in this {path} body"
    return f"by load: {path} carries no prompt prefix to match"
