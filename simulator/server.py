"""One simulated vLLM worker: 1..dp_size engines behind the HTTP app of ``simulator.routes``.

A ``Worker`` owns the engines (one ``EngineRunner`` each, with its event publisher), parses
requests as vLLM does and answers completions in vLLM's formats (``simulator.responses``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Annotated, Any

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from simulator.api_errors import ApiError
from simulator.engine import EngineConfig, QueueFull, SimEngine
from simulator.faults import Faults
from simulator.harmony_chat import HarmonyChat, HarmonyChatError
from simulator.hf_tokenizer import HFTokenizer
from simulator.lora import LoraAdapters, LoraSettings
from simulator.publisher import ZmqPublisher, offset_endpoint_port
from simulator.responses import SSE_DONE, ChunkWriter, completion_body, usage
from simulator.routes import make_app
from simulator.runner import EngineRunner, TokenOut
from simulator.tokenizer import ChatTemplateError, Tokenizer

_json_decode = msgspec.json.Decoder().decode


@functools.lru_cache(maxsize=8)
def _token_ids_type(vocab: int) -> Any:
    return list[Annotated[int, msgspec.Meta(ge=0, lt=vocab)]]


@dataclass
class WorkerSettings:
    engine: EngineConfig
    dp_size: int = 1
    events_endpoint: str | None = "tcp://*:5557"  # None: --no-events
    replay_endpoint: str | None = "tcp://*:5558"
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    event_encoding: str = "map"
    legacy_replay: bool = False
    chat_template: str = "default"
    chat_format: str = "template"
    """``harmony``: chat completions rendered as vLLM renders a gpt_oss model's (simulator/
    harmony_chat.py); ``/tokenize`` keeps the template, as in vLLM."""
    max_body_bytes: int = 8 * 1024 * 1024
    request_timeout_s: float = 600.0
    default_max_tokens: int = 16  # output length when a request sets no max_tokens
    loras: tuple[str, ...] = ()
    lora: LoraSettings = field(default_factory=LoraSettings)
    """Adapters by path, max_loras, runtime loading; ``loras`` are added with /sim/lora paths."""
    tokenizer_path: str | None = None  # a model dir with tokenizer.json: tokenize as vLLM would
    prompt_tokens_details: bool = True  # vLLM's --enable-prompt-tokens-details
    exclude_tools_when_tool_choice_none: bool = False
    """vLLM's flag of that name: a chat completion with ``tool_choice: "none"`` reaches the
    template without its tools (``/tokenize`` takes no ``tool_choice`` and keeps them)."""
    tokenizer_mode: str = "auto"
    """``mistral``: tool-call ids as under vLLM's ``--tokenizer-mode mistral``: a chat
    completion cuts each to its last 9 characters, then every render (``/tokenize`` too)
    refuses one that is not 9 letters or digits, as mistral-common does."""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Generation:
    """One completion request, validated: what the engine runs and how the answer is shaped."""

    rid: str
    model: str
    chat: bool
    prompts: list[list[int]]
    """The prompt's tokens; several for a completion given a list of prompts."""
    max_tokens: int
    lora: str | None
    salt: str | None
    session: str | None
    report_full: bool
    priority: int
    stream: bool
    include_usage: bool
    finish: str  # finish_reason once max_tokens is reached
    n: int = 1
    """Choices (parallel sampling): vLLM runs one child request per choice, ``{i}_{rid}``."""

    @property
    def children(self) -> list[tuple[str, list[int]]]:
        """The engine requests: ``n`` per prompt, prompt by prompt (the choices' order)."""
        out = []
        for k, ids in enumerate(self.prompts):
            rid = self.rid if len(self.prompts) == 1 else f"{self.rid}-{k}"
            out += [(rid, ids)] if self.n == 1 else [(f"{i}_{rid}", ids) for i in range(self.n)]
        return out


MAX_N = 16384
"""vLLM's ``VLLM_MAX_N_SEQUENCES`` default: the largest ``n``."""


