"""A Responses API body as the chat vLLM renders for it (0.32 ``construct_input_messages`` and
``construct_tool_dicts``), in the form a worker's ``/tokenize`` takes, so that the router
tokenizes the prompt vLLM prefills.

What vLLM does, and the router with it:

* ``instructions`` is the leading system message; a string ``input`` is one user message.
* A message item (user, system, developer) goes to the template as it is; its text parts
  (``input_text``, ``output_text``) are text parts here, which ``/tokenize`` takes and vLLM's
  renderer reads the same way (joined by newlines where the template wants a string). Of its
  other keys the chat parser keeps a string ``name`` and ``task`` and a developer message's
  ``tools``, and so does the router; the rest (``id``, ``status``) it drops.
* An assistant message is its first part's text.
* ``function_call`` and ``custom_tool_call`` items are tool calls and ``reasoning`` items the
  turn's ``reasoning``, each joined to the assistant turn before it when that has none yet;
  their outputs are ``tool`` messages.
* ``tools``: function tools as chat functions, a namespace's functions as
  ``<namespace>__<name>``, a free-form custom tool as a function of one string ``input`` (its
  calls' input passed as that argument); tool types vLLM does not show the model (web search,
  file search, MCP, ...) are left out.

:func:`chat_request` answers None (the request is routed by load) where the prompt is not the
router's to know: images and files (the router matches text prompts only), items and tools
vLLM refuses (encrypted reasoning, item references, grammar custom tools, ...), and a request
naming a ``previous_response_id``, whose earlier turns live on the worker that answered them.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["CUSTOM_TOOL_PARAMETERS", "NAMESPACE_SEPARATOR", "chat_request"]

Message = dict[str, Any]

_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})

NAMESPACE_SEPARATOR = "__"
"""vLLM shows a namespaced function as ``<namespace>__<name>``."""

CUSTOM_TOOL_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "input": {"type": "string", "description": "The freeform text payload for this tool."}
    },
    "required": ["input"],
    "additionalProperties": False,
}
"""The one-string function vLLM shows a free-form ``custom`` tool as; a call's input is its
``input`` argument."""


class _Unreadable(Exception):
    """The body holds a prompt the router cannot reproduce, or one vLLM refuses."""


def chat_request(body: dict[str, Any]) -> tuple[list[Message], list[dict[str, Any]] | None] | None:
    """The chat ``messages`` and ``tools`` vLLM renders for a Responses request, or None."""
    try:
        if body.get("previous_response_id") is not None:
            raise _Unreadable
        out: list[Message] = []
        instructions = body.get("instructions")
        if instructions:
            if not isinstance(instructions, str):
                raise _Unreadable
            out.append({"role": "system", "content": instructions})
        items = body.get("input")
        if isinstance(items, str):
            out.append({"role": "user", "content": items})
        elif isinstance(items, list):
            for item in items:
                _add(item, out)
        else:
            raise _Unreadable
        if not out:
            raise _Unreadable
        return out, _tools(body.get("tools"))
    except _Unreadable:
        return None


def _add(item: Any, out: list[Message]) -> None:
    if not isinstance(item, dict):
        raise _Unreadable
    prev = out[-1] if out and out[-1].get("role") == "assistant" else None
    kind = item.get("type")
    if kind in ("function_call", "custom_tool_call"):
        call = _tool_call(item)
        if prev is None:
            out.append({"role": "assistant", "tool_calls": [call]})
        else:
            prev.setdefault("tool_calls", []).append(call)
    elif kind == "reasoning":
        if item.get("encrypted_content"):
            raise _Unreadable  # vLLM: "Encrypted content is not supported."
        text = _first_text(item.get("content"))
        if text is None:
            text = _first_text(item.get("summary")) or ""
        if prev is not None and prev.get("reasoning") is None:
            prev["reasoning"] = text
        else:
            out.append({"role": "assistant", "reasoning": text})
    elif kind in ("function_call_output", "custom_tool_call_output"):
        output = item.get("output")
        content = output if isinstance(output, str) else _parts(output)
        out.append({"role": "tool", "content": content, "tool_call_id": item.get("call_id")})
    elif kind in (None, "message") and item.get("role") == "assistant":
        text = _assistant_text(item.get("content"))
        if prev is not None and prev.get("content") is None:
            prev["content"] = text
        else:
            out.append({"role": "assistant", "content": text})
    elif kind in (None, "message") and item.get("role") in ("user", "system", "developer"):
        content = item.get("content")
        msg: Message = {
            "role": item["role"],
            "content": content if isinstance(content, str) else _parts(content),
        }
        for key in ("name", "task"):  # the chat parser keeps these when they are strings
            if isinstance(item.get(key), str):
                msg[key] = item[key]
        if item["role"] == "developer" and item.get("tools") is not None:
            msg["tools"] = item["tools"]  # the parser hands a developer message's tools on
        out.append(msg)
    else:
        raise _Unreadable  # item references, built-in tool calls, ...


def _tool_call(item: dict[str, Any]) -> dict[str, Any]:
    """A function call as vLLM shows it (a namespaced one under its flat name), or a custom
    tool's call as a call of its one-string function."""
    name, call_id = item.get("name"), item.get("call_id")
    if not isinstance(name, str) or not isinstance(call_id, str):
        raise _Unreadable
    if item["type"] == "custom_tool_call":
        payload = item.get("input") or ""
        if not isinstance(payload, str):
            raise _Unreadable
        args = json.dumps({"input": payload}, ensure_ascii=False)
    else:
        args = item.get("arguments")
        if not isinstance(args, str):
            raise _Unreadable
        namespace = item.get("namespace")
        if namespace:
            if not isinstance(namespace, str):
                raise _Unreadable
            name = namespace + NAMESPACE_SEPARATOR + name
    return {"id": call_id, "function": {"name": name, "arguments": args}, "type": "function"}


