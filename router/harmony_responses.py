"""A Responses API request to a GPT-OSS model as the harmony messages vLLM renders it in.

vLLM renders such a request from its items (0.32 ``OnlineRenderer.
_render_responses_with_harmony`` and ``responses/harmony.py`` ``response_input_to_harmony``),
not through the chat a template model's request becomes (router/responses_input.py). Where it
parts from a chat completion's harmony rendering (router/harmony.py):

* the developer message's instructions are ``instructions``, else a leading system or developer
  item's text;
* ``tools`` reach the developer message only when one of them is not built in; then every tool
  must be a function (others are refused); ``tool_choice`` never takes them away;
* an assistant message is a final-channel message even when empty, each part its own text (a
  part without text, an image say, is empty text); its ``status`` is ignored;
* a reasoning item is its content's texts joined by newlines on the analysis channel (a summary
  alone renders nothing);
* a function call's output is the output of the function the last earlier call with its
  ``call_id`` named; no such call, or an output that is not a string: refused;
* other item types (custom tool calls, item references, ...) are refused.

Earlier turns the client sends as ``previous_input_messages`` (vLLM's extension: chat or
harmony messages) come after the preamble, their system and developer messages left out; a
chat assistant message there has no channel, its tool calls no text.

:func:`prompt` answers None, and the request is routed by load, where the prompt is not the
router's to know: ``previous_response_id`` (earlier turns held by the worker that answered
them), and built-in tools (web search, code interpreter, container, and MCP servers allowed to
stand for them), whose descriptions come from the worker's tool server.
"""

from __future__ import annotations

from typing import Any

from router.harmony import HarmonyError, HarmonyRenderer, flatten_text

__all__ = ["FIELDS", "HISTORY", "INPUT", "messages", "prompt"]

INPUT = "responses_input"
"""The routing body's key for a harmony Responses prompt (with ``instructions``, ``tools``,
``reasoning_effort`` and :data:`HISTORY`), in place of a chat's ``messages``."""
HISTORY = "previous_input_messages"
"""Earlier turns the client sends itself, as chat messages or as harmony messages (a vLLM
extension of the Responses API)."""

FIELDS = (INPUT, "instructions", "tools", "reasoning_effort", HISTORY)
"""Every field of a :func:`prompt`: what its rendering depends on besides the date."""

_BUILT_IN = frozenset({"code_interpreter", "web_search_preview", "container"})
"""vLLM's ``BUILTIN_TOOL_TO_MCP_SERVER_LABEL`` values: tool types, and MCP server labels that
stand for them, described by the worker's tool server."""


def prompt(body: dict[str, Any]) -> dict[str, Any] | None:
    """What a harmony Responses request's prompt depends on, or None to route it by load."""
    if body.get("previous_response_id") is not None:
        return None
    history = body.get("previous_input_messages")
    if history and not isinstance(history, list):
        return None
    items = body.get("input")
    if not isinstance(items, (str, list)):
        return None
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        return None
    for tool in tools or ():
        if not isinstance(tool, dict):
            return None
        kind, label = tool.get("type"), tool.get("server_label")
        if not isinstance(kind, str):
            return None  # vLLM's request model refuses it
        if kind in _BUILT_IN or (kind == "mcp" and isinstance(label, str) and label in _BUILT_IN):
            return None
    out: dict[str, Any] = {INPUT: items}
    if history:
        out[HISTORY] = history
    if body.get("instructions") is not None:
        out["instructions"] = body["instructions"]
    if tools:
        out["tools"] = tools
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        out["reasoning_effort"] = reasoning["effort"]
    return out


def messages(renderer: HarmonyRenderer, payload: dict[str, Any], date: str) -> list[Any]:
    """The harmony messages of a :func:`prompt`, the system message dated ``date``.
    HarmonyError where vLLM refuses the request."""
    try:
        return _messages(renderer, payload, date)
    except HarmonyError:
        raise
    except (*renderer.library_errors, KeyError) as exc:
        raise HarmonyError(f"harmony render: {type(exc).__name__}: {exc}") from None


def _messages(renderer: HarmonyRenderer, payload: dict[str, Any], date: str) -> list[Any]:
    items = payload[INPUT]
    instructions = payload.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise HarmonyError("instructions: a string")
    if instructions is None and isinstance(items, list) and items:
        first = items[0]
        if isinstance(first, dict) and first.get("role") in ("system", "developer"):
            instructions, items = flatten_text(first.get("content")), items[1:]
    out = renderer.preamble(
        instructions,
        _functions(renderer, payload.get("tools")),
        payload.get("reasoning_effort"),
        date,
    )
    history = payload.get(HISTORY)
    if history:
        out += _history(renderer, history)
    if isinstance(items, str):
        return [*out, _message(renderer.library, "user", items)] if items or not history else out
    calls: list[dict[str, Any]] = []
    for item in items:
        if not isinstance(item, dict):
            raise HarmonyError("input: each item an object")
        got = _item(renderer, item, calls, date)
        if got is not None:
            out.append(got)
        if item.get("type") == "function_call":
            calls.append(item)
    return out