def dumped_tools(tools: Any) -> list[dict[str, Any]]:
    """A chat's tools as vLLM 0.32 hands them to the template: read into its request model
    (``ChatCompletionToolsParam``) and dumped: the function's keys in the model's order,
    ``description`` and ``parameters`` null when absent, ``strict`` and ``defer_loading`` only
    when set, other keys gone (a tool's ``defer_loading`` is also its function's). Values the
    model refuses answer 400 (the simulator also refuses those pydantic would coerce)."""
    if not isinstance(tools, list):
        raise ApiError(400, "tools must be a list", param="tools")
    out = []
    for t in tools:
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(f, dict) or t.get("type", "function") != "function":
            raise ApiError(400, "each tool must be a function tool", param="tools")
        fn: dict[str, Any] = {}
        for key, kind in (("name", str), ("description", str | None), ("parameters", dict | None)):
            if not isinstance(f.get(key), kind):
                raise ApiError(400, f"tools: function.{key} has the wrong type", param="tools")
            fn[key] = f.get(key)
        defer = t.get("defer_loading")
        own = f.get("defer_loading")
        flags = (("strict", f.get("strict")), ("defer_loading", defer if own is None else own))
        for key, v in (*flags, ("", defer)):
            if not isinstance(v, bool | None):
                raise ApiError(400, f"tools: {key or 'defer_loading'} must be a boolean")
            if key and v is not None:
                fn[key] = v
        tool: dict[str, Any] = {"type": "function", "function": fn}
        if defer is not None:
            tool["defer_loading"] = defer
        out.append(tool)
    return out


