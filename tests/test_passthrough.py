"""The rest of vLLM's API behind the gateway: byte-for-byte bodies and streams, routed by the
prompt where one can be read (Responses, Anthropic messages), by load otherwise."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from test_router_support import config_for, serve_app, serve_router, stand_in_worker, until

from router.anthropic import TemplateTraits
from router.messages import (
    SseUsage,
    cached_from_sse,
    cached_tokens_of,
    has_cache_usage,
    prompt_tokens_of,
)
from router.model_set import ModelSet
from router.passthrough import chat_prompt, routing_body
from router.tokenize import PromptTokenizer


def chat_messages(path: str, body: dict[str, Any]) -> list[dict[str, Any]] | None:
    prompt = chat_prompt(path, body)
    return None if prompt is None else prompt["messages"]


_PATHS = [
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/embeddings",
    "/v1/score",
    "/v1/rerank",
    "/pooling",
    "/detokenize",
    "/v1/audio/transcriptions",
]


def _echo_worker(seen: list[tuple[str, bytes]]) -> FastAPI:
    """Answers every API path with what it received (and streams when asked)."""
    app = stand_in_worker()

    async def echo(request: Request) -> Response:
        data = await request.body()
        seen.append((request.url.path, data))
        if b'"stream": true' in data or b'"stream":true' in data:

            async def gen():  # type: ignore[no-untyped-def]
                yield b"event: a\ndata: " + data[:20] + b"\n\n"
                yield b"data: [DONE]\n\n"

            return StreamingResponse(gen(), media_type="text/event-stream")
        ctype = request.headers.get("content-type", "")
        return Response(b"ECHO " + ctype.encode() + b" " + data, media_type="application/octet")

    for path in _PATHS:
        app.post(path)(echo)
    return app


def test_prompts_read_from_responses_and_anthropic_bodies() -> None:
    assert chat_messages("/v1/responses", {"instructions": "be brief", "input": "hello"}) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
    ]
    items = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}]}]}
    text_a = [{"type": "text", "text": "a"}]  # input_text parts as /tokenize takes them
    assert chat_messages("/v1/responses", items) == [{"role": "user", "content": text_a}]
    assert chat_messages("/v1/responses", {"input": "x", "previous_response_id": "r1"}) is None
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}
    assert chat_messages("/v1/responses", {"input": [image]}) is None
    anthropic = {
        "system": [{"type": "text", "text": "sys"}],
        "messages": [{"role": "user", "content": "hi"}],
    }
    assert chat_messages("/v1/messages", anthropic) == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
    ]
    assert chat_messages("/v1/embeddings", {"input": "x"}) is None


@pytest.mark.parametrize("path", _PATHS)
async def test_every_api_path_is_forwarded_byte_for_byte(path: str) -> None:
    seen: list[tuple[str, bytes]] = []
    async with (
        serve_app(_echo_worker(seen)) as worker,
        serve_router(config_for([worker])) as (base, router),
    ):
        await until(lambda: router.registry.workers[worker].models, 10, "models read")
        async with httpx.AsyncClient(timeout=30) as c:
            if path.startswith("/v1/audio"):
                files = {"file": ("a.wav", b"RIFF\x00\x01binary\xff", "audio/wav")}
                r = await c.post(base + path, files=files, data={"model": "m"})
                sent = seen[-1][1]
                assert b"RIFF\x00\x01binary\xff" in sent and r.content.endswith(sent)
                assert r.content.startswith(b"ECHO multipart/form-data; boundary=")
            else:
                raw = b'{"model": "m",  "input": "hi",\n "messages": [{"role": "user", '
                raw += b'"content": "hi"}], "x": 1.50}'
                r = await c.post(base + path, content=raw)
                assert seen[-1] == (path, raw)
                assert r.content.endswith(raw)
            assert r.status_code == 200 and r.headers["x-kvrouter-worker"] == worker
            stream = await c.post(
                base + "/debug/route?path=" + path, content=b'{"model":"m","input":"hi"}'
            )
            how = stream.json()["routing"]
            by_cache = path in ("/v1/responses",)
            assert how.startswith("by cache" if by_cache else "by load"), how


async def test_a_streamed_response_passes_chunk_by_chunk() -> None:
    seen: list[tuple[str, bytes]] = []
    async with (
        serve_app(_echo_worker(seen)) as worker,
        serve_router(config_for([worker])) as (base, _r),
    ):
        body = {"model": "m", "input": "hi", "stream": True}
        async with (
            httpx.AsyncClient(timeout=30) as c,
            c.stream("POST", base + "/v1/responses", json=body) as r,
        ):
            got = b"".join([x async for x in r.aiter_raw()])
        assert r.headers["content-type"].startswith("text/event-stream")
        assert got.startswith(b"event: a\ndata: ") and got.endswith(b"data: [DONE]\n\n")


def test_a_responses_request_that_may_be_truncated_is_routed_as_vllm_serves_it() -> None:
    """vLLM serves ``truncation: auto`` as ``truncate_prompt_tokens: -1``."""
    prompt = {"messages": [{"role": "user", "content": "a"}]}
    body = {"model": "m", "input": "a"}
    assert "truncate_prompt_tokens" not in routing_body(body, prompt)
    assert "truncate_prompt_tokens" not in routing_body({**body, "truncation": "disabled"}, prompt)
    auto = routing_body({**body, "truncation": "auto"}, prompt)
    assert auto == {"model": "m", **prompt, "truncate_prompt_tokens": -1}


def test_a_responses_request_is_rendered_as_vllm_renders_it() -> None:
    """vLLM hands ``reasoning.effort`` to the template and continues a last input item still
    in progress instead of answering it."""
    items = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "status": "in_progress"},
    ]
    body = {"model": "m", "input": items, "reasoning": {"effort": "none"}}
    prompt = chat_prompt("/v1/responses", body)
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert prompt == {"messages": msgs}
    assert routing_body(body, prompt) == {
        "model": "m",
        "messages": msgs,
        "reasoning_effort": "none",
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    done = {"model": "m", "input": [items[0]], "reasoning": None}
    assert routing_body(done, prompt) == {"model": "m", "messages": msgs}


def test_an_anthropic_request_carries_its_reasoning_effort_and_tools_to_the_template() -> None:
    tool = {"name": "Bash", "input_schema": {"type": "object"}}
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "a"}]}
    prompt = chat_prompt("/v1/messages", body)
    assert prompt is not None
    assert routing_body(body, prompt) == {"model": "m", "messages": prompt["messages"]}
    high = {**body, "output_config": {"effort": "high"}, "tools": [tool]}
    routed = routing_body(high, chat_prompt("/v1/messages", high))
    assert routed["reasoning_effort"] == "high"
    fn = {"name": "Bash", "description": None, "parameters": {"type": "object"}}
    assert routed["tools"] == [{"type": "function", "function": fn}]
    off = {**high, "thinking": {"type": "disabled"}}
    assert routing_body(off, prompt)["reasoning_effort"] == "none"
    low = TemplateTraits(disabled_thinking_effort="low")  # a template that ignores "none"
    assert routing_body(off, prompt, low)["reasoning_effort"] == "low"


def test_tool_choice_none_reaches_the_tokenizer_from_either_api() -> None:
    """vLLM renders an Anthropic ``tool_choice: {"type": "none"}`` and a Responses
    ``tool_choice: "none"`` as a chat's ``"none"``, whose tools a worker started with
    ``--exclude-tools-when-tool-choice-none`` leaves out (router/tokenize.py ``drops_tools``);
    any other choice renders them."""
    tool = {"name": "Bash", "input_schema": {"type": "object"}}
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "a"}]}
    for choice, routed in (({"type": "none"}, "none"), ({"type": "auto"}, None), ("none", None)):
        sent = {**body, "tools": [tool], "tool_choice": choice}
        got = routing_body(sent, chat_prompt("/v1/messages", sent))
        assert got.get("tool_choice") == routed, choice
    fn = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    for choice, routed in (("none", "none"), ("auto", None), ({"type": "none"}, None)):
        sent = {"model": "m", "input": "a", "tools": [fn], "tool_choice": choice}
        got = routing_body(sent, chat_prompt("/v1/responses", sent))
        assert got.get("tool_choice") == routed, choice
    tok = PromptTokenizer(16, tools_dropped=ModelSet(everywhere=True))
    assert tok.drops_tools({"tool_choice": "none"}) and not tok.drops_tools({})
    assert not PromptTokenizer(16).drops_tools({"tool_choice": "none"})
    learned = PromptTokenizer(16, tools_dropped=ModelSet())
    learned.tools_dropped.learn(["m"])  # type: ignore[union-attr]
    assert learned.drops_tools({"model": "m", "tool_choice": "none"})
    assert not learned.drops_tools({"model": "other", "tool_choice": "none"})
    payload = PromptTokenizer.tokenize_payload(
        {"messages": [], "tools": [fn], "tool_choice": "none"}, True, drop_tools=True
    )
    assert isinstance(payload, dict) and "tools" not in payload


def test_cached_tokens_are_read_from_each_apis_usage() -> None:
    """The usage shapes vLLM 0.32 answers with: chat, a Responses answer and its
    ``response.completed`` event, an Anthropic answer and its stream's ``message_delta``."""
    chat = {"usage": {"prompt_tokens": 300, "prompt_tokens_details": {"cached_tokens": 256}}}
    details = {"cached_tokens": 576, "cache_write_tokens": 192}
    responses = {"usage": {"input_tokens": 771, "input_tokens_details": details}}
    completed = {"type": "response.completed", "response": {"id": "r", **responses}}
    anthropic = {"usage": {"input_tokens": 16, "output_tokens": 2, "cache_read_input_tokens": 704,
                           "cache_creation_input_tokens": 192}}  # fmt: skip
    no_cache = {"usage": {"input_tokens": 912, "output_tokens": 2}}
    for doc, want in [
        (chat, (256, 300)),
        (responses, (576, 771)),
        (completed, (576, 771)),
        (anthropic, (704, 912)),
        (no_cache, (None, None)),  # without --enable-prompt-tokens-details: nothing to verify
        ({"usage": {"input_tokens": True, "cache_read_input_tokens": 1}}, (1, None)),
        ({"usage": None}, (None, None)),
    ]:
        assert (cached_tokens_of(doc), prompt_tokens_of(doc)) == want, doc
    start = {"type": "message_start", "message": {"id": "m", **anthropic}}
    assert cached_tokens_of(start) == 704
    delta = b'event: message_delta\ndata: {"type":"message_delta","usage":{"input_tokens":16,'
    delta += b'"output_tokens":2,"cache_read_input_tokens":704}}\n\n'
    assert has_cache_usage(delta) and cached_from_sse(delta) == (704, 720)
    assert not has_cache_usage(b'data: {"type":"content_block_delta"}\n\n')


def test_a_usage_report_split_between_reads_is_joined() -> None:
    """A Responses stream's ``response.completed`` line carries the whole response; every way
    of splitting it between two reads still yields its usage."""
    usage = {"input_tokens": 771, "input_tokens_details": {"cached_tokens": 576}}
    done = {"type": "response.completed",
            "response": {"instructions": "x" * 3000, "usage": usage}}  # fmt: skip
    stream = b'event: response.output_text.delta\ndata: {"delta": "hi"}\n\n'
    stream += b"event: response.completed\ndata: " + json.dumps(done).encode() + b"\n\n"
    for cut in range(0, len(stream), 97):
        scan = SseUsage()
        scan.feed(stream[:cut])
        scan.feed(stream[cut:])
        assert scan.usage == (576, 771), cut
    scan = SseUsage()
    for i in range(0, len(stream), 7):  # many small reads
        scan.feed(stream[i : i + 7])
    assert scan.usage == (576, 771)
    # An unterminated line past the bound is dropped, not kept growing.
    scan = SseUsage()
    scan.feed(b"data: {" + b"x" * (SseUsage.MAX_LINE + 1))
    scan.feed(b'"usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}}}\n\n')
    assert scan.usage is None and scan._carry == b""
