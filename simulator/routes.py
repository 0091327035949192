"""The HTTP surface of one simulated vLLM worker (a FastAPI app over a ``Worker``).

Endpoints mirror vLLM 0.33's API server (``vllm/entrypoints``): completions and chat
completions (non-streaming and SSE, ``usage.prompt_tokens_details.cached_tokens``,
``stream_options.include_usage``), ``/tokenize`` (prompt and chat forms), ``/detokenize``,
``/v1/models``, ``/health``, ``/metrics`` (vLLM metric names, labels ``model_name`` and
``engine``), ``/kv_event_sources`` (``serve/instrumentator/basic.py`` L59),
``/reset_prefix_cache``, ``/sleep``, ``/wake_up``, ``/is_sleeping``; with runtime LoRA updating
allowed, ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (``simulator.lora``).
Simulator admin: ``/sim/faults``, ``/sim/restart_publisher``, ``/sim/restart_engine``,
``/sim/state``.

Bad input gets a 4xx OpenAI-style error body ``{"error": {"message", "type", "param",
"code"}}``; bodies above ``max_body_bytes`` get 413.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from simulator.api_errors import ApiError, error_response
from simulator.metrics import metrics_text

if TYPE_CHECKING:
    from simulator.server import Worker

_json_encode = msgspec.json.Encoder().encode


class _Guards:
    """Body-size limit and the ``stall_http`` fault, before any route runs.

    Pure ASGI rather than ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware pipes every
    response body through an extra task and memory stream, which shows on a large ``/tokenize``
    answer; vLLM's API server adds no such middleware by default, so the simulator should not
    make ``/tokenize`` slower than the worker it stands in for.
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
            too_large = error_response(413, "request body too large", "RequestEntityTooLarge")
            await too_large(scope, receive, send)
            return
        if w.faults.stall_http and not scope["path"].startswith("/sim/"):
            try:
                await asyncio.wait_for(w.faults.unstall.wait(), w.s.request_timeout_s)
            except TimeoutError:
                stalled = error_response(503, "stalled", "ServiceUnavailableError")
                await stalled(scope, receive, send)
                return
        await self.app(scope, receive, send)