class Worker:
    def __init__(self, settings: WorkerSettings) -> None:
        self.s = settings
        self.tokenizer: Tokenizer | HFTokenizer
        if settings.tokenizer_path:
            # The model's own tokenizer files (tokenizers + jinja2): its vocabulary bounds the
            # token ids the engine accepts and samples.
            self.tokenizer = HFTokenizer(settings.tokenizer_path)
            settings.engine.vocab_size = self.tokenizer.vocab_size
        else:
            self.tokenizer = Tokenizer(
                settings.engine.vocab_size,
                settings.chat_template,
                writes_effort=settings.chat_format == "harmony",
            )
        self.harmony = HarmonyChat() if settings.chat_format == "harmony" else None
        self.runners: list[EngineRunner] = []
        modules = {name: f"/sim/lora/{name}" for name in settings.loras}
        modules.update(settings.lora.modules)
        settings.lora.modules = modules
        settings.engine.max_loras = settings.lora.max_loras
        self.loras = LoraAdapters(settings.lora, settings.engine.lora_ids)
        self.faults = Faults(self.loras)
        # Requests by prompt form, for /sim/state: a router that forwards token ids is seen here.
        self.prompt_forms: dict[str, int] = {"text": 0, "ids": 0, "chat": 0}
        self.tokenize_calls = 0  # POST /tokenize answered (a router in local mode makes none)
        self._rr = itertools.count()
        self.created = int(time.time())
        self.app = make_app(self)

    # ---- lifecycle ---------------------------------------------------------------------------
    def _publisher(self, rank: int, restart: bool = False) -> ZmqPublisher | None:
        s = self.s
        if s.events_endpoint is None:
            return None
        return ZmqPublisher(
            offset_endpoint_port(s.events_endpoint, rank),
            offset_endpoint_port(s.replay_endpoint, rank) if s.replay_endpoint else None,
            s.topic,
            s.buffer_steps,
            s.hwm,
            s.max_queue_size,
            legacy_replay=s.legacy_replay,
            bind_retry_s=10.0 if restart else 0.0,
        )  # the old socket may linger briefly

    async def start(self) -> None:
        for rank in range(self.s.dp_size):
            pub = await asyncio.to_thread(self._publisher, rank)
            # A config of its own per rank: a fault set on one rank leaves the others.
            engine = SimEngine(replace(self.s.engine))
            r = EngineRunner(engine, rank, pub, self.s.event_encoding)
            r.start()
            self.runners.append(r)

    async def stop(self) -> None:
        for r in self.runners:
            await r.stop()

    async def restart_publishers(self) -> None:
        for r in self.runners:
            old = r.publisher
            if old is not None:
                await asyncio.to_thread(old.close)
                r.publisher = await asyncio.to_thread(self._publisher, r.dp_rank, True)
                r.published = 0
                r.publisher.drop_fraction = self.faults.drop_event_fraction  # type: ignore

    def kv_event_sources(self) -> dict[str, Any]:
        s = self.s
        if s.events_endpoint is None:
            return {}
        out: dict[str, Any] = {}
        for rank in range(s.dp_size):
            out[str(rank)] = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": offset_endpoint_port(s.events_endpoint, rank),
                "replay_endpoint": offset_endpoint_port(s.replay_endpoint, rank)
                if s.replay_endpoint
                else None,
                "buffer_steps": s.buffer_steps,
                "hwm": s.hwm,
                "max_queue_size": s.max_queue_size,
                "topic": s.topic,
            }
        return out

    def pick_runner(self, dp_rank: str | None = None) -> EngineRunner:
        """The rank an ``X-data-parallel-rank`` header names (vLLM honours it; 400 when it is
        not a rank of this worker), else vLLM's DP load balancing: least loaded rank
        (waiting*4 + running), ties RR."""
        if dp_rank is not None:
            n = len(self.runners)
            rank = int(dp_rank) if dp_rank.strip().isdigit() else -1
            if not 0 <= rank < n:
                raise ApiError(400, f"X-data-parallel-rank {dp_rank!r} is out of range [0, {n})")
            return self.runners[rank]
        if len(self.runners) == 1:
            return self.runners[0]
        start = next(self._rr) % len(self.runners)
        order = self.runners[start:] + self.runners[:start]
        return min(order, key=lambda r: len(r.engine.waiting) * 4 + len(r.engine.running))

    # ---- request parsing -----------------------------------------------------------------------
    async def read_json(self, request: Request) -> dict[str, Any]:
        body = await request.body()
        if len(body) > self.s.max_body_bytes:
            raise ApiError(413, "request body too large", "RequestEntityTooLarge")
        try:
            # msgspec first: on a body of 8k token ids (a router that forwards ids sends those)
            # stdlib json is several times slower than vLLM's pydantic-core parser. Anything
            # msgspec refuses (NaN literals, huge ints) goes to stdlib json, which accepts them.
            data = _json_decode(body or b"null")
        except msgspec.MsgspecError:  # DecodeError, or ValidationError for e.g. 1e400
            try:
                data = json.loads(body)
            except (ValueError, UnicodeDecodeError) as e:
                raise ApiError(400, f"invalid JSON body: {e}") from None
        if not isinstance(data, dict):
            raise ApiError(400, "request body must be a JSON object")
        return data

    def check_model(self, data: dict[str, Any]) -> str | None:
        """Returns the LoRA name if the request targets an adapter."""
        model = data.get("model")
        if model is None or model == self.s.engine.model:
            return None
        if isinstance(model, str) and self.loras.serves(model):
            return model
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    def _prompt_ids(self, prompt: Any, add_special_tokens: bool = True) -> list[int]:
        vocab = self.s.engine.vocab_size
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        ids: list[int] | None = None
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens)
        elif isinstance(prompt, list) and (not prompt or type(prompt[0]) is int):
            # One C-level pass that checks types and range (msgspec; vLLM validates with
            # pydantic-core): a router forwards 100k-token id lists, too long for Python-level
            # type and min/max checks on every request.
            try:
                ids = msgspec.convert(prompt, _token_ids_type(vocab))
            except msgspec.ValidationError:
                if all(type(t) is int for t in prompt):
                    raise ApiError(
                        400, f"token ids must be in [0, {vocab})", param="prompt"
                    ) from None
        if ids is None:
            raise ApiError(400, "prompt must be a string or a list of token ids", param="prompt")
        if not ids:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        return ids

    def _truncated(
        self, data: dict[str, Any], ids: list[int], text: str | None, chat: bool
    ) -> list[int]:
        """vLLM's ``truncate_prompt_tokens`` (0.32 ``TokenizeParams``): keep the last ``k``
        tokens (``truncation_side`` "left", a generative model's default) or the first ``k``;
        ``-1`` is the model's context, less one token when the request sets its output length.
        ``text``: the prompt when it is text tokenized with special tokens; without an explicit
        side the tokenizer truncates it, then adds its specials."""
        k, side = data.get("truncate_prompt_tokens"), data.get("truncation_side")
        if k is None:
            return ids
        if type(k) is not int or k < -1:
            msg = "truncate_prompt_tokens must be an integer >= -1"
            raise ApiError(400, msg, param="truncate_prompt_tokens")
        if side not in (None, "left", "right"):
            raise ApiError(400, "`truncation_side` must be either 'left' or 'right'.")
        mml = self.s.engine.max_model_len
        if k > mml:
            raise ApiError(
                400,
                f"truncate_prompt_tokens={k} cannot be greater than max_model_len={mml}. "
                "Please request a smaller truncation size.",
                param="truncate_prompt_tokens",
            )
        if k == -1:
            output = data.get("max_completion_tokens") if chat else None
            output = output if output is not None else data.get("max_tokens")
            k = mml - 1 if output else mml
        if k >= len(ids):
            return ids
        if text is not None and side is None:
            return self.tokenizer.encode_keep_last(text, k)
        return ids[:k] if side == "right" else ids[len(ids) - k :]

    def chat_ids(self, data: dict[str, Any], *, completion: bool = False) -> list[int]:
        """A chat's prompt tokens; ``completion``: for ``/v1/chat/completions`` (else
        ``/tokenize``, whose template sees fewer of the request's fields)."""
        agp = data.get("add_generation_prompt", True)
        cfm = data.get("continue_final_message", False)
        if not isinstance(agp, bool) or not isinstance(cfm, bool):
            raise ApiError(400, "add_generation_prompt/continue_final_message must be booleans")
        if completion and self.harmony is not None:
            try:
                return self.harmony.render(data)
            except HarmonyChatError as e:
                raise ApiError(400, str(e), param="messages") from None
        kwargs = self.template_kwargs(data, completion=completion)
        messages = data.get("messages")
        if self.s.tokenizer_mode == "mistral":
            messages = mistral_tool_call_ids(messages, cut=completion)
        messages = template_messages(messages, completion=completion)
        try:
            return self.tokenizer.encode_chat(messages, agp, cfm, kwargs)
        except ChatTemplateError as e:
            raise ApiError(400, str(e), param="messages") from None

    def template_kwargs(self, data: dict[str, Any], *, completion: bool) -> dict[str, Any]:
        """What the chat template sees beside the messages (vLLM 0.32 ``build_chat_params``):
        ``chat_template_kwargs`` and ``tools``; on a chat completion also ``documents`` and
        ``reasoning_effort``, which override them, and ``enable_thinking`` from
        ``reasoning_effort`` (``"none"``: off) unless the kwargs set it. ``/tokenize`` takes
        none of the three. A chat completion's ``tool_choice: "none"`` drops the tools when
        the worker excludes them (``exclude_tools_when_tool_choice_none``)."""
        user = data.get("chat_template_kwargs")
        if user is not None and not isinstance(user, dict):
            raise ApiError(400, "chat_template_kwargs must be an object")
        kwargs = dict(user or {})
        tools = data.get("tools")
        if tools is not None:
            tools = dumped_tools(tools)
            excluded = completion and self.s.exclude_tools_when_tool_choice_none
            if not (excluded and data.get("tool_choice") == "none"):
                kwargs["tools"] = tools
        if completion:
            for k in ("documents", "reasoning_effort"):
                if data.get(k) is not None:
                    kwargs[k] = data[k]
            effort = data.get("reasoning_effort")
            if effort is not None and "enable_thinking" not in (user or {}):
                kwargs["enable_thinking"] = effort != "none"
        return kwargs

    def _max_tokens(self, data: dict[str, Any], prompt_len: int, chat: bool) -> int:
        key = "max_completion_tokens" if chat and "max_completion_tokens" in data else "max_tokens"
        mt = data.get(key)
        limit = self.s.engine.max_model_len - prompt_len
        if limit <= 0:
            raise ApiError(
                400,
                f"This model's maximum context length is "
                f"{self.s.engine.max_model_len} tokens. However, you requested "
                f"{prompt_len} tokens in the messages.",
                param="messages",
            )
        if mt is None:
            return min(limit, self.s.default_max_tokens)
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
            raise ApiError(400, f"{key} must be a positive integer", param=key)
        if mt > limit:
            raise ApiError(
                400,
                f"{key}={mt} is too large: prompt has {prompt_len} tokens and "
                f"max_model_len is {self.s.engine.max_model_len}",
                param=key,
            )
        return mt

    @staticmethod
    def _priority(data: dict[str, Any]) -> int:
        """vLLM's ``priority`` field: an int64, default 0 (lower is served earlier)."""
        p = data.get("priority", 0)
        if not isinstance(p, int) or isinstance(p, bool) or not -(2**63) <= p < 2**63:
            raise ApiError(400, "priority must be a 64-bit integer", param="priority")
        return p

    @staticmethod
    def _n(data: dict[str, Any]) -> int:
        """vLLM's ``n``: 1 to ``VLLM_MAX_N_SEQUENCES`` (16384), and 1 under greedy sampling
        (``temperature`` 0; vLLM's default is 1)."""
        n = data.get("n")
        if n is None:
            return 1
        if not isinstance(n, int) or isinstance(n, bool):
            raise ApiError(400, f"n must be an int, but is of type {type(n)}", param="n")
        if not 1 <= n <= MAX_N:
            raise ApiError(400, f"n must be at least 1 and at most {MAX_N}, got {n}.", param="n")
        t = data.get("temperature")
        if n > 1 and isinstance(t, int | float) and t < 1e-5:
            raise ApiError(400, f"n must be 1 when using greedy sampling, got {n}.", param="n")
        return n

    @staticmethod
    def _salt(data: dict[str, Any]) -> str | None:
        salt = data.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ApiError(400, "cache_salt must be a non-empty string", param="cache_salt")
        return salt

    # ---- generation --------------------------------------------------------------------------
    def _generation(self, data: dict[str, Any], chat: bool) -> Generation:
        lora = self.check_model(data)
        specials = data.get("add_special_tokens", True) is True
        p = data.get("prompt")
        # A completion's prompt may be several (strings or token-id lists): vLLM runs each.
        batch = p if not chat and isinstance(p, list) and p and type(p[0]) is not int else [p]
        prompts = []
        for one in batch:
            ids = self.chat_ids(data, completion=True) if chat else self._prompt_ids(one, specials)
            text = one if not chat and isinstance(one, str) and specials else None
            ids = self._truncated(data, ids, text, chat)
            if not ids:
                raise ApiError(400, "The decoder prompt cannot be empty", param="prompt")
            prompts.append(ids)
        if chat:
            form = "chat"
        elif isinstance(batch[0], str):
            form = "text"
        else:
            form = "ids"
        self.prompt_forms[form] += 1
        max_tokens = min(self._max_tokens(data, len(ids), chat) for ids in prompts)
        salt = self._salt(data)
        stream = data.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "stream must be a boolean", param="stream")
        so = data.get("stream_options") or {}
        include_usage = bool(isinstance(so, dict) and so.get("include_usage"))
        xargs = data.get("vllm_xargs")
        xargs = xargs if isinstance(xargs, dict) else {}
        session = data.get("session_id", xargs.get("session_id"))
        if session is not None and not isinstance(session, str):
            raise ApiError(400, "session_id must be a string", param="session_id")
        explicit = (data.get("max_completion_tokens") if chat else None) is not None or (
            data.get("max_tokens") is not None
        )
        return Generation(
            rid=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            model=data.get("model") or self.s.engine.model,
            chat=chat,
            prompts=prompts,
            max_tokens=max_tokens,
            lora=lora,
            salt=salt,
            session=session,
            report_full=xargs.get("kv_cache_report_mode") == "full",
            priority=self._priority(data),
            stream=stream,
            include_usage=include_usage,
            # Without max_tokens the fake model "emits EOS" after default_max_tokens.
            finish="length" if explicit else "stop",
            n=self._n(data),
        )

    async def generate(
        self, data: dict[str, Any], chat: bool, dp_rank: str | None = None
    ) -> Response:
        """``dp_rank``: the request's ``X-data-parallel-rank`` header, if any."""
        await self.loras.resolve(data.get("model"))
        g = self._generation(data, chat)
        runner = self.pick_runner(dp_rank)
        queues: list[asyncio.Queue[TokenOut]] = []
        try:
            for rid, ids in g.children:
                args = (ids, g.max_tokens, g.lora, g.salt, g.session, g.report_full, g.priority)
                queues.append(runner.submit(rid, *args))
        except (QueueFull, ValueError) as e:
            for rid, _ in g.children[: len(queues)]:
                runner.abort(rid)
            if isinstance(e, ValueError):
                raise ApiError(400, str(e)) from None
            raise ApiError(
                503, "server is overloaded, request queue full", "ServiceUnavailableError"
            ) from None
        if g.stream:
            return StreamingResponse(self._sse(runner, queues, g), media_type="text/event-stream")
        return await self._complete(runner, queues, g)

    async def _outputs(
        self, queues: list[asyncio.Queue[TokenOut]]
    ) -> AsyncIterator[tuple[int, TokenOut]]:
        """``(choice, output)`` as the children produce them, until each has ended (finished,
        or ended without a token: aborted, engine restarted)."""
        timeout = self.s.request_timeout_s
        if len(queues) == 1:
            while True:
                out = await asyncio.wait_for(queues[0].get(), timeout)
                yield 0, out
                if out.finished or out.token is None:
                    return
        merged: asyncio.Queue[tuple[int, TokenOut]] = asyncio.Queue()

        async def pump(i: int, q: asyncio.Queue[TokenOut]) -> None:
            while True:
                out = await q.get()
                merged.put_nowait((i, out))
                if out.finished or out.token is None:
                    return

        pumps = [asyncio.create_task(pump(i, q)) for i, q in enumerate(queues)]
        try:
            left = len(queues)
            while left:
                i, out = await asyncio.wait_for(merged.get(), timeout)
                left -= out.finished or out.token is None
                yield i, out
        finally:
            for t in pumps:
                t.cancel()

    async def _complete(
        self, runner: EngineRunner, queues: list[asyncio.Queue[TokenOut]], g: Generation
    ) -> JSONResponse:
        toks: list[list[int]] = [[] for _ in queues]
        ends: list[tuple[int, TokenOut]] = []  # each child's last output, in the order they ended
        try:
            async with contextlib.aclosing(self._outputs(queues)) as outs:
                async for i, out in outs:
                    if out.token is not None:
                        toks[i].append(out.token)
                    if out.finished or out.token is None:
                        ends.append((i, out))
                        if out.token is None and not toks[i]:
                            raise ApiError(503, "engine restarted", "ServiceUnavailableError")
        except (TimeoutError, asyncio.CancelledError, ApiError):
            for rid, _ in g.children:
                runner.abort(rid)
            raise
        texts = [self.tokenizer.decode(t) for t in toks]
        # vLLM answers with the usage of the last prompt's child that ended last: a later
        # child finds the prompt blocks the first one allocated, so its cached tokens are not
        # one lookup's; a batch's other prompts are not in it at all.
        first_of_last = len(queues) - g.n
        cached = next(o.cached_tokens for i, o in reversed(ends) if i >= first_of_last)
        completion = sum(len(t) for t in toks)
        prompt = sum(len(ids) for ids in g.prompts)
        u = usage(prompt, completion, cached, self.s.prompt_tokens_details)
        return JSONResponse(completion_body(g.rid, g.model, g.chat, texts, u, g.finish))

    async def _sse(
        self, runner: EngineRunner, queues: list[asyncio.Queue[TokenOut]], g: Generation
    ) -> AsyncIterator[bytes]:
        chunks = ChunkWriter(g.rid, g.model, g.chat)
        n_out = [0] * len(queues)
        done = [False] * len(queues)
        prompt_tokens = cached = 0
        try:
            async with contextlib.aclosing(self._outputs(queues)) as outs:
                async for i, out in outs:
                    prompt_tokens, cached = out.prompt_tokens, out.cached_tokens
                    if out.token is None:
                        break
                    if g.chat and n_out[i] == 0:
                        # vLLM sends the role with a choice's first output, after its prefill.
                        yield chunks.role(i)
                    n_out[i] += 1
                    fin = g.finish if out.finished else None
                    yield chunks.token(self.tokenizer.decode([out.token]), fin, i)
                    done[i] = out.finished
            if g.include_usage:
                if len(g.prompts) > 1:
                    prompt_tokens = sum(len(ids) for ids in g.prompts)
                u = usage(prompt_tokens, sum(n_out), cached, self.s.prompt_tokens_details)
                yield chunks.chunk([], u)
            yield SSE_DONE
        finally:
            for (rid, _), ended in zip(g.children, done, strict=True):
                if not ended:  # client went away or stream broke
                    runner.abort(rid)

    # ---- state ---------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """``GET /sim/state``: each engine's queues, cache and event counters, and the faults."""
        return {
            "engines": [
                {
                    "dp_rank": r.dp_rank,
                    "running": len(r.engine.running),
                    "waiting": len(r.engine.waiting),
                    "kv_usage": r.engine.kv_usage(),
                    "steps": r.steps,
                    "next_seq": r.publisher.next_seq if r.publisher else None,
                    "published": r.published,
                    "cached_blocks": r.engine.kv.pool.num_cached_blocks(),
                }
                for r in self.runners
            ],
            "faults": self.faults.as_dict(),
            "prompt_forms": dict(self.prompt_forms),
            "tokenize_calls": self.tokenize_calls,
            "lora": self.loras.state(),
        }


