"""An Anthropic ``/v1/messages`` body as the chat request vLLM renders for it (0.32
``AnthropicServingMessages.to_chat_completion_request``), so that the router tokenizes, through
a worker's ``/tokenize``, the prompt vLLM prefills.

What vLLM does, and the router with it:

* ``system`` (a string, or text blocks joined without a separator) is the leading system
  message. A text block starting ``x-anthropic-billing-header`` is dropped: Claude Code puts a
  per-request hash there, which would make every prompt differ from its first tokens on.
* A ``system`` message inside ``messages`` (Claude Code's reminders) stays where it is, or,
  for a chat template that wants the system message first, is appended to the leading one.
  vLLM decides that per template by rendering a probe; the router asks a worker the same
  question (router/template_probe.py) and passes the answer in as ``merge_inline_system``.
* Content blocks: non-empty text blocks are the content (one alone is the content string);
  thinking is the message's ``reasoning``; redacted thinking is dropped; ``tool_use`` is a tool
  call whose arguments are ``json.dumps(input)`` (Python's separators, ASCII escapes); a user's
  ``tool_result`` is a ``tool`` message placed before the rest of that user turn (its text
  parts joined by newlines), an assistant's is a ``Tool result: ...`` text part. A user turn
  left without content is dropped; an assistant turn is kept even when empty.
* ``tools`` are functions (``input_schema`` the parameters, given ``type: object`` when it has
  no type), as the ``tool_addition`` / ``tool_removal`` blocks of system messages leave them.

:func:`chat_request` answers None (the request is routed by load) where the prompt is not the
router's to know: an image (the router matches no multimodal prompt), a ``tool_use`` without
an id (vLLM makes one from the clock), or a body vLLM refuses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["BILLING_HEADER", "TemplateTraits", "chat_request", "template_dependent"]

BILLING_HEADER = "x-anthropic-billing-header"
_BLOCKS = frozenset(
    {
        "text",
        "image",
        "tool_use",
        "tool_result",
        "tool_reference",
        "thinking",
        "redacted_thinking",
        "tool_addition",
        "tool_removal",
    }
)
_TOOL_CHANGES = ("tool_addition", "tool_removal")

Message = dict[str, Any]


@dataclass(frozen=True)
class TemplateTraits:
    """What vLLM learns of a model's chat template by rendering probes, for Anthropic requests:
    whether inline system messages join the leading one, and the reasoning effort
    ``thinking: {"type": "disabled"}`` becomes (``"none"``, or ``"low"`` where the template
    refuses or ignores ``"none"``)."""

    merge_inline_system: bool = False
    disabled_thinking_effort: str = "none"


class _Unreadable(Exception):
    """The body holds a prompt the router cannot reproduce, or one vLLM refuses."""


def template_dependent(body: dict[str, Any]) -> bool:
    """Whether the prompt vLLM renders for the body depends on :class:`TemplateTraits`: it has
    an inline system message, or disables thinking."""
    msgs = body.get("messages")
    thinking = body.get("thinking")
    return (isinstance(thinking, dict) and thinking.get("type") == "disabled") or (
        isinstance(msgs, list)
        and any(isinstance(m, dict) and m.get("role") == "system" for m in msgs)
    )


def chat_request(
    body: dict[str, Any], merge_inline_system: bool
) -> tuple[list[Message], list[dict[str, Any]] | None] | None:
    """The chat ``messages`` and ``tools`` vLLM renders for an Anthropic request, or None."""
    try:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise _Unreadable
        for m in msgs:
            _check(m)
        parts = _system_parts(body.get("system"))
        if merge_inline_system:
            parts += [t for m in msgs if m["role"] == "system" and (t := _system_text(m))]
        out: list[Message] = []
        if parts:
            out.append({"role": "system", "content": "".join(parts)})
        for m in msgs:
            _convert(m, out, merge_inline_system)
        return out, _tools(body.get("tools"), msgs)
    except _Unreadable:
        return None


# ------------------------------------------------------------------ shape checks


def _check(m: Any) -> None:
    """What vLLM's request model accepts of a message, as far as the prompt depends on it."""
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
        raise _Unreadable
    content = m.get("content")
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise _Unreadable
    for b in content:
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise _Unreadable  # a list or object type would not even hash
        if b["type"] not in _BLOCKS:
            raise _Unreadable
        if b["type"] in _TOOL_CHANGES and m["role"] != "system":
            raise _Unreadable  # vLLM: only allowed in messages with role "system"
        for k in ("text", "thinking", "id", "tool_use_id", "name"):
            if b.get(k) is not None and not isinstance(b[k], str):
                raise _Unreadable


def _str_or_none(v: Any) -> str | None:
    if v is not None and not isinstance(v, str):
        raise _Unreadable
    return v


# ------------------------------------------------------------------ system


def _system_parts(system: Any) -> list[str]:
    if not system:
        return []
    if isinstance(system, str):
        return [system]
    if not isinstance(system, list):
        raise _Unreadable
    out = []
    for b in system:
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise _Unreadable
        if b["type"] not in _BLOCKS:
            raise _Unreadable
        text = _str_or_none(b.get("text"))
        if b["type"] == "text" and text and not text.startswith(BILLING_HEADER):
            out.append(text)
    return out


def _system_text(m: Message) -> str | None:
    content = m["content"]
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    texts = [
        b["text"]
        for b in content
        if b["type"] == "text" and b.get("text") and not b["text"].startswith(BILLING_HEADER)
    ]
    return "".join(texts) if texts else None


# ------------------------------------------------------------------ turns