def _functions(renderer: HarmonyRenderer, tools: list[Any] | None) -> list[Any]:
    """The function tools the developer message declares: none unless some tool is not built
    in (an MCP tool counts as built in here; vLLM looks past it unless its label is allowed to
    stand for a built-in tool, which :func:`prompt` routes by load)."""
    tools = tools or []
    kinds = {t.get("type") for t in tools if t.get("type") != "mcp"}
    if kinds <= _BUILT_IN:
        return []
    functions = []
    for tool in tools:
        kind = tool.get("type")
        if kind in _BUILT_IN:
            continue
        if kind != "function":
            raise HarmonyError(f"tool type {kind!r} is not supported")
        functions.append(
            renderer.function(tool.get("name"), tool.get("description"), tool.get("parameters"))
        )
    return functions


def _item(
    renderer: HarmonyRenderer, item: dict[str, Any], calls: list[dict[str, Any]], date: str
) -> Any:
    """One input item as a harmony message, or None where vLLM renders nothing for it."""
    h = renderer.library
    kind = item.get("type", "message")
    if kind == "message":
        role, content = item.get("role"), item.get("content")
        if role not in ("user", "assistant", "system", "developer"):
            raise HarmonyError(f"input: a message's role cannot be {role!r}")
        if role in ("system", "developer"):
            text = flatten_text(content)
            return renderer.system_or_developer(role, text, date) if text else None
        msg = _message(h, role, content)
        return msg.with_channel("final") if role == "assistant" else msg
    if kind == "function_call_output":
        call_id = item.get("call_id")
        call = next((c for c in reversed(calls) if c.get("call_id") == call_id), None)
        if call is None:
            raise HarmonyError(f"No call message found for {call_id}")
        output = item.get("output")
        if not isinstance(output, str):
            raise HarmonyError("input: a function call's output must be a string")
        return renderer.function_output(f"functions.{_string(call.get('name'))}", output)
    if kind == "reasoning":
        content = item.get("content")
        if not content:
            return None
        if not isinstance(content, list):
            raise HarmonyError("input: a reasoning item's content must be a list")
        text = "\n".join(_string(part["text"]) for part in content)
        return h.Message.from_role_and_content(h.Role.ASSISTANT, text).with_channel("analysis")
    if kind == "function_call":
        return renderer.function_call(_string(item.get("name")), _string(item.get("arguments")))
    raise HarmonyError(f"Unknown input type: {kind}")


def _history(renderer: HarmonyRenderer, history: list[Any]) -> list[Any]:
    """vLLM's ``construct_harmony_previous_input_messages``: each earlier message in harmony's
    form (``author``, ``content``, ``channel``, ``recipient``, ``content_type``) or a chat's,
    system and developer messages left out (the request's own instructions stand)."""
    h = renderer.library
    out = []
    for m in history:
        if not isinstance(m, dict):
            raise HarmonyError("previous_input_messages: each message an object")
        got = _harmony_form(h, m) if isinstance(m.get("author"), dict) else _chat_form(renderer, m)
        out += [x for x in got if x.author.role not in (h.Role.SYSTEM, h.Role.DEVELOPER)]
    return out


def _harmony_form(h: Any, m: dict[str, Any]) -> list[Any]:
    """vLLM's ``_parse_harmony_format_message``."""
    author = m["author"]
    raw = m.get("content", "")
    if isinstance(raw, list):
        contents = _texts(h, raw)
    else:
        contents = [h.TextContent(text=raw if isinstance(raw, str) else "")]
    role, name = h.Role(author.get("role")), author.get("name")
    if name:
        msg = h.Message(author=h.Author.new(role, name), content=contents)
    else:
        msg = h.Message.from_role_and_contents(role, contents)
    if m.get("channel"):
        msg = msg.with_channel(m["channel"])
    if m.get("recipient"):
        msg = msg.with_recipient(m["recipient"])
    if m.get("content_type"):
        msg = msg.with_content_type(m["content_type"])
    return [msg]


def _chat_form(renderer: HarmonyRenderer, m: dict[str, Any]) -> list[Any]:
    """vLLM's ``_parse_chat_format_message``: an assistant's tool calls (its text dropped), a
    tool's output under its ``name``, a user's or assistant's text with no channel."""
    role = m.get("role")
    if role is None:
        raise HarmonyError("previous_input_messages: a message has no role")
    calls = m.get("tool_calls")
    if role == "assistant" and calls:
        out = []
        for call in calls:
            fn = call.get("function", {})
            args = _string(fn.get("arguments", "") or "")
            out.append(renderer.function_call(fn.get("name", ""), args))
        return out
    if role == "tool":
        name = m.get("name", "")
        if name and not name.startswith("functions."):
            name = f"functions.{name}"
        return [renderer.function_output(name, flatten_text(m.get("content")) or "")]
    if role in ("system", "developer"):
        return []
    return [_message(renderer.library, role, m.get("content", ""))]


def _message(h: Any, role: str, content: Any) -> Any:
    """A user or assistant message: a string as one text, a list's parts each one."""
    if isinstance(content, str):
        return h.Message.from_role_and_content(role, content)
    if not isinstance(content, list) or not all(isinstance(c, dict) for c in content):
        raise HarmonyError("input: a message's content must be a string or a list of parts")
    return h.Message.from_role_and_contents(role, _texts(h, content))


def _texts(h: Any, parts: list[Any]) -> list[Any]:
    """Each part its own text; a part with no text (an image, a file) an empty one."""
    return [h.TextContent(text=_string(c.get("text", ""))) for c in parts]


def _string(value: Any) -> str:
    if not isinstance(value, str):
        raise HarmonyError(f"input: expected a string, got {type(value).__name__}")
    return value