MISTRAL_TOOL_CALL_ID = re.compile(r"^[a-zA-Z0-9]{9}$")


def mistral_tool_call_ids(messages: Any, *, cut: bool) -> Any:
    """The messages' tool-call ids as vLLM 0.32 takes them on its Mistral tokenizer: ``cut``
    (a chat completion: ``truncate_tool_call_ids``) keeps the last 9 characters of a longer
    one; then mistral-common's validator refuses any id that is not 9 letters or digits, on
    an assistant's tool call or a tool message."""
    if not isinstance(messages, list):
        return messages
    out = []
    for m in messages:
        if not isinstance(m, dict):
            out.append(m)
            continue
        m = dict(m)
        ids: list[Any] = []
        if m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list):
            calls = [dict(c) if isinstance(c, dict) else c for c in m["tool_calls"]]
            for c in calls:
                if isinstance(c, dict):
                    if cut and isinstance(c.get("id"), str) and len(c["id"]) > 9:
                        c["id"] = c["id"][-9:]
                    ids.append(c.get("id"))
            m["tool_calls"] = calls
        elif m.get("role") == "tool":
            if cut and isinstance(m.get("tool_call_id"), str) and len(m["tool_call_id"]) > 9:
                m["tool_call_id"] = m["tool_call_id"][-9:]
            ids.append(m.get("tool_call_id"))
        for i in ids:
            if not isinstance(i, str) or not MISTRAL_TOOL_CALL_ID.match(i):
                raise ApiError(
                    400,
                    f"Tool call id was {i} but must be a-z, A-Z, 0-9, with a length of 9.",
                    param="messages",
                )
        out.append(m)
    return out


