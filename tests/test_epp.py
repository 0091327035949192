"""The EPP's ext_proc conversation, driven message by message by a real gRPC client.

What a gateway cannot easily be made to do on cue: a request held open while the next one is
picked (shedding), a response served by the fallback endpoint, the exact message shapes of the
BUFFERED mode. The router runs in-process (its EPP started by the app's lifespan) in front of
simulated workers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from router.epp_core import endpoint_of
from simulator.testing import find_port_block, running_fleet
from tests.test_router_support import config_for, serve_router, until, words

pytestmark = pytest.mark.timeout(120)

FAST = {"decode_ms": 1, "prefill_tps": 400000, "step_overhead_ms": 0.1}
Mode = processing_mode_pb2.ProcessingMode


@pytest.fixture(scope="module")
def fleet() -> Iterator[list[Any]]:
    with running_fleet(2, num_gpu_blocks=512, **FAST) as workers:
        yield workers


def headers_msg(
    mode: int = Mode.FULL_DUPLEX_STREAMED,
    meta: dict[str, Any] | None = None,
    key: str | None = None,
    extra: dict[str, str] | None = None,
    path: str = "/v1/completions",
    method: str = "POST",
    end_of_stream: bool = False,
) -> pb.ProcessingRequest:
    hm = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=":path", raw_value=path.encode()),
            base_pb2.HeaderValue(key=":method", raw_value=method.encode()),
        ]
    )
    for k, v in (extra or {}).items():
        hm.headers.append(base_pb2.HeaderValue(key=k, raw_value=v.encode()))
    if key is not None:
        hm.headers.append(
            base_pb2.HeaderValue(key="authorization", raw_value=b"Bearer " + key.encode())
        )
    req = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=hm, end_of_stream=end_of_stream),
        protocol_config=pb.ProtocolConfiguration(
            request_body_mode=mode, response_body_mode=Mode.FULL_DUPLEX_STREAMED
        ),
    )
    for ns, fields in (meta or {}).items():
        req.metadata_context.filter_metadata[ns].update(fields)
    return req


def body_msg(prompt: str) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body_of(prompt), end_of_stream=True))


def body_of(prompt: str) -> bytes:
    return json.dumps({"model": "sim-model", "prompt": prompt, "max_tokens": 2}).encode()


def response_headers_msg(served: str | None) -> pb.ProcessingRequest:
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")])
    req = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=hm))
    if served is not None:
        req.metadata_context.filter_metadata["envoy.lb"].update(
            {"x-gateway-destination-endpoint-served": served}
        )
    return req


class Stream:
    """One ext_proc stream, fed and read one message at a time."""

    def __init__(self, stub: pb_grpc.ExternalProcessorStub) -> None:
        self.q: asyncio.Queue[pb.ProcessingRequest | None] = asyncio.Queue()
        self.call = stub.Process(self._requests())

    async def _requests(self) -> AsyncIterator[pb.ProcessingRequest]:
        while (m := await self.q.get()) is not None:
            yield m

    async def send(self, m: pb.ProcessingRequest, answers: int) -> list[pb.ProcessingResponse]:
        await self.q.put(m)
        return [await asyncio.wait_for(self.call.read(), 10) for _ in range(answers)]

    async def close(self) -> None:
        await self.q.put(None)
        with pytest.raises((grpc.aio.AioRpcError, StopAsyncIteration, asyncio.CancelledError)):
            while True:
                if await self.call.read() == grpc.aio.EOF:
                    raise StopAsyncIteration


async def epp_router(fleet: list[Any], **server: Any) -> Any:
    cfg = config_for(fleet, policy={"speculative_ttl_s": 0.0})
    cfg.server.epp_port = find_port_block(1)
    for k, v in server.items():
        setattr(cfg.server, k, v)
    return cfg


def destination(resp: pb.ProcessingResponse) -> str:
    common = resp.request_headers.response if resp.HasField("request_headers") else None
    if common is None:
        common = resp.request_body.response
    hdrs = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    meta = resp.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert (
        meta["x-gateway-destination-endpoint"].string_value
        == hdrs["x-gateway-destination-endpoint"]
    )
    assert common.clear_route_cache
    return hdrs["x-gateway-destination-endpoint"]


async def test_shedding_answers_429_until_a_request_finishes(fleet):
    cfg = await epp_router(fleet[:1], max_connections_per_worker=1)
    async with (
        serve_router(cfg) as (_base, router),
        grpc.aio.insecure_channel(f"127.0.0.1:{cfg.server.epp_port}") as ch,
    ):
        stub = pb_grpc.ExternalProcessorStub(ch)
        first = Stream(stub)
        assert await first.send(headers_msg(), 0) == []
        head, body = await first.send(body_msg(words(64, "shed-1")), 2)
        assert destination(head) == endpoint_of(fleet[0].url)
        assert body.request_body.response.body_mutation.streamed_response.end_of_stream
        second = Stream(stub)
        await second.send(headers_msg(), 0)
        (refused,) = await second.send(body_msg(words(64, "shed-2")), 1)
        assert refused.immediate_response.status.code == 429
        err = json.loads(refused.immediate_response.body)["error"]
        assert err["code"] == 429 and "limit" in err["message"]
        await first.send(response_headers_msg(None), 1)
        done = pb.ProcessingRequest(response_body=pb.HttpBody(body=b"{}", end_of_stream=True))
        (echo,) = await first.send(done, 1)
        assert echo.response_body.response.body_mutation.streamed_response.body == b"{}"
        assert router.registry.workers[fleet[0].url].inflight == 0
        third = Stream(stub)
        await third.send(headers_msg(), 0)
        head, _ = await third.send(body_msg(words(64, "shed-3")), 2)
        assert destination(head) == endpoint_of(fleet[0].url)


async def test_fallback_endpoint_that_served_carries_the_load(fleet):
    cfg = await epp_router(fleet, epp_endpoints=2)
    async with serve_router(cfg) as (_base, router):
        await until(lambda: len(router.registry.healthy()) == 2, 10, "workers healthy")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cfg.server.epp_port}") as ch:
            s = Stream(pb_grpc.ExternalProcessorStub(ch))
            await s.send(headers_msg(), 0)
            head, _ = await s.send(body_msg(words(64, "fallback")), 2)
            primary, fallback = destination(head).split(",")
            by_ep = {endpoint_of(u): w for u, w in router.registry.workers.items()}
            assert by_ep[primary].inflight == 1 and by_ep[fallback].inflight == 0
            await s.send(response_headers_msg(fallback), 1)
            assert by_ep[primary].inflight == 0 and by_ep[fallback].inflight == 1
            await s.close()  # the gateway gave up before the response ended
            await until(lambda: by_ep[fallback].inflight == 0, 5, "load released on close")


async def test_buffered_mode_answers_headers_at_once_and_picks_on_the_body(fleet):
    cfg = await epp_router(fleet)
    async with (
        serve_router(cfg) as (_base, _router),
        grpc.aio.insecure_channel(f"127.0.0.1:{cfg.server.epp_port}") as ch,
    ):
        s = Stream(pb_grpc.ExternalProcessorStub(ch))
        (h,) = await s.send(headers_msg(Mode.BUFFERED), 1)
        assert h.HasField("request_headers") and not h.request_headers.response.ListFields()
        (b,) = await s.send(body_msg(words(64, "buffered")), 1)
        assert destination(b) in {endpoint_of(w.url) for w in fleet}
        assert not b.request_body.response.HasField("body_mutation")
        subset = {"envoy.lb.subset_hint": {"x-gateway-destination-endpoint-subset": []}}
        s2 = Stream(pb_grpc.ExternalProcessorStub(ch))
        await s2.send(headers_msg(Mode.BUFFERED, subset), 1)
        (refused,) = await s2.send(body_msg(words(64, "none")), 1)
        assert refused.immediate_response.status.code == 503


async def test_the_prefill_priority_is_written_into_the_body_as_the_proxy_writes_it():
    with running_fleet(1, scheduling_policy="priority", **FAST) as ws:
        cfg = await epp_router(ws)
        cfg.policy.prefill_priority = True
        async with (
            serve_router(cfg) as (_base, router),
            grpc.aio.insecure_channel(f"127.0.0.1:{cfg.server.epp_port}") as ch,
        ):
            assert router.selfcheck is not None
            assert router.selfcheck.results[ws[0].url]["priority"] == "ok"
            s = Stream(pb_grpc.ExternalProcessorStub(ch))
            await s.send(headers_msg(Mode.BUFFERED), 1)
            (b,) = await s.send(body_msg(words(1200, "priority")), 1)
            body = json.loads(b.request_body.response.body_mutation.body)
            # About 1,200 uncached tokens: the class of [1024, 2048), as the proxy would write.
            assert body["priority"] == 2 and body["prompt"] == words(1200, "priority")


def refusal(resp: pb.ProcessingResponse) -> tuple[int, dict[str, str], bytes]:
    """An ImmediateResponse as (status, headers, body)."""
    ir = resp.immediate_response
    hdrs = {h.header.key: h.header.raw_value.decode() for h in ir.headers.set_headers}
    return ir.status.code, hdrs, ir.body


async def test_api_keys_and_per_key_limits_are_the_proxys(fleet, tmp_path):
    """401 for a missing or unknown key, 429 with Retry-After over a key's rpm or tpm, with the
    proxy's JSON; the EPP and the proxy spend one bucket per key, and a response body that
    comes through the EPP charges its completion tokens."""
    keys = tmp_path / "keys.yaml"
    keys.write_text("once: {rpm: 1}\ntokens: {tpm: 1000}\n")
    cfg = await epp_router(fleet, api_keys=["static"], api_keys_file=str(keys))
    async with (
        serve_router(cfg) as (base, _router),
        grpc.aio.insecure_channel(f"127.0.0.1:{cfg.server.epp_port}") as ch,
        httpx.AsyncClient(timeout=30, trust_env=False) as http,
    ):
        stub = pb_grpc.ExternalProcessorStub(ch)

        async def proxy(key: str | None) -> httpx.Response:
            auth = {"authorization": f"Bearer {key}"} if key else {}
            body = body_of(words(32, "proxy"))
            return await http.post(base + "/v1/completions", content=body, headers=auth)

        for key in (None, "unknown"):
            (refused,) = await Stream(stub).send(headers_msg(key=key), 1)
            status, hdrs, body = refusal(refused)
            answer = await proxy(key)
            assert status == answer.status_code == 401
            assert hdrs["content-type"] == "application/json"
            assert json.loads(body) == answer.json()

        ok = Stream(stub)
        assert await ok.send(headers_msg(key="static"), 0) == []
        head, _ = await ok.send(body_msg(words(64, "static")), 2)
        assert destination(head)

        once = Stream(stub)
        assert await once.send(headers_msg(key="once"), 0) == []
        await once.send(body_msg(words(64, "once")), 2)
        (refused,) = await Stream(stub).send(headers_msg(key="once"), 1)
        status, hdrs, body = refusal(refused)
        answer = await proxy("once")  # the same bucket: the EPP spent its one request
        assert status == answer.status_code == 429
        assert 1 <= int(hdrs["retry-after"]) <= 60
        assert json.loads(body) == answer.json()
        assert "requests per minute" in answer.json()["error"]["message"]
        listing = headers_msg(key="once")  # a GET is checked, not charged: still answered
        listing.request_headers.end_of_stream = True
        for h in listing.request_headers.headers.headers:
            if h.key == ":method":
                h.raw_value = b"GET"
        (models,) = await Stream(stub).send(listing, 1)
        assert destination(models)

        tokens = Stream(stub)
        await tokens.send(headers_msg(key="tokens"), 0)
        await tokens.send(body_msg(words(64, "tokens-1")), 2)
        await tokens.send(response_headers_msg(None), 1)
        usage = {"usage": {"prompt_tokens": 64, "completion_tokens": 5000}}
        done = pb.ProcessingRequest(
            response_body=pb.HttpBody(body=json.dumps(usage).encode(), end_of_stream=True)
        )
        await tokens.send(done, 1)
        over = Stream(stub)
        assert await over.send(headers_msg(key="tokens"), 0) == []  # rpm is not limited
        (refused,) = await over.send(body_msg(words(64, "tokens-2")), 1)
        status, hdrs, body = refusal(refused)
        assert status == 429 and int(hdrs["retry-after"]) > 60
        assert "tokens per minute" in json.loads(body)["error"]["message"]


async def test_no_healthy_worker_leaves_every_worker_eligible_as_the_proxy_does():
    """A worker the router cannot reach is unhealthy; with no healthy one the EPP still picks
    (the proxy forwards then too, and a gateway in panic mode does the same), where it would
    otherwise turn a missed health probe into a 503 for every request."""
    dead = f"http://127.0.0.1:{find_port_block(1)}"
    cfg = await epp_router([dead])
    async with (
        serve_router(cfg) as (_base, router),
        grpc.aio.insecure_channel(f"127.0.0.1:{cfg.server.epp_port}") as ch,
    ):
        await until(lambda: router.registry.workers[dead].last_health_error, 10, "a failed probe")
        assert not router.registry.healthy()
        s = Stream(pb_grpc.ExternalProcessorStub(ch))
        await s.send(headers_msg(), 0)
        head, _ = await s.send(body_msg(words(64, "dead")), 2)
        assert destination(head) == endpoint_of(dead)


async def test_a_session_header_binds_the_pick_as_it_binds_the_proxys_route(fleet):
    """Session affinity reads the gateway's request headers: with ``session.mode: hard`` every
    request of a session goes where its first went, although the other worker has fewer
    requests in flight (each pick here stays in flight: no response comes back)."""
    cfg = await epp_router(fleet)
    cfg.session.mode = "hard"
    cfg.session.header = "X-Session-Id"  # configured in any case; gateways send lower case
    async with serve_router(cfg) as (_base, router):
        await until(lambda: len(router.registry.healthy()) == 2, 10, "workers healthy")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cfg.server.epp_port}") as ch:
            stub = pb_grpc.ExternalProcessorStub(ch)
            picks, streams = [], []
            for i in range(4):
                s = Stream(stub)
                streams.append(s)
                await s.send(headers_msg(extra={"x-session-id": "conversation-7"}), 0)
                head, _ = await s.send(body_msg(words(64, f"session-{i}")), 2)
                picks.append(destination(head))
            other = Stream(stub)  # no session: the engine with fewer in flight
            await other.send(headers_msg(), 0)
            head, _ = await other.send(body_msg(words(64, "no-session")), 2)
            assert len(set(picks)) == 1 and destination(head) != picks[0], (picks, head)
            for s in [*streams, other]:
                await s.close()


async def test_the_admission_queue_holds_a_pick_until_queued_prefill_falls(fleet):
    """With ``admission`` on, a request the fleet has no room for waits in the router's queue,
    as it would at the proxy: its pick comes once the request ahead released its queued
    prefill (the first chunk of its response), and a wait past ``max_wait_s`` is a 429."""
    cfg = await epp_router(fleet[:1])
    cfg.admission.queued_prefill_tokens_threshold = 1  # any queued prefill fills the worker
    cfg.admission.max_wait_s = 30.0
    async with (
        serve_router(cfg) as (_base, router),
        grpc.aio.insecure_channel(f"127.0.0.1:{cfg.server.epp_port}") as ch,
    ):
        await until(lambda: len(router.registry.healthy()) == 1, 10, "worker healthy")
        stub = pb_grpc.ExternalProcessorStub(ch)
        first = Stream(stub)
        await first.send(headers_msg(), 0)
        head, _ = await first.send(body_msg(words(64, "admit-1")), 2)
        assert destination(head) == endpoint_of(fleet[0].url)
        second = Stream(stub)
        await second.send(headers_msg(), 0)
        await second.q.put(body_msg(words(64, "admit-2")))
        assert router.admission is not None
        await until(lambda: len(router.admission.queue) == 1, 10, "the second request queued")
        await first.send(response_headers_msg(None), 1)
        chunk = pb.ProcessingRequest(response_body=pb.HttpBody(body=b"{}", end_of_stream=True))
        await first.send(chunk, 1)
        head = await asyncio.wait_for(second.call.read(), 10)
        assert destination(head) == endpoint_of(fleet[0].url)
        await asyncio.wait_for(second.call.read(), 10)  # its body
        cfg.admission.max_wait_s = 0.2
        third = Stream(stub)
        await third.send(headers_msg(), 0)
        (refused,) = await third.send(body_msg(words(64, "admit-3")), 1)
        assert refused.immediate_response.status.code == 429
        assert len(router.admission.queue) == 0
        for s in (first, second, third):
            await s.close()


async def test_a_stored_response_is_picked_where_it_lives(fleet):
    """``/v1/responses`` through the EPP as through the proxy: the answer's id (read from the
    response body streamed through) is noted with the endpoint that served it, and a request
    naming it (``previous_response_id``, ``GET /v1/responses/{id}``) is picked there. Each
    chain starts while the first worker is busy (a request held there by the subset hint), so
    it lives on the second, and goes on once both are idle: by load alone its requests would
    go to the first."""
    cfg = await epp_router(fleet)
    async with serve_router(cfg) as (_base, router):
        await until(lambda: len(router.registry.healthy()) == 2, 10, "workers healthy")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cfg.server.epp_port}") as ch:
            stub = pb_grpc.ExternalProcessorStub(ch)

            async def create(body: dict[str, Any], answer_id: str) -> str:
                s = Stream(stub)
                await s.send(headers_msg(path="/v1/responses"), 0)
                data = json.dumps({"model": "sim-model", **body}).encode()
                msg = pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=True))
                head, _ = await s.send(msg, 2)
                picked = destination(head)
                await s.send(response_headers_msg(picked), 1)
                doc = json.dumps({"id": answer_id, "object": "response"}).encode()
                end = pb.ProcessingRequest(response_body=pb.HttpBody(body=doc, end_of_stream=True))
                await s.send(end, 1)
                await s.close()
                return picked

            first = endpoint_of(fleet[0].url)
            only_first = {"envoy.lb.subset_hint": {"x-gateway-destination-endpoint-subset": first}}
            for chain in range(4):
                busy = Stream(stub)
                await busy.send(headers_msg(meta=only_first), 0)
                head, _ = await busy.send(body_msg(words(64, f"busy-{chain}")), 2)
                assert destination(head) == first
                holder = await create({"input": f"chain {chain}"}, f"resp_{chain}_0")
                assert holder != first
                await busy.close()
                await until(lambda: router.registry.workers[fleet[0].url].inflight == 0, 5)
                for turn in range(1, 4):
                    body = {
                        "input": f"turn {turn}",
                        "previous_response_id": f"resp_{chain}_{turn - 1}",
                    }
                    assert await create(body, f"resp_{chain}_{turn}") == holder
                s = Stream(stub)
                get = headers_msg(
                    path=f"/v1/responses/resp_{chain}_3", method="GET", end_of_stream=True
                )
                (head,) = await s.send(get, 1)
                assert destination(head) == holder
                await s.close()


async def test_an_agent_turn_is_picked_by_its_prompt_and_its_split_usage_verified(fleet):
    """A Claude Code turn through the EPP (tools, a tool call and its result, a reminder) is
    read as vLLM converts it, so the pick is by its prompt and its answer is verified: the
    streamed ``message_delta`` usage arrives split over two body chunks and is read whole."""
    case = next(
        c
        for c in json.loads(
            (Path(__file__).parent / "fixtures/vllm-captures/anthropic-conversion.json").read_text()
        )["cases"]
        if c["label"] == "agent-turns"
    )
    cfg = await epp_router(fleet)
    async with serve_router(cfg) as (_base, router):
        await until(lambda: len(router.registry.healthy()) == 2, 10, "workers healthy")
        assert router.verifier is not None
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cfg.server.epp_port}") as ch:
            s = Stream(pb_grpc.ExternalProcessorStub(ch))
            await s.send(headers_msg(path="/v1/messages"), 0)
            body = {**case["request"], "model": "sim-model", "max_tokens": 2, "stream": True}
            data = json.dumps(body).encode()
            msg = pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=True))
            head, _ = await s.send(msg, 2)
            picked = destination(head)
            url = next(w.url for w in fleet if endpoint_of(w.url) == picked)
            before = router.verifier.state((url, 0)).samples
            hm = base_pb2.HeaderMap(
                headers=[
                    base_pb2.HeaderValue(key=":status", raw_value=b"200"),
                    base_pb2.HeaderValue(key="content-type", raw_value=b"text/event-stream"),
                ]
            )
            await s.send(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=hm)), 1)
            usage = {"input_tokens": 40, "output_tokens": 2, "cache_read_input_tokens": 0}
            event = (
                b"event: message_delta\ndata: "
                + json.dumps(
                    {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": usage}
                ).encode()
            )
            cut = event.index(b"cache_read") - 5  # the marks land in the second chunk
            for part, end in ((event[:cut], False), (event[cut:] + b"\n\n", True)):
                chunk = pb.HttpBody(body=part, end_of_stream=end)
                await s.send(pb.ProcessingRequest(response_body=chunk), 1)
            await s.close()
            st = router.verifier.state((url, 0))
            await until(lambda: st.samples == before + 1, 10, "the turn verified")
            assert st.reported_cached_tokens == 0