def _convert(m: Message, out: list[Message], merged: bool) -> None:
    role, content = m["role"], m["content"]
    if role == "system":
        text = None if merged else _system_text(m)
        if text:
            out.append({"role": "system", "content": text})
        return
    msg: Message = {"role": role}
    if isinstance(content, str):
        msg["content"] = content
    else:
        parts: list[dict[str, str]] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for b in content:
            kind = b["type"]
            if kind == "text" and b.get("text"):
                parts.append({"type": "text", "text": b["text"]})
            elif kind == "image" and b.get("source"):
                raise _Unreadable  # multimodal: the router matches text prompts only
            elif kind == "thinking" and b.get("thinking") is not None:
                reasoning.append(b["thinking"])
            elif kind == "tool_use":
                calls.append(_tool_call(b))
            elif kind == "tool_result" and role == "user":
                out.extend(_tool_messages(b))
            elif kind == "tool_result":
                c = _result_content(b.get("content"))
                parts.append({"type": "text", "text": f"Tool result: {str(c) if c else ''}"})
        if reasoning:
            msg["reasoning"] = "".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        if len(parts) == 1:
            msg["content"] = parts[0]["text"]
        elif parts:
            msg["content"] = parts
    if role != "user" or "content" in msg:
        out.append(msg)


def _tool_call(b: dict[str, Any]) -> dict[str, Any]:
    if not b.get("id"):
        raise _Unreadable  # vLLM names it call_<unix time>: not the router's to know
    args = b.get("input")
    if args is not None and not isinstance(args, dict):
        raise _Unreadable
    return {
        "id": b["id"],
        "type": "function",
        "function": {"name": b.get("name") or "", "arguments": json.dumps(args or {})},
    }


def _result_content(c: Any) -> str | list[dict[str, Any]] | None:
    if c is None or isinstance(c, str):
        return c
    if not isinstance(c, list) or not all(isinstance(x, dict) for x in c):
        raise _Unreadable
    return c


def _tool_messages(b: dict[str, Any]) -> list[Message]:
    """A user's ``tool_result``: the ``tool`` message with its text, then one naming the tools
    it references."""
    c = _result_content(b.get("content"))
    call_id = b.get("tool_use_id") or ""
    text = c if isinstance(c, str) else ""
    refs = []
    if isinstance(c, list):
        texts = []
        for item in c:
            kind = item.get("type")
            if kind == "text":
                t = item.get("text", "")
                if not isinstance(t, str):
                    raise _Unreadable
                texts.append(t)
            elif kind == "image" and _image_url(item.get("source", {})):
                raise _Unreadable
            elif kind == "tool_reference":
                name = item.get("tool_name") or item.get("name")
                if name:
                    refs.append({"type": "tool_reference", "name": name})
        text = "\n".join(texts)
    out: list[Message] = [{"role": "tool", "tool_call_id": call_id, "content": text or ""}]
    if refs:
        out.append({"role": "tool", "tool_call_id": call_id, "content": refs})
    return out


def _image_url(source: Any) -> str:
    """Whether vLLM makes an image of a tool result's item: a URL source with its URL, or any
    other source (read as base64 data)."""
    if not isinstance(source, dict):
        raise _Unreadable
    return source.get("url", "") if source.get("type") == "url" else "data:"


# ------------------------------------------------------------------ tools


def _tools(tools: Any, msgs: list[Message]) -> list[dict[str, Any]] | None:
    if tools is not None:
        if not isinstance(tools, list):
            raise _Unreadable
        for t in tools:
            _check_tool(t)
    changes = [
        b
        for m in msgs
        if isinstance(m["content"], list)
        for b in m["content"]
        if b["type"] in _TOOL_CHANGES
    ]
    if changes:
        named = {t["name"]: t for t in tools or []}
        removed: set[str] = set()
        for b in changes:
            change = b.get("tool")
            if not isinstance(change, dict):
                raise _Unreadable
            if change.get("type") == "tool_definition" and b["type"] == "tool_addition":
                tool = change.get("definition")
                _check_tool(tool)
                name = tool["name"]
                named[name] = tool
            elif change.get("type") == "tool_reference" and isinstance(change.get("name"), str):
                name = change["name"]
                if name not in named:
                    raise _Unreadable  # vLLM: not declared in tools
                if b["type"] == "tool_addition":
                    named[name] = {**named[name], "defer_loading": None}
            else:
                raise _Unreadable
            if b["type"] == "tool_removal":
                removed.add(name)
            else:
                removed.discard(name)
        tools = [t for name, t in named.items() if name not in removed]
    return None if tools is None else [_function(t) for t in tools]


def _check_tool(t: Any) -> None:
    if (
        not isinstance(t, dict)
        or not isinstance(t.get("name"), str)
        or not isinstance(t.get("input_schema"), dict)
    ):
        raise _Unreadable
    _str_or_none(t.get("description"))
    for k in ("strict", "defer_loading"):
        if t.get(k) is not None and not isinstance(t[k], bool):
            raise _Unreadable


def _function(t: dict[str, Any]) -> dict[str, Any]:
    """A tool as the function vLLM hands the template; ``strict`` and ``defer_loading`` only
    when set (vLLM's function model drops them when unset)."""
    schema = t["input_schema"]
    if "type" not in schema:
        schema = {**schema, "type": "object"}
    fn: dict[str, Any] = {
        "name": t["name"],
        "description": t.get("description"),
        "parameters": schema,
    }
    for k in ("strict", "defer_loading"):
        if t.get(k) is not None:
            fn[k] = t[k]
    return {"type": "function", "function": fn}
