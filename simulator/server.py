"""One simulated vLLM worker: an OpenAI-compatible FastAPI app over 1..dp_size engines.

Endpoints mirror vLLM 0.33's API server (``vllm/entrypoints``): completions and chat
completions (non-streaming and SSE, ``usage.prompt_tokens_details.cached_tokens``,
``stream_options.include_usage``), ``/tokenize`` (prompt and chat forms), ``/detokenize``,
``/v1/models``, ``/health``, ``/metrics`` (vLLM metric names, labels ``model_name`` and
``engine``), ``/kv_event_sources`` (``serve/instrumentator/basic.py`` L59),
``/reset_prefix_cache``. Simulator admin: ``/sim/faults``, ``/sim/restart_publisher``,
``/sim/restart_engine``, ``/sim/state``.

Bad input gets a 4xx OpenAI-style error body ``{"error": {"message", "type", "param",
"code"}}``; bodies above ``max_body_bytes`` get 413.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from simulator.engine import EngineConfig, QueueFull, SimEngine
from simulator.hf_tokenizer import HFTokenizer
from simulator.publisher import ZmqPublisher, offset_endpoint_port
from simulator.runner import EngineRunner, TokenOut
from simulator.tokenizer import ChatTemplateError, Tokenizer

_json_encode = msgspec.json.Encoder().encode
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
    max_body_bytes: int = 8 * 1024 * 1024
    request_timeout_s: float = 600.0
    default_max_tokens: int = 16  # output length when a request sets no max_tokens
    loras: tuple[str, ...] = ()
    tokenizer_path: str | None = None  # a model dir with tokenizer.json: tokenize as vLLM would
    prompt_tokens_details: bool = True  # vLLM's --enable-prompt-tokens-details
    extra: dict[str, Any] = field(default_factory=dict)


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


class _Guards:
    """Body-size limit and the ``stall_http`` fault, before any route runs.

    Pure ASGI rather than ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware pipes every
    response body through an extra task and memory stream, which cost about 1 ms on an 8k-token
    ``/tokenize`` answer (45 KB), measured; vLLM's API server adds no such middleware by default,
    so the simulator should not make ``/tokenize`` slower than the worker it stands in for.
    """

    def __init__(self, app: Any, worker: Worker) -> None:
        self.app = app
        self.worker = worker

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        w = self.worker
        cl = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if cl is not None and (not cl.isdigit() or int(cl) > w.s.max_body_bytes):
            await _err(413, "request body too large", "RequestEntityTooLarge")(scope, receive, send)
            return
        if w.faults.stall_http and not scope["path"].startswith("/sim/"):
            try:
                await asyncio.wait_for(w.faults.unstall.wait(), w.s.request_timeout_s)
            except TimeoutError:
                await _err(503, "stalled", "ServiceUnavailableError")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _err(
    status: int, message: str, type_: str = "BadRequestError", param: str | None = None
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": type_, "param": param, "code": status}},
        status_code=status,
    )


class Faults:
    def __init__(self) -> None:
        self.drop_event_fraction = 0.0
        self.stall_http = False
        self.slowdown = 1.0
        self.events_enabled = True
        self.unstall = asyncio.Event()

    def as_dict(self) -> dict[str, Any]:
        return {
            "drop_event_fraction": self.drop_event_fraction,
            "stall_http": self.stall_http,
            "slowdown": self.slowdown,
            "events_enabled": self.events_enabled,
        }


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
            self.tokenizer = Tokenizer(settings.engine.vocab_size, settings.chat_template)
        self.runners: list[EngineRunner] = []
        self.faults = Faults()
        # Requests by prompt form, for /sim/state: a router that forwards token ids is seen here.
        self.prompt_forms: dict[str, int] = {"text": 0, "ids": 0, "chat": 0}
        self.tokenize_calls = 0  # POST /tokenize answered (a router in local mode makes none)
        self._rr = itertools.count()
        self.created = int(time.time())
        self.app = self._make_app()

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
            r = EngineRunner(SimEngine(self.s.engine), rank, pub, self.s.event_encoding)
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

    def pick_runner(self) -> EngineRunner:
        """vLLM's DP load balancing: least loaded rank (waiting*4 + running), ties RR."""
        if len(self.runners) == 1:
            return self.runners[0]
        start = next(self._rr) % len(self.runners)
        order = self.runners[start:] + self.runners[:start]
        return min(order, key=lambda r: len(r.engine.waiting) * 4 + len(r.engine.running))

    # ---- request parsing -----------------------------------------------------------------------
    async def _json(self, request: Request) -> dict[str, Any]:
        body = await request.body()
        if len(body) > self.s.max_body_bytes:
            raise ApiError(413, "request body too large", "RequestEntityTooLarge")
        try:
            # msgspec first: stdlib json takes ~0.3 ms on a body of 8k token ids (a router that
            # forwards ids sends those), several times what vLLM's pydantic-core parser takes.
            # Anything msgspec refuses (NaN literals, huge ints) is parsed exactly as before.
            data = _json_decode(body or b"null")
        except msgspec.MsgspecError:  # DecodeError, or ValidationError for e.g. 1e400
            try:
                data = json.loads(body)
            except (ValueError, UnicodeDecodeError) as e:
                raise ApiError(400, f"invalid JSON body: {e}") from None
        if not isinstance(data, dict):
            raise ApiError(400, "request body must be a JSON object")
        return data

    def _check_model(self, data: dict[str, Any]) -> str | None:
        """Returns the LoRA name if the request targets an adapter."""
        model = data.get("model")
        if model is None or model == self.s.engine.model:
            return None
        if isinstance(model, str) and model in self.s.loras:
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
            # pydantic-core): a router forwards 100k-token id lists, and the Python-level
            # type-set/min/max checks took 0.26 ms on 8k ids.
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

    def _chat_ids(self, data: dict[str, Any]) -> list[int]:
        agp = data.get("add_generation_prompt", True)
        cfm = data.get("continue_final_message", False)
        if not isinstance(agp, bool) or not isinstance(cfm, bool):
            raise ApiError(400, "add_generation_prompt/continue_final_message must be booleans")
        try:
            return self.tokenizer.encode_chat(data.get("messages"), agp, cfm)
        except ChatTemplateError as e:
            raise ApiError(400, str(e), param="messages") from None

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
    def _salt(data: dict[str, Any]) -> str | None:
        salt = data.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ApiError(400, "cache_salt must be a non-empty string", param="cache_salt")
        return salt

    # ---- generation --------------------------------------------------------------------------
    async def _generate(self, data: dict[str, Any], chat: bool) -> Response:
        lora = self._check_model(data)
        ids = (
            self._chat_ids(data)
            if chat
            else self._prompt_ids(data.get("prompt"), data.get("add_special_tokens", True) is True)
        )
        p = data.get("prompt")
        if chat:
            form = "chat"
        elif isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], str)):
            form = "text"
        else:
            form = "ids"
        self.prompt_forms[form] += 1
        max_tokens = self._max_tokens(data, len(ids), chat)
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
        report_full = xargs.get("kv_cache_report_mode") == "full"
        explicit = (data.get("max_completion_tokens") if chat else None) is not None or (
            data.get("max_tokens") is not None
        )
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        runner = self.pick_runner()
        try:
            q = runner.submit(rid, ids, max_tokens, lora, salt, session, report_full)
        except QueueFull:
            raise ApiError(
                503, "server is overloaded, request queue full", "ServiceUnavailableError"
            ) from None
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        model = data.get("model") or self.s.engine.model
        if stream:
            return StreamingResponse(
                self._sse(
                    runner, q, rid, model, chat, include_usage, "length" if explicit else "stop"
                ),
                media_type="text/event-stream",
            )
        toks: list[int] = []
        last = TokenOut(None, True)
        try:
            while True:
                last = await asyncio.wait_for(q.get(), self.s.request_timeout_s)
                if last.token is not None:
                    toks.append(last.token)
                if last.finished:
                    break
        except (TimeoutError, asyncio.CancelledError):
            runner.abort(rid)
            raise
        if last.token is None and not toks:
            raise ApiError(503, "engine restarted", "ServiceUnavailableError")
        text = self.tokenizer.decode(toks)
        usage = self._usage(len(ids), len(toks), last.cached_tokens)
        # Without max_tokens the fake model "emits EOS" after default_max_tokens.
        finish = "length" if explicit else "stop"
        if chat:
            choice = {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "tool_calls": [],
                },
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
            obj = "text_completion"
        return JSONResponse(
            {
                "id": rid,
                "object": obj,
                "created": int(time.time()),
                "model": model,
                "choices": [choice],
                "usage": usage,
            }
        )

    def _usage(self, prompt: int, completion: int, cached: int) -> dict[str, Any]:
        details = {"cached_tokens": cached} if self.s.prompt_tokens_details else None
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": details,  # null: vLLM without --enable-prompt-tokens-details
        }

    async def _sse(
        self,
        runner: EngineRunner,
        q: asyncio.Queue[TokenOut],
        rid: str,
        model: str,
        chat: bool,
        include_usage: bool,
        finish: str = "length",
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        n_out = 0
        prompt_tokens = cached = 0

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            d: dict[str, Any] = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model,
                "choices": choices,
            }
            if usage is not None:
                d["usage"] = usage
            return b"data: " + json.dumps(d, separators=(",", ":")).encode() + b"\n\n"

        try:
            if chat:
                yield chunk(
                    [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
            while True:
                out = await asyncio.wait_for(q.get(), self.s.request_timeout_s)
                prompt_tokens, cached = out.prompt_tokens, out.cached_tokens
                fin = finish if out.finished else None
                if out.token is None:
                    break
                n_out += 1
                text = self.tokenizer.decode([out.token])
                if chat:
                    yield chunk(
                        [
                            {
                                "index": 0,
                                "delta": {"content": text},
                                "logprobs": None,
                                "finish_reason": fin,
                            }
                        ]
                    )
                else:
                    yield chunk(
                        [
                            {
                                "index": 0,
                                "text": text,
                                "logprobs": None,
                                "finish_reason": fin,
                                "stop_reason": None,
                            }
                        ]
                    )
                if out.finished:
                    break
            if include_usage:
                yield chunk([], self._usage(prompt_tokens, n_out, cached))
            yield b"data: [DONE]\n\n"
        finally:
            if n_out == 0 or not out.finished:  # client went away or stream broke
                runner.abort(rid)

    # ---- metrics -------------------------------------------------------------------------------
    def metrics_text(self) -> str:
        m = self.s.engine.model
        lines: list[str] = []

        def fam(name: str, typ: str, help_: str, values: list[tuple[int, float]]) -> None:
            # prometheus_client (what vLLM uses): a Counter "x" is declared as "x" and
            # sampled as "x_total".
            base = name.removesuffix("_total") if typ == "counter" else name
            lines.append(f"# HELP {base} {help_}")
            lines.append(f"# TYPE {base} {typ}")
            for rank, v in values:
                lines.append(f'{name}{{engine="{rank}",model_name="{m}"}} {v}')

        rs = self.runners
        fam(
            "vllm:num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
            [(r.dp_rank, float(len(r.engine.running))) for r in rs],
        )
        fam(
            "vllm:num_requests_waiting",
            "gauge",
            "Number of requests waiting to be processed.",
            [(r.dp_rank, float(len(r.engine.waiting))) for r in rs],
        )
        fam(
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
            [(r.dp_rank, r.engine.kv_usage()) for r in rs],
        )
        fam(
            "vllm:prefix_cache_queries_total",
            "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
            [(r.dp_rank, float(r.engine.prefix_queries)) for r in rs],
        )
        fam(
            "vllm:prefix_cache_hits_total",
            "counter",
            "Prefix cache hits, in terms of number of cached tokens.",
            [(r.dp_rank, float(r.engine.prefix_hits)) for r in rs],
        )
        fam(
            "vllm:external_prefix_cache_queries_total",
            "counter",
            "External prefix cache queries from KV connector, in terms of number of tokens.",
            [(r.dp_rank, float(r.engine.external_queries)) for r in rs],
        )
        fam(
            "vllm:external_prefix_cache_hits_total",
            "counter",
            "External prefix cache hits from KV connector, in terms of number of tokens.",
            [(r.dp_rank, float(r.engine.external_hits)) for r in rs],
        )
        return "\n".join(lines) + "\n"

    # ---- app -------------------------------------------------------------------------------------
    def _make_app(self) -> FastAPI:
        app = FastAPI(title="kvrouter-sim worker", docs_url=None, redoc_url=None)
        w = self

        @app.exception_handler(ApiError)
        async def _api_error(_: Request, e: ApiError) -> JSONResponse:
            return _err(e.status, e.message, e.type, e.param)

        @app.exception_handler(Exception)
        async def _any_error(_: Request, e: Exception) -> JSONResponse:
            return _err(500, f"internal error: {type(e).__name__}", "InternalServerError")

        app.add_middleware(_Guards, worker=w)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await w._generate(await w._json(request), chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await w._generate(await w._json(request), chat=True)

        @app.post("/tokenize")
        async def tokenize(request: Request) -> Response:
            data = await w._json(request)
            w._check_model(data)
            w.tokenize_calls += 1
            if "messages" in data:
                ids = w._chat_ids(data)
                text = w.tokenizer.render_chat(
                    data["messages"],
                    data.get("add_generation_prompt", True),
                    data.get("continue_final_message", False),
                )
            elif isinstance(data.get("prompt"), str):
                text = data["prompt"]
                ids = w.tokenizer.encode(text, data.get("add_special_tokens", True) is True)
            else:
                raise ApiError(400, "need 'prompt' (string) or 'messages'", param="prompt")
            strs = w.tokenizer.token_strs(text) if data.get("return_token_strs") else None
            # msgspec: encoding tens of thousands of ids with json.dumps costs milliseconds.
            body = _json_encode(
                {
                    "count": len(ids),
                    "max_model_len": w.s.engine.max_model_len,
                    "tokens": ids,
                    "token_strs": strs,
                }
            )
            return Response(body, media_type="application/json")

        @app.post("/detokenize")
        async def detokenize(request: Request) -> Response:
            data = await w._json(request)
            w._check_model(data)
            toks = data.get("tokens")
            if not isinstance(toks, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in toks
            ):
                raise ApiError(400, "tokens must be a list of non-negative ints", param="tokens")
            return JSONResponse({"prompt": w.tokenizer.decode(toks)})

        @app.get("/v1/models")
        async def models() -> Response:
            def card(mid: str, parent: str | None) -> dict[str, Any]:
                return {
                    "id": mid,
                    "object": "model",
                    "created": w.created,
                    "owned_by": "vllm",
                    "root": mid if parent is None else f"/sim/lora/{mid}",
                    "parent": parent,
                    "max_model_len": w.s.engine.max_model_len,
                    "permission": [],
                }

            data = [card(w.s.engine.model, None)]
            data += [card(name, w.s.engine.model) for name in w.s.loras]
            return JSONResponse({"object": "list", "data": data})

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/version")
        async def version() -> Response:
            return JSONResponse({"version": "0.33.0+sim"})

        @app.get("/load")
        async def load() -> Response:
            n = sum(len(r.engine.running) + len(r.engine.waiting) for r in w.runners)
            return JSONResponse({"server_load": n})

        @app.get("/metrics")
        async def metrics() -> Response:
            return PlainTextResponse(
                w.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8"
            )

        @app.get("/kv_event_sources")
        async def kv_event_sources() -> Response:
            return JSONResponse(w.kv_event_sources())

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache(request: Request) -> Response:
            ext = request.query_params.get("reset_external", "false").lower() == "true"
            ok = all([r.engine.reset_prefix_cache(ext) for r in w.runners])
            if not ok:
                return _err(400, "Failed to reset prefix cache: blocks still in use")
            return JSONResponse({"success": True})

        # ---- simulator admin -------------------------------------------------------------
        @app.get("/sim/faults")
        async def get_faults() -> Response:
            return JSONResponse(w.faults.as_dict())

        @app.post("/sim/faults")
        async def set_faults(request: Request) -> Response:
            data = await w._json(request)
            f = w.faults
            known = {
                "drop_event_fraction",
                "stall_http",
                "slowdown",
                "events_enabled",
                "unannounced_reset",
            }
            bad = set(data) - known
            if bad:
                raise ApiError(400, f"unknown fault keys: {sorted(bad)}")
            if "drop_event_fraction" in data:
                v = data["drop_event_fraction"]
                if not isinstance(v, (int, float)) or not 0 <= v <= 1:
                    raise ApiError(400, "drop_event_fraction must be in [0, 1]")
                f.drop_event_fraction = float(v)
                for r in w.runners:
                    if r.publisher:
                        r.publisher.drop_fraction = f.drop_event_fraction
            if "slowdown" in data:
                v = data["slowdown"]
                if not isinstance(v, (int, float)) or not 0 < v <= 1000:
                    raise ApiError(400, "slowdown must be in (0, 1000]")
                f.slowdown = float(v)
                for r in w.runners:
                    r.engine.config.slowdown = f.slowdown
            if "events_enabled" in data:
                f.events_enabled = bool(data["events_enabled"])
                for r in w.runners:
                    r.events_enabled = f.events_enabled
            if "stall_http" in data:
                f.stall_http = bool(data["stall_http"])
                if f.stall_http:
                    f.unstall = asyncio.Event()
                else:
                    f.unstall.set()
            if data.get("unannounced_reset"):
                for r in w.runners:
                    r.engine.silent_reset()
            return JSONResponse(f.as_dict())

        @app.post("/sim/restart_publisher")
        async def restart_publisher() -> Response:
            await w.restart_publishers()
            return JSONResponse({"success": True})

        @app.post("/sim/restart_engine")
        async def restart_engine() -> Response:
            for r in w.runners:
                r.restart_engine()
            await w.restart_publishers()
            return JSONResponse({"success": True})

        @app.get("/sim/state")
        async def state() -> Response:
            return JSONResponse(
                {
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
                        for r in w.runners
                    ],
                    "faults": w.faults.as_dict(),
                    "prompt_forms": dict(w.prompt_forms),
                    "tokenize_calls": w.tokenize_calls,
                }
            )

        return app