def make_app(w: Worker) -> FastAPI:
    app = FastAPI(title="kvrouter-sim worker", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return error_response(e.status, e.message, e.type, e.param)

    @app.exception_handler(Exception)
    async def _any_error(_: Request, e: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(e).__name__}", "InternalServerError")

    app.add_middleware(_Guards, worker=w)
    _add_generation_routes(app, w)
    _add_tokenizer_routes(app, w)
    _add_info_routes(app, w)
    _add_sleep_routes(app, w)
    if w.s.lora.runtime_updating:
        _add_lora_routes(app, w)
    _add_admin_routes(app, w)
    return app


def _add_generation_routes(app: FastAPI, w: Worker) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        data = await w.read_json(request)
        rank = request.headers.get("x-data-parallel-rank")
        return await _cancelled_on_disconnect(request, w.generate(data, False, rank))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        data = await w.read_json(request)
        rank = request.headers.get("x-data-parallel-rank")
        return await _cancelled_on_disconnect(request, w.generate(data, True, rank))


async def _cancelled_on_disconnect(request: Request, handler: Awaitable[Response]) -> Response:
    """vLLM's ``with_cancellation``: a client that disconnects before the answer cancels the
    handler, which aborts the request in the engine (a stream is aborted by its own generator)."""
    task = asyncio.ensure_future(handler)
    gone = asyncio.ensure_future(_disconnected(request))
    await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        gone.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    return Response(status_code=499)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _add_tokenizer_routes(app: FastAPI, w: Worker) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        data = await w.read_json(request)
        await w.loras.resolve(data.get("model"))
        w.check_model(data)
        w.tokenize_calls += 1
        if "messages" in data:
            ids = w.chat_ids(data)
            text = w.tokenizer.render_chat(
                data["messages"],
                data.get("add_generation_prompt", True),
                data.get("continue_final_message", False),
                w.template_kwargs(data, completion=False),
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
        data = await w.read_json(request)
        await w.loras.resolve(data.get("model"))
        w.check_model(data)
        toks = data.get("tokens")
        if not isinstance(toks, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in toks
        ):
            raise ApiError(400, "tokens must be a list of non-negative ints", param="tokens")
        return JSONResponse({"prompt": w.tokenizer.decode(toks)})


def _add_info_routes(app: FastAPI, w: Worker) -> None:
    @app.get("/v1/models")
    async def models() -> Response:
        def card(mid: str, root: str, parent: str | None) -> dict[str, Any]:
            return {
                "id": mid,
                "object": "model",
                "created": w.created,
                "owned_by": "vllm",
                "root": root,
                "parent": parent,
                # vLLM sets max_model_len on base model cards only
                "max_model_len": w.s.engine.max_model_len if parent is None else None,
                "permission": [],
            }

        base = w.s.engine.model
        data = [card(base, base, None)]
        data += [card(name, path, base) for name, path in w.loras.paths.items()]
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
            metrics_text(w.s.engine.model, w.runners, w.loras.info_lines(w.runners)),
            media_type="text/plain; version=0.0.4; charset=utf-8",
        )

    @app.get("/kv_event_sources")
    async def kv_event_sources() -> Response:
        return JSONResponse(w.kv_event_sources())

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        ext = request.query_params.get("reset_external", "false").lower() == "true"
        ok = all([r.engine.reset_prefix_cache(ext) for r in w.runners])
        # vLLM 0.32 answers 200 either way; a reset refused while blocks are held says so.
        return JSONResponse({"success": ok})


def _add_sleep_routes(app: FastAPI, w: Worker) -> None:
    """vLLM's sleep mode (``serve/dev/sleep/api_router.py``, with ``--enable-sleep-mode`` and
    ``VLLM_SERVER_DEV_MODE=1``): ``POST /sleep?level=N`` (requests in flight aborted; level 1
    or 2 drops the prefix cache), ``POST /wake_up``, ``GET /is_sleeping``."""

    @app.post("/sleep")
    async def sleep(request: Request) -> Response:
        level = request.query_params.get("level", "1")
        if level not in ("0", "1", "2"):
            raise ApiError(400, "level must be 0, 1 or 2", param="level")
        if not all([r.sleep(int(level)) for r in w.runners]):
            raise ApiError(500, "the prefix cache could not be dropped", "InternalServerError")
        return JSONResponse({"status": "sleeping", "level": int(level)})

    @app.post("/wake_up")
    async def wake_up() -> Response:
        for r in w.runners:
            r.wake_up()
        return JSONResponse({"status": "awake", "tags": None})

    @app.get("/is_sleeping")
    async def is_sleeping() -> Response:
        return JSONResponse(
            {"is_sleeping": any(r.engine.sleep_level is not None for r in w.runners)}
        )


def _add_lora_routes(app: FastAPI, w: Worker) -> None:
    """vLLM's ``serve/lora/api_router.py``: registered only with runtime updating allowed; a
    success is a 200 whose body is the message as plain text."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        return Response(await w.loras.load(await w.read_json(request)), status_code=200)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        return Response(await w.loras.unload(await w.read_json(request)), status_code=200)


def _add_admin_routes(app: FastAPI, w: Worker) -> None:
    """The simulator's own endpoints (no vLLM counterpart): faults, restarts, state."""

    @app.get("/sim/faults")
    async def get_faults() -> Response:
        return JSONResponse(w.faults.as_dict())

    @app.post("/sim/faults")
    async def set_faults(request: Request) -> Response:
        w.faults.apply(await w.read_json(request), w.runners)
        return JSONResponse(w.faults.as_dict())

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
        return JSONResponse(w.state())