def template_messages(messages: Any, *, completion: bool) -> Any:
    """The messages as vLLM 0.32's chat parser hands them to a string-format template.

    A chat completion's request model first renames the deprecated ``reasoning_content`` to
    ``reasoning`` (``ChatCompletionRequest``); ``/tokenize``'s does not. The parser then keeps
    ``role`` and ``content`` (absent: ""; text parts joined by newlines), an assistant's
    ``tool_calls`` (arguments parsed into an object, ``{}`` when empty or not a JSON object; an
    empty list dropped) and its reasoning under both names, a tool message's
    ``tool_call_id``, and a string ``name``; everything else is dropped. A body this does not
    read (not a list of objects, media parts) is passed on for the template to refuse."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return messages
    return [_template_message(m, completion) for m in messages]


def _template_message(m: dict[str, Any], completion: bool) -> dict[str, Any]:
    role = m.get("role")
    content = m.get("content")
    if role == "system":
        content = _without_billing_line(content)
    if content is None:
        content = ""
    elif isinstance(content, list) and all(
        isinstance(p, str) or (isinstance(p, dict) and p.get("type") == "text") for p in content
    ):
        content = "\n".join(p if isinstance(p, str) else str(p.get("text", "")) for p in content)
    msg: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        calls = m.get("tool_calls")
        if isinstance(calls, list) and calls:
            msg["tool_calls"] = [_parsed_call(c) for c in calls]
        reasoning = m.get("reasoning")
        if reasoning is None and completion:
            reasoning = m.get("reasoning_content")
        if reasoning is not None:
            msg["reasoning"] = msg["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in m:
        msg["tool_call_id"] = m["tool_call_id"]
    if isinstance(m.get("name"), str):
        msg["name"] = m["name"]
    return msg


BILLING_HEADER = "x-anthropic-billing-header"


def _without_billing_line(content: Any) -> Any:
    """A system prompt without Claude Code's attribution line, whose value changes on every
    request (vLLM drops it from a system message's text, and the part if nothing is left)."""
    if isinstance(content, str):
        return content.partition("\n")[2] if content.startswith(BILLING_HEADER) else content
    if not isinstance(content, list):
        return content
    out = []
    for p in content:
        text = p if isinstance(p, str) else p.get("text") if isinstance(p, dict) else None
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(p)
        elif rest := text.partition("\n")[2]:
            out.append(rest if isinstance(p, str) else {**p, "text": rest})
    return out


def _parsed_call(call: Any) -> Any:
    """A tool call's arguments as an object, as templates expect them."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    args = call["function"].get("arguments")
    if isinstance(args, str) and args:
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            args = {}
    if not isinstance(args, dict):
        args = {}
    return {**call, "function": {**call["function"], "arguments": args}}