def _parts(content: Any) -> list[dict[str, str]]:
    """Text parts as ``/tokenize`` takes them; images and files are not the router's to key."""
    if not isinstance(content, list):
        raise _Unreadable
    out = []
    for part in content:
        if (
            not isinstance(part, dict)
            or not isinstance(part.get("type"), str)  # a list or object would not hash
            or part["type"] not in _TEXT_PARTS
            or not isinstance(part.get("text"), str)
        ):
            raise _Unreadable
        out.append({"type": "text", "text": part["text"]})
    return out


def _assistant_text(content: Any) -> str:
    """vLLM reads an assistant item as its first part's text."""
    if isinstance(content, str):
        return content
    text = _first_text(content)
    if text is None:
        raise _Unreadable
    return text


def _first_text(parts: Any) -> str | None:
    """The first part's text; None for no parts."""
    if parts is None:
        return None
    if not isinstance(parts, list):
        raise _Unreadable
    if not parts:
        return None
    first = parts[0]
    if not isinstance(first, dict) or not isinstance(first.get("text"), str):
        raise _Unreadable
    return first["text"]


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    """The functions vLLM shows the model, as ``/tokenize`` takes them (its function model
    dumps what vLLM's does): function tools as they are, a namespace's functions under their
    flat names, a free-form custom tool as its one-string function; every other tool type
    (web search, file search, MCP, ...) is never shown."""
    if not tools:
        return None
    if not isinstance(tools, list):
        raise _Unreadable
    out = []
    for t in tools:
        if not isinstance(t, dict):
            raise _Unreadable
        kind = t.get("type")
        if kind in ("function", "namespace", "custom") and not isinstance(t.get("name"), str):
            raise _Unreadable
        if kind == "function":
            out.append(_function(t))
        elif kind == "namespace":
            inner = t.get("tools")
            if not isinstance(inner, list):
                raise _Unreadable
            for f in inner:
                if isinstance(f, dict) and f.get("type") == "function":
                    if not isinstance(f.get("name"), str):
                        raise _Unreadable
                    flat = t["name"] + NAMESPACE_SEPARATOR + f["name"]
                    out.append(_function({**f, "name": flat}))
        elif kind == "custom":
            fmt = t.get("format")
            if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
                raise _Unreadable  # vLLM: grammar custom tools are not supported
            fn = {"name": t["name"], "parameters": CUSTOM_TOOL_PARAMETERS}
            if t.get("description") is not None:
                fn["description"] = t["description"]
            out.append({"type": "function", "function": fn})
    return out  # [] for built-in tools only: vLLM hands the template an empty list, not none


def _function(t: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
