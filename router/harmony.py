"""A GPT-OSS chat's prompt tokens as vLLM renders them: the harmony format, not the template.

vLLM serves a model whose ``config.json`` says ``model_type: gpt_oss`` by rendering a chat
request with the harmony encoding (vLLM 0.32 ``OnlineRenderer._make_request_with_harmony`` over
``entrypoints/openai/parser/harmony_utils.py``), while its ``/tokenize`` applies the model's
chat template. The two part as soon as a chat has a system message (the template closes the
developer message with a blank line, harmony does not), and for a model whose template is not
GPT-OSS's at once; so the router renders such chats itself, with the library vLLM renders them
with (``oss-harmony``, whose vocabulary is built in), and this module mirrors vLLM's conversion
of the chat body into harmony messages:

* a leading system or developer message is the developer message's instructions, after the
  system message (model identity, reasoning effort, the date the worker renders on);
* ``tools`` (functions, as a chat completion takes them) are the developer message's tools;
* an assistant turn is its ``reasoning`` (analysis channel) and its content (final channel),
  or, with ``tool_calls``, its content and reasoning on the commentary and analysis channels
  and each call to ``functions.<name>`` as JSON; analysis before the last final answer goes;
* a ``tool`` message is the output of the function its ``tool_call_id`` names;
* a later system or developer message is another developer message.

The library renders a conversation message by message, each with one conversation-wide option
(whether a developer message declares function tools), so the ids of a message are cached
(``MESSAGE_CACHE_TOKENS``): the next turn of a long conversation renders only its new messages,
and the router's event loop is not held for the whole history on every turn.

What vLLM reads from its environment is configuration here (``model.harmony_start_date``:
``VLLM_SYSTEM_START_DATE``; ``model.harmony_system_instructions``:
``VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS``). A body vLLM would refuse raises
:class:`HarmonyError`, and the request is routed by load.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Generator
from typing import Any

import xxhash

from router.model_set import ModelSet

__all__ = ["HarmonyChats", "HarmonyError", "HarmonyRenderer", "available", "flatten_text"]

_EFFORTS = ("high", "medium", "low")
MESSAGE_CACHE_TOKENS = 1 << 21
"""Bound of the rendered-message cache, in tokens (4 bytes each: 8 MiB of ids), least recently
used first out. A message is charged at least ``MESSAGE_ENTRY_TOKENS``, so the entries' own
overhead (key, array, ordering: about 250 bytes) stays within as much again; a message longer
than a quarter of the bound is rendered every time, never cached."""
MESSAGE_ENTRY_TOKENS = 64
RENDER_SLICE_S = 0.002
"""Rendering :meth:`HarmonyRenderer.render_async` does between turns of the event loop (at
least one message: a single message is rendered in one call)."""


class HarmonyError(ValueError):
    """The chat is not one vLLM renders in harmony (it would answer 400)."""


def available() -> bool:
    """Whether the harmony library (``pip install 'kvrouter[harmony]'``) is installed."""
    try:
        import openai_harmony  # noqa: F401
    except ImportError:
        return False
    return True


def flatten_text(content: Any) -> str | None:
    """vLLM's ``flatten_input_text_content``: a string as it is, a list's text parts joined."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts = [
        item if isinstance(item, str) else item.get("text")
        for item in content
        if isinstance(item, (str, dict))
    ]
    kept = [t for t in texts if t is not None]
    if not all(isinstance(t, str) for t in kept):
        raise HarmonyError("message content: a text part's text must be a string")
    return "".join(kept) if kept else None


def _refused(exc: Exception) -> HarmonyError:
    """The library's refusal of a message, as the router reports it."""
    return HarmonyError(f"harmony render: {type(exc).__name__}: {exc}")


def _charge(ids: array) -> int:
    """What a cached message counts against ``MESSAGE_CACHE_TOKENS``."""
    return max(len(ids), MESSAGE_ENTRY_TOKENS)


