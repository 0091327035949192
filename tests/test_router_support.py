"""Helpers shared by the router tests (no tests here): in-process router on a free port, polling."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response

from router.app import create_apps
from router.config import Config, WorkerSpec
from router.core import Router
from router.load import EngineLoad
from router.policy import Candidate
from router.workers import Worker, parse_vllm_metrics


async def until(
    pred: Callable[[], Awaitable[Any]] | Callable[[], Any], timeout: float, what: str = ""
) -> Any:
    """Poll ``pred`` (sync or async) until truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = pred()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or pred}")
        await asyncio.sleep(0.05)


@asynccontextmanager
async def serve_app(app: FastAPI) -> AsyncIterator[str]:
    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=0, log_level="warning", lifespan="on", access_log=False
        )
    )
    task = asyncio.create_task(server.serve())
    try:
        await until(lambda: server.started or task.done(), 20, "server start")
        if task.done():
            task.result()
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 15)


def stand_in_worker() -> FastAPI:
    """A worker serving model ``m`` without KV events: health, its model list, and a tokenizer
    of one token per character of the JSON-encoded prompt. Tests add the API they exercise."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        return Response(b"{}", media_type="application/json")

    @app.get("/v1/models")
    async def models() -> Response:
        return Response(b'{"data":[{"id":"m","parent":null}]}', media_type="application/json")

    @app.get("/kv_event_sources")
    async def sources() -> Response:
        return Response(b"{}", media_type="application/json")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await request.json()
        n = len(json.dumps(body.get("messages", body.get("prompt"))))
        return Response(json.dumps({"tokens": list(range(n)), "count": n}).encode())

    return app


@asynccontextmanager
async def serve_router(cfg: Config) -> AsyncIterator[tuple[str, Router]]:
    app, _admin, router = create_apps(cfg, seed=0)
    async with serve_app(app) as url:
        yield url, router


async def worker_load(client: Any, worker_url: str, field: str) -> float:
    """``field`` (``running``, ``waiting``, ...) of a worker's own /metrics as the router reads
    it (``router.workers.parse_vllm_metrics``), summed over its DP engines."""
    text = (await client.get(worker_url + "/metrics")).text
    return sum(engine.get(field, 0.0) for engine in parse_vllm_metrics(text).values())


async def served_again_as_predicted(c: Any, base: str, chat: dict[str, Any], n: int) -> int:
    """Once the router (one worker) finds every block of the ``n``-token chat but the one
    holding its last token under its own keys, the chat again: its cached tokens equal the
    prediction and those blocks. Returns the cached tokens."""
    whole = (n - 1) // 16 * 16

    async def indexed() -> dict[str, Any] | None:
        plan = (await c.post(base + "/debug/route", json=chat)).json()
        return plan if plan["workers"][0]["gpu_hit_tokens"] >= whole else None

    plan = await until(indexed, 20, "the chat's blocks under the router's keys")
    assert plan["prompt_tokens"] == n
    again = (await c.post(base + "/v1/chat/completions", json=chat)).json()
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == plan["predicted_hit_tokens"] == whole
    return cached


def config_for(workers: list[Any], **sections: dict[str, Any]) -> Config:
    cfg = Config(
        workers=[
            WorkerSpec(url=w.url) if hasattr(w, "url") else WorkerSpec(url=str(w)) for w in workers
        ]
    )
    for section, values in sections.items():
        for k, v in values.items():
            setattr(getattr(cfg, section), k, v)
    return cfg


def words(n: int, seed: int | str) -> str:
    """``n`` distinct-ish words: one simulator token per word."""
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(10**9)}" for _ in range(n))


FAST = {"decode_ms": 1, "prefill_tps": 400000, "step_overhead_ms": 0.1}
"""Simulated workers that answer at once: for tests of what the router sends, not of its
timing."""


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\n{{ tools | tojson(indent=2) }}<|end|>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""Tools written as the template's JSON, as tool-calling models' templates write them."""


def write_tokenizer(out: Any, vocab_size: int = 2048, template: str = CHAT_TEMPLATE) -> str:
    """A small byte-level BPE model directory (tokenizer.json + tokenizer_config.json with a
    chat template and a BOS added to prompts), trained here with ``tokenizers``: what a model
    hub would provide, without downloading anything. Returns the directory."""
    import json
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    specials.append("<|end|>")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    rng = random.Random(0)
    corpus = [
        " ".join(f"w{rng.randrange(100_000)} alpha beta gamma delta" for _ in range(50))
        for _ in range(300)
    ]
    tok.train_from_iterator(corpus, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)]
    )
    tok.save(str(out / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    return str(out)


def offline_worker(url: str = "http://w") -> Worker:
    """A worker record with no client: for the router's own accounting (tickets, first-token
    counts) without a server behind it."""
    return Worker(spec=WorkerSpec(url=url), client=None)  # type: ignore[arg-type]


def cand(w: str, gpu: int = 0, cpu: int = 0, spec: int = 0, **load: float) -> Candidate:
    """A candidate engine ``w`` holding ``gpu`` / ``cpu`` tokens (``spec`` speculatively) under
    the load ``load`` (:class:`EngineLoad` fields)."""
    return Candidate(w, gpu, cpu, EngineLoad(**load), speculative_tokens=spec)  # type: ignore[arg-type]
