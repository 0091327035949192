"""A Responses API body as the chat vLLM renders for it (0.32 ``construct_input_messages`` and
``construct_tool_dicts``), in the form a worker's ``/tokenize`` takes, so that the router
tokenizes the prompt vLLM prefills.

What vLLM does, and the router with it:

* ``instructions`` is the leading system message; a string ``input`` is one user message.
* A message item (user, system, developer) goes to the template as it is; its text parts
  (``input_text``, ``output_text``) are text parts here, which ``/tokenize`` takes and vLLM's
  renderer reads the same way (joined by newlines where the template wants a string).
* An assistant message is its first part's text.
* ``function_call`` items are tool calls and ``reasoning`` items the turn's ``reasoning``, both
  joined to the assistant turn before them when it has none yet; ``function_call_output``
  items are ``tool`` messages.
* ``tools``: function tools as chat functions; tool types vLLM does not show the model (web
  search, file search, ...) are left out.

:func:`chat_request` answers None (the request is routed by load) where the prompt is not the
router's to know: images and files (the router matches text prompts only), namespaced and
custom tools (vLLM rewrites their names and arguments), and items vLLM refuses (encrypted
reasoning, item references, ...), and a request naming a ``previous_response_id``, whose
earlier turns live on the worker that answered them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["chat_request"]

Message = dict[str, Any]

_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_REWRITTEN_TOOLS = frozenset({"namespace", "custom"})
"""Tool types vLLM shows the model under names or arguments it rewrites (``ns__name``, a
one-string shim): routed by load. Function tools are shown as they are; every other type
(web search, file search, MCP, ...) is never shown."""


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
    if kind == "function_call":
        if item.get("namespace") or not all(
            isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")
        ):
            raise _Unreadable
        call = {
            "id": item["call_id"],
            "function": {"name": item["name"], "arguments": item["arguments"]},
            "type": "function",
        }
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
    elif kind == "function_call_output":
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
        if isinstance(item.get("name"), str):
            msg["name"] = item["name"]
        out.append(msg)
    else:
        raise _Unreadable  # custom tool calls, item references, built-in tool calls, ...


def _parts(content: Any) -> list[dict[str, str]]:
    """Text parts as ``/tokenize`` takes them; images and files are not the router's to key."""
    if not isinstance(content, list):
        raise _Unreadable
    out = []
    for part in content:
        if (
            not isinstance(part, dict)
            or part.get("type") not in _TEXT_PARTS
            or not isinstance(part.get("text"), str)
        ):
            raise _Unreadable
        out.append({"type": "text", "text": part["text"]})
    return out


def _assistant_text(content: Any) -> str:
    """vLLM reads an assistant item as its first part's text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content or not isinstance(content[0], dict):
        raise _Unreadable
    text = content[0].get("text")
    if not isinstance(text, str):
        raise _Unreadable
    return text


def _first_text(parts: Any) -> str | None:
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
    """Function tools as ``/tokenize`` takes them (its function model dumps what vLLM's does)."""
    if not tools:
        return None
    if not isinstance(tools, list):
        raise _Unreadable
    out = []
    for t in tools:
        if not isinstance(t, dict):
            raise _Unreadable
        if t.get("type") in _REWRITTEN_TOOLS:
            raise _Unreadable
        if t.get("type") != "function":
            continue
        if not isinstance(t.get("name"), str):
            raise _Unreadable
        fn = {k: v for k, v in t.items() if k != "type"}
        out.append({"type": "function", "function": fn})
    return out or None