def _declares_functions(content: Any) -> bool:
    """A developer message's content with function tools (what makes the library render every
    message of the conversation with ``conversation_has_function_tools``)."""
    tools = getattr(content, "tools", None)
    functions = tools.get("functions") if isinstance(tools, dict) else None
    return bool(functions is not None and functions.tools)


class HarmonyRenderer:
    """Renders chat bodies to the token ids vLLM prefills for a GPT-OSS model."""

    def __init__(
        self,
        start_date: str | None = None,
        system_instructions: bool = False,
        today: Callable[[], str] | None = None,
    ) -> None:
        try:
            import openai_harmony as h
        except ImportError:
            raise ImportError(
                "GPT-OSS chats need the harmony library: pip install 'kvrouter[harmony]' "
                "(or set model.chat_format: template and accept by-load routing of their chats)"
            ) from None
        self._h = h
        self._enc = h.load_harmony_encoding(h.HarmonyEncodingName.HARMONY_GPT_OSS)
        self._start_date = start_date
        self._system_instructions = system_instructions
        self._today = today or (lambda: datetime.datetime.now().strftime("%Y-%m-%d"))
        self.library_errors: tuple[type[Exception], ...] = (
            h.HarmonyError,
            ValueError,
            TypeError,
            AttributeError,
            RuntimeError,
        )
        """What the library raises for a message it does not take (its encoder's own refusals,
        a tool message with no name for one, come as RuntimeError)."""
        self._messages: OrderedDict[bytes, array] = OrderedDict()
        """Rendered messages by :meth:`_message_ids`' key; ``_cached_tokens`` is what they are
        charged against ``MESSAGE_CACHE_TOKENS``."""
        self._cached_tokens = 0
        self._suffix: list[int] = self._enc.render_conversation_for_completion(
            h.Conversation.from_messages([]), h.Role.ASSISTANT
        )
        special = self._special
        self._start, self._channel = special("<|start|>"), special("<|channel|>")
        self._constrain, self._message = special("<|constrain|>"), special("<|message|>")

    @property
    def library(self) -> Any:
        """The harmony library (``openai_harmony``), for building messages."""
        return self._h

    def _special(self, token: str) -> int:
        ids: list[int] = self._enc.encode(token, allowed_special="all")
        return ids[0]

    # ------------------------------------------------------------------ the request

    def start_date(self) -> str:
        """The date the system message carries now (part of the prompt, so of its cache key)."""
        return self._start_date or self._today()

    def render(self, body: dict[str, Any], start_date: str | None = None) -> list[int]:
        """The prompt ids of a chat completion body (``messages``, ``tools``,
        ``reasoning_effort``), its system message dated ``start_date`` (default:
        :meth:`start_date`). HarmonyError where vLLM refuses the body."""
        return _run(self._steps(self._chat_messages(body, start_date)))

    async def render_async(self, body: dict[str, Any], start_date: str | None = None) -> list[int]:
        """:meth:`render`, giving the event loop turns (:meth:`render_messages_async`)."""
        return await self.render_messages_async(self._chat_messages(body, start_date))

    async def render_messages_async(self, messages: list[Any]) -> list[int]:
        """The prompt ids of a conversation of harmony messages (vLLM's
        ``render_for_completion``), giving the event loop a turn between messages once
        ``RENDER_SLICE_S`` of rendering has passed: the library holds the GIL while it renders,
        so a conversation seen for the first time would otherwise hold the loop for its whole
        render."""
        steps = self._steps(messages)
        began = time.perf_counter()
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            if time.perf_counter() - began >= RENDER_SLICE_S:
                await asyncio.sleep(0)
                began = time.perf_counter()

    def render_messages(self, messages: list[Any]) -> list[int]:
        """:meth:`render_messages_async` in one call."""
        return _run(self._steps(messages))

    def _chat_messages(self, body: dict[str, Any], start_date: str | None = None) -> list[Any]:
        """A chat completion body as the harmony messages vLLM renders it in (its
        ``_make_request_with_harmony``). HarmonyError where vLLM refuses the body."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise HarmonyError("messages: a list of message objects")
        effort = body.get("reasoning_effort")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise HarmonyError("tools: a list")
        date = start_date or self.start_date()
        try:  # the library's message models validate what the body left unchecked
            instructions, rest = self._instructions(messages)
            out = self.preamble(instructions, self._chat_functions(tools), effort, date)
            return out + self._conversation(rest, date)
        except HarmonyError:
            raise
        except self.library_errors as exc:
            raise _refused(exc) from None

    def _steps(self, messages: list[Any]) -> Generator[None, None, list[int]]:
        """The rendering of ``messages``, one step per message; returns the ids."""
        h = self._h
        try:
            harmony_messages = self._drop_analysis(messages)
            declared = any(_declares_functions(c) for m in harmony_messages for c in m.content)
            options = h.RenderOptions(conversation_has_function_tools=declared)
        except self.library_errors as exc:
            raise _refused(exc) from None
        ids: list[int] = []
        for m in harmony_messages:
            try:
                ids.extend(self._message_ids(m, declared, options))
            except self.library_errors as exc:
                raise _refused(exc) from None
            yield
        ids.extend(self._suffix)
        return self._legacy_tool_call_headers(ids)

    def _message_ids(self, message: Any, tools: bool, options: Any) -> array:
        """One message's ids as the library renders it inside a conversation (``tools``: the
        conversation declares function tools), from the cache when rendered before."""
        key = xxhash.xxh3_128_digest(message.to_json().encode()) + bytes((tools,))
        got = self._messages.get(key)
        if got is not None:
            self._messages.move_to_end(key)
            return got
        ids = array("I", self._enc.render(message, options))
        if len(ids) <= MESSAGE_CACHE_TOKENS // 4:
            self._messages[key] = ids
            self._cached_tokens += _charge(ids)
            while self._cached_tokens > MESSAGE_CACHE_TOKENS:
                self._cached_tokens -= _charge(self._messages.popitem(last=False)[1])
        return ids

    @staticmethod
    def _instructions(messages: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
        """A leading system or developer message's text, and the messages after it."""
        if messages and messages[0].get("role") in ("system", "developer"):
            return flatten_text(messages[0].get("content")), messages[1:]
        return None, messages

    def preamble(
        self, instructions: str | None, functions: list[Any], effort: Any, date: str
    ) -> list[Any]:
        """The system message, and the developer message when there are instructions or
        function tools (vLLM's ``build_harmony_preamble``)."""
        if effort is not None and effort not in _EFFORTS:
            raise HarmonyError(f"harmony does not support reasoning_effort={effort!r}")
        to_system = self._system_instructions
        out = [self.system(instructions if to_system else None, effort, date)]
        developer = None if to_system else instructions
        if developer or functions:
            out.append(self.developer(developer, functions))
        return out

    def system(self, instructions: str | None, effort: str | None, date: str) -> Any:
        """vLLM's ``get_system_message``: instructions reach it only with
        ``model.harmony_system_instructions``."""
        h = self._h
        content = h.SystemContent.new()
        if instructions is not None:
            identity = content.model_identity
            content = content.with_model_identity(
                f"{identity}\n{instructions}" if identity else instructions
            )
        if effort is not None:
            content = content.with_reasoning_effort(h.ReasoningEffort[effort.upper()])
        content = content.with_conversation_start_date(date)
        return h.Message.from_role_and_content(h.Role.SYSTEM, content)

    def developer(self, instructions: str | None, functions: list[Any] | None = None) -> Any:
        """vLLM's ``get_developer_message``: ``functions`` are ``ToolDescription`` objects
        (:meth:`function`)."""
        h = self._h
        content = h.DeveloperContent.new()
        if instructions is not None and not self._system_instructions:
            content = content.with_instructions(instructions)
        if functions:
            content = content.with_function_tools(functions)
        return h.Message.from_role_and_content(h.Role.DEVELOPER, content)

    def system_or_developer(self, role: str, instructions: str, date: str) -> Any:
        """A later system or developer message (vLLM's ``get_system_or_developer_message``)."""
        if role == "system" and self._system_instructions:
            return self.system(instructions, None, date)
        return self.developer(instructions)

    def function(self, name: Any, description: Any, parameters: Any) -> Any:
        """One function tool as the developer message declares it."""
        if not isinstance(name, str):
            raise HarmonyError("tools: a function tool needs a name")
        if parameters is not None and not isinstance(parameters, dict):
            raise HarmonyError("tools: a function's parameters must be an object")
        if description is not None and not isinstance(description, str):
            raise HarmonyError("tools: a function's description must be a string")
        return self._h.ToolDescription.new(
            name=name, description=description or "", parameters=parameters
        )

    def function_call(self, name: Any, arguments: str) -> Any:
        """An assistant's call of a function: its JSON ``arguments`` to ``functions.<name>`` on
        the commentary channel."""
        h = self._h
        msg = h.Message.from_role_and_content(h.Role.ASSISTANT, arguments)
        msg = msg.with_channel("commentary").with_recipient(f"functions.{name}")
        return msg.with_content_type("json")

    def function_output(self, author: str, text: str) -> Any:
        """A function's output, from ``author`` (``functions.<name>``) back to the assistant on
        the commentary channel."""
        h = self._h
        msg = h.Message.from_author_and_content(h.Author.new(h.Role.TOOL, author), text)
        return msg.with_channel("commentary").with_recipient("assistant")

    def _chat_functions(self, tools: list[Any] | None) -> list[Any]:
        """A chat completion's ``tools`` as function tool descriptions."""
        functions = []
        for tool in tools or ():
            if not isinstance(tool, dict):
                raise HarmonyError("tools: each tool an object")
            kind = tool.get("type", "function")
            if kind != "function":  # a chat completion's tools are functions only
                raise HarmonyError(f"tool type {kind!r} is not supported")
            fn = tool.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise HarmonyError("tools: a function tool needs function.name")
            functions.append(self.function(fn["name"], fn.get("description"), fn.get("parameters")))
        return functions

    # ------------------------------------------------------------------ the turns

    def _conversation(self, messages: list[dict[str, Any]], date: str) -> list[Any]:
        """vLLM's ``parse_chat_inputs_to_harmony_messages``."""
        names: dict[Any, Any] = {}
        for m in messages:
            calls = m.get("tool_calls", [])
            if not isinstance(calls, list):
                raise HarmonyError("tool_calls: a list")
            for call in calls:
                if not isinstance(call, dict):
                    raise HarmonyError("tool_calls: each call an object")
                fn = call.get("function", {})
                names[call.get("id")] = fn.get("name") if isinstance(fn, dict) else None
        out: list[Any] = []
        for m in messages:
            out += self._turn(m, names, date)
        return out

    def _turn(self, m: dict[str, Any], names: dict[Any, Any], date: str) -> list[Any]:
        h = self._h
        Msg, Role = h.Message, h.Role
        role = m.get("role")
        calls = m.get("tool_calls", [])
        # vLLM's request model renames the deprecated field before rendering; only an
        # assistant's reasoning is rendered, any other role's is ignored.
        reasoning = m.get("reasoning")
        if reasoning is None:
            reasoning = m.get("reasoning_content")
        if role != "assistant":
            reasoning = None
        elif reasoning is not None and not isinstance(reasoning, str):
            raise HarmonyError("reasoning: a string")
        out = []
        if role == "assistant" and calls:
            content = flatten_text(m.get("content"))
            if content:
                out.append(
                    Msg.from_role_and_content(Role.ASSISTANT, content).with_channel("commentary")
                )
            if reasoning:
                out.append(
                    Msg.from_role_and_content(Role.ASSISTANT, reasoning).with_channel("analysis")
                )
            for call in calls:
                fn = call.get("function", {})
                fn = fn if isinstance(fn, dict) else {}
                args = fn.get("arguments", "") or ""
                if not isinstance(args, str):
                    raise HarmonyError("tool_calls: function.arguments must be a string")
                out.append(self.function_call(fn.get("name", ""), args))
            return out
        if role == "tool":
            name = names.get(m.get("tool_call_id", ""), "")
            return [self.function_output(f"functions.{name}", flatten_text(m.get("content")) or "")]
        if role == "assistant" and reasoning:
            out.append(
                Msg.from_role_and_content(Role.ASSISTANT, reasoning).with_channel("analysis")
            )
        content = m.get("content") or ""
        if isinstance(content, str):
            contents = [h.TextContent(text=content)]
        elif isinstance(content, list) and all(isinstance(c, dict) for c in content):
            contents = [h.TextContent(text=c.get("text", "")) for c in content]
        else:
            raise HarmonyError("message content: a string or a list of parts")
        if role == "assistant" and contents and contents[0].text:
            out.append(Msg.from_role_and_contents(role, contents).with_channel("final"))
        elif role in ("system", "developer"):
            instructions = flatten_text(m.get("content"))
            if instructions is not None:
                out.append(self.system_or_developer(role, instructions, date))
        elif role != "assistant":
            if not isinstance(role, str):
                raise HarmonyError("message role: a string")
            out.append(Msg.from_role_and_contents(role, contents))
        return out

    @staticmethod
    def _drop_analysis(messages: list[Any]) -> list[Any]:
        """Analysis (chain of thought) before the last final answer goes (vLLM's
        ``auto_drop_analysis_messages``)."""
        last = max(
            (
                i
                for i, m in enumerate(messages)
                if m.author.role == "assistant" and m.channel == "final"
            ),
            default=-1,
        )
        return [m for i, m in enumerate(messages) if not (i < last and m.channel == "analysis")]

    def _legacy_tool_call_headers(self, ids: list[int]) -> list[int]:
        """An earlier tool call's header in the layout GPT-OSS was trained on, as vLLM
        rewrites it: ``assistant to=R<|channel|>C T`` where oss-harmony renders
        ``assistant<|channel|>C to=R <|constrain|>T``."""
        enc, start, message = self._enc, self._start, self._message
        if self._constrain not in ids:
            return ids  # no typed tool call anywhere: the common chat, in one C-speed scan
        out = ids.copy()
        i = 0
        while True:
            try:
                i = out.index(start, i)
            except ValueError:
                return out
            try:
                end = out.index(message, i + 1)
                ch = out.index(self._channel, i + 1, end)
                co = out.index(self._constrain, ch + 1, end)
            except ValueError:
                i += 1
                continue
            author = enc.decode(out[i + 1 : ch])
            channel_to = enc.decode(out[ch + 1 : co])
            ctype = enc.decode(out[co + 1 : end])
            if author != "assistant" or " to=" not in channel_to or not channel_to.endswith(" "):
                i = end + 1
                continue
            channel, recipient = channel_to[:-1].split(" to=", 1)
            if not channel or not recipient or not ctype:
                i = end + 1
                continue
            header = [start, *enc.encode(f"assistant to={recipient}"), self._channel]
            header += [*enc.encode(f"{channel} {ctype}"), message]
            out[i : end + 1] = header
            i += len(header)


def _run(steps: Generator[None, None, list[int]]) -> list[int]:
    """A rendering's steps run to the end."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


class HarmonyChats(ModelSet):
    """Which models' chats the workers render in harmony, and the renderer for them.

    ``everywhere``: every model's (``model.chat_format: harmony``, or a local GPT-OSS model
    folder); else only the models the self-check found rendering harmony (:meth:`learn`). The
    renderer loads on first use: the vocabulary costs about 70 MB and half a second, which a
    fleet without GPT-OSS never pays."""

    def __init__(
        self,
        start_date: str | None = None,
        system_instructions: bool = False,
        *,
        everywhere: bool = False,
        today: Callable[[], str] | None = None,
    ) -> None:
        super().__init__(everywhere=everywhere)
        self._args = (start_date, system_instructions, today)
        self._renderer: HarmonyRenderer | None = None

    @property
    def renderer(self) -> HarmonyRenderer:
        if self._renderer is None:
            self._renderer = HarmonyRenderer(*self._args)
        return self._renderer
