"""OpenTelemetry tracing (router/tracing.py), end to end over loopback.

Simulated workers sit behind a recording front (it keeps the headers of every request it
passes on), and spans go to a real OTLP/HTTP collector on loopback that decodes the protobuf
the router's exporter sends.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from starlette.requests import Request
from starlette.responses import Response
from test_router_support import FAST, config_for, serve_app, serve_router, until, words

from router.config import ConfigError, WorkerSpec, parse_config
from simulator.testing import running_fleet

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- an OTLP/HTTP collector


class Collector:
    """Accepts OTLP/HTTP trace exports on loopback; keeps every span and the export headers."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.resources: list[dict[str, Any]] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                req = ExportTraceServiceRequest.FromString(body)
                collector._add(req, {k.lower(): v for k, v in self.headers.items()})
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _add(self, req: ExportTraceServiceRequest, headers: dict[str, str]) -> None:
        self.headers.append(headers)
        for rs in req.resource_spans:
            self.resources.append(_attrs(rs.resource.attributes))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.spans.append(
                        {
                            "name": s.name,
                            "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(),
                            "parent": s.parent_span_id.hex() or None,
                            "kind": s.kind,
                            "status": s.status.code,
                            "status_message": s.status.message,
                            "attrs": _attrs(s.attributes),
                            "events": [(e.name, _attrs(e.attributes)) for e in s.events],
                            "start": s.start_time_unix_nano,
                            "end": s.end_time_unix_nano,
                        }
                    )

    def trace(self, trace_id: str) -> dict[str, dict[str, Any]]:
        """The spans of one trace by name."""
        return {s["name"]: s for s in self.spans if s["trace_id"] == trace_id}


def _attrs(kvs: Any) -> dict[str, Any]:
    out = {}
    for kv in kvs:
        v = kv.value
        out[kv.key] = getattr(v, v.WhichOneof("value"))
    return out


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    c.thread.start()
    try:
        yield c
    finally:
        c.server.shutdown()
        c.server.server_close()


@pytest.fixture(autouse=True)
def quick_export(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches leave within 50 ms (the SDK's standard variable; the default is 5 s)."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")


# ---------------------------------------------------------------- a worker that records headers


@pytest.fixture(scope="module")
def fleet() -> Iterator[list[Any]]:
    with running_fleet(2, num_gpu_blocks=512, **FAST) as workers:
        yield workers


@asynccontextmanager
async def recording(worker: Any) -> AsyncIterator[tuple[WorkerSpec, list[dict[str, str]]]]:
    """A front for a simulated worker that passes every request on and keeps the headers of
    each POST; yields the worker entry for the router (the front's URL, the worker's event
    endpoints) and the recorded headers."""
    seen: list[dict[str, str]] = []
    client = httpx.AsyncClient(base_url=worker.url, timeout=30)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        if request.method == "POST":
            seen.append({k.decode(): v.decode() for k, v in scope["headers"]})
        headers = [(k, v) for k, v in request.headers.raw if k not in (b"host", b"content-length")]
        r = await client.request(
            request.method,
            request.url.path,
            params=request.query_params,
            content=await request.body(),
            headers=headers,
        )
        drop = {"content-length", "transfer-encoding", "connection"}
        kept = {k: v for k, v in r.headers.items() if k.lower() not in drop}
        await Response(r.content, r.status_code, kept)(scope, receive, send)

    try:
        async with serve_app(app) as url:  # type: ignore[arg-type]
            yield (
                WorkerSpec(url=url, events=worker.events_endpoint, replay=worker.replay_endpoint),
                seen,
            )
    finally:
        await client.aclose()


def traced(workers: list[WorkerSpec], collector: Collector, **tracing: Any) -> Any:
    cfg = config_for([], policy={"speculative_ttl_s": 0.0})
    cfg.workers = workers
    cfg.tracing.enabled = True
    cfg.tracing.endpoint = collector.url
    for k, v in tracing.items():
        setattr(cfg.tracing, k, v)
    return cfg


def parent_of(traceparent: str) -> tuple[str, str, str]:
    """(trace id, parent span id, flags) of a W3C traceparent (flag 1: sampled)."""
    version, trace_id, span_id, flags = traceparent.split("-")
    assert version == "00"
    return trace_id, span_id, flags


async def ready(c: httpx.AsyncClient, base: str, router: Any) -> None:
    await until(lambda: all(w.subscribed for w in router.registry.workers.values()), 20)
    await until(lambda: c.get(base + "/ready"), 20)


# ---------------------------------------------------------------- tests


async def test_a_request_is_one_span_tree_that_the_worker_continues(fleet, collector):
    """Server span with tokenize, route and upstream children; the worker gets the upstream
    span's traceparent; the second send of a prompt shows the predicted hit on ``route`` and
    the worker's cached tokens on ``upstream``."""
    body = {"model": "sim-model", "prompt": words(400, "tree"), "max_tokens": 2}
    async with (
        recording(fleet[0]) as (w0, seen0),
        recording(fleet[1]) as (w1, seen1),
    ):
        cfg = traced([w0, w1], collector, headers={"x-collector-key": "k1"})
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            await ready(c, base, router)
            first = await c.post(base + "/v1/completions", json=body)
            assert first.status_code == 200, first.text
            worker = first.headers["x-kvrouter-worker"]

            async def indexed() -> bool:
                r = await c.post(base + "/debug/route", json=body)
                return r.json()["chosen"] == worker and r.json()["predicted_hit_tokens"] >= 384

            await until(indexed, 20, "the prompt's blocks in the index")
            r = await c.post(base + "/v1/completions", json=body)
            assert r.status_code == 200 and r.headers["x-kvrouter-worker"] == worker
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= 384
            rid = r.headers["x-request-id"]
            sent = [h for h in seen0 + seen1 if h.get("x-request-id") == rid]
            assert len(sent) == 1, sent
            trace_id, parent_span, flags = parent_of(sent[0]["traceparent"])
            assert int(flags, 16) & 1  # sampled
            spans = await until(
                lambda: len(collector.trace(trace_id)) >= 4 and collector.trace(trace_id), 10
            )

    server = spans["POST /v1/completions"]
    assert server["parent"] is None  # no incoming traceparent: a new trace
    assert server["kind"] == 2  # SPAN_KIND_SERVER
    assert server["attrs"]["http.response.status_code"] == 200
    assert server["attrs"]["kvrouter.request_id"] == r.headers["x-request-id"]
    for name in ("tokenize", "route", "upstream"):
        assert spans[name]["parent"] == server["span_id"], name
        assert server["start"] <= spans[name]["start"] <= spans[name]["end"] <= server["end"]
    assert spans["tokenize"]["end"] <= spans["route"]["start"] <= spans["upstream"]["start"]
    assert spans["tokenize"]["attrs"]["kvrouter.prompt_tokens"] >= 400
    route = spans["route"]["attrs"]
    assert route["kvrouter.worker"] == worker
    assert route["kvrouter.dp_rank"] == 0
    assert route["kvrouter.candidates"] == 2
    assert route["kvrouter.predicted_hit_tokens"] >= 384
    assert route["gen_ai.request.model"] == "sim-model"
    upstream = spans["upstream"]
    assert upstream["span_id"] == parent_span  # vLLM's spans hang under the upstream span
    assert upstream["kind"] == 3  # SPAN_KIND_CLIENT
    assert upstream["attrs"]["http.response.status_code"] == 200
    assert upstream["attrs"]["kvrouter.worker"] == worker
    assert upstream["attrs"]["kvrouter.cached_tokens"] == cached
    assert {"service.name": "kvrouter"}.items() <= collector.resources[0].items()
    assert all(h.get("x-collector-key") == "k1" for h in collector.headers)


async def test_a_clients_traceparent_is_continued_and_a_stream_records_ttft(fleet, collector):
    client_trace, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    headers = {"traceparent": f"00-{client_trace}-{client_span}-01", "tracestate": "acme=7"}
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": words(50, "chat")}],
        "max_tokens": 4,
        "stream": True,
    }
    async with recording(fleet[0]) as (w0, seen):
        cfg = traced([w0], collector)
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            await ready(c, base, router)
            sent_at = time.perf_counter()
            async with c.stream(
                "POST", base + "/v1/chat/completions", json=body, headers=headers
            ) as r:
                assert r.status_code == 200
                text = "".join([chunk async for chunk in r.aiter_text()])
            elapsed = time.perf_counter() - sent_at
            assert "[DONE]" in text
            spans = await until(
                lambda: len(collector.trace(client_trace)) >= 4 and collector.trace(client_trace),
                10,
            )
    sent = [h for h in seen if h.get("traceparent", "").startswith(f"00-{client_trace}-")]
    assert len(sent) == 1, seen
    _, parent_span, _ = parent_of(sent[0]["traceparent"])
    assert sent[0]["tracestate"] == "acme=7"
    server = spans["POST /v1/chat/completions"]
    assert server["parent"] == client_span
    assert spans["upstream"]["span_id"] == parent_span != client_span
    assert spans["upstream"]["parent"] == server["span_id"]
    ttft = spans["upstream"]["attrs"]["kvrouter.ttft_s"]
    assert 0 < ttft < elapsed  # the router's clock starts after the client's, stops earlier


async def test_a_refused_request_ends_its_spans_with_the_error(fleet, collector):
    async with recording(fleet[0]) as (w0, _seen):
        cfg = traced([w0], collector)
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            await ready(c, base, router)
            tid = "0af7651916cd43dd8448eb211c80319c"
            r = await c.post(
                base + "/v1/completions",
                json={"model": "no-such-model", "prompt": "hi", "max_tokens": 1},
                headers={"traceparent": f"00-{tid}-b7ad6b7169203331-01"},
            )
            assert r.status_code == 404
            spans = await until(lambda: len(collector.trace(tid)) >= 2 and collector.trace(tid), 10)
    # The unknown model is refused before any tokenization: no tokenize span.
    assert set(spans) == {"POST /v1/completions", "route"}
    server = spans["POST /v1/completions"]
    assert server["attrs"]["http.response.status_code"] == 404
    assert server["attrs"]["error.type"] == "404"
    assert "does not exist" in server["attrs"]["kvrouter.error"]
    assert spans["route"]["status"] == 2  # STATUS_CODE_ERROR
    assert "does not exist" in spans["route"]["status_message"]
    assert spans["route"]["end"] <= server["end"]


async def test_sample_ratio_zero_exports_nothing_but_still_propagates(fleet, collector):
    body = {"model": "sim-model", "prompt": words(20, "unsampled"), "max_tokens": 1}
    async with recording(fleet[0]) as (w0, seen):
        cfg = traced([w0], collector, sample_ratio=0.0)
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            await ready(c, base, router)
            r = await c.post(base + "/v1/completions", json=body)
            assert r.status_code == 200
    # Router.stop flushed the exporter: whatever was recorded has arrived by now.
    assert collector.spans == []
    sent = [h for h in seen if h.get("x-request-id") == r.headers["x-request-id"]]
    assert not int(parent_of(sent[0]["traceparent"])[2], 16) & 1  # not sampled, said so


async def test_tracing_off_adds_no_traceparent(fleet):
    body = {"model": "sim-model", "prompt": words(20, "off"), "max_tokens": 1}
    client = {"traceparent": "00-11111111111111111111111111111111-2222222222222222-01"}
    async with recording(fleet[0]) as (w0, seen):
        cfg = config_for([])
        cfg.workers = [w0]
        async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
            assert router.tracer is None
            await ready(c, base, router)
            plain = await c.post(base + "/v1/completions", json=body)
            theirs = await c.post(base + "/v1/completions", json=body, headers=client)
    assert plain.status_code == theirs.status_code == 200
    by_id = {h.get("x-request-id"): h for h in seen}
    assert "traceparent" not in by_id[plain.headers["x-request-id"]]
    # A client's own header passes through untouched, as every other header does.
    assert by_id[theirs.headers["x-request-id"]]["traceparent"] == client["traceparent"]


_OFF_SCRIPT = """
import asyncio, sys
import httpx
sys.path.insert(0, "tests")
from test_router_support import config_for, serve_router, until

async def main():
    cfg = config_for([sys.argv[1]])
    async with serve_router(cfg) as (base, router), httpx.AsyncClient(timeout=30) as c:
        await until(lambda: c.get(base + "/ready"), 20)
        body = {"model": "sim-model", "prompt": "one two three", "max_tokens": 1}
        assert (await c.post(base + "/v1/completions", json=body)).status_code == 200
    sdk = ("opentelemetry.sdk", "opentelemetry.exporter")
    print(sorted(m for m in sys.modules if m.startswith(sdk)))
    print("router.tracing" in sys.modules)

asyncio.run(main())
"""


async def test_tracing_off_imports_no_opentelemetry_sdk(fleet):
    """FastAPI imports the OpenTelemetry API itself; the SDK and the exporter stay out."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _OFF_SCRIPT, fleet[0].url,
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert out.decode().split() == ["[]", "True"]


def test_enabled_without_the_extra_is_a_clear_startup_error():
    script = (
        "import sys; sys.modules['opentelemetry.sdk'] = None\n"  # as if not installed
        "from router.cli import main\n"
        "sys.exit(main(['serve', '--worker', 'http://127.0.0.1:9']))\n"
    )
    env = {**os.environ, "PYTHONPATH": ROOT, "KVROUTER_TRACING_ENABLED": "true"}
    p = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 2, p.stderr
    assert "tracing.enabled" in p.stderr
    assert "pip install 'kvrouter[tracing]'" in p.stderr


def test_tracing_section_is_validated_and_read_from_env():
    cfg = parse_config(
        {"tracing": {"enabled": True, "endpoint": "http://otel:4318/v1/traces"}},
        env={"KVROUTER_TRACING_SAMPLE_RATIO": "0.25", "KVROUTER_TRACING_SERVICE_NAME": "gw"},
    )
    assert (cfg.tracing.sample_ratio, cfg.tracing.service_name) == (0.25, "gw")
    assert parse_config({}).tracing.enabled is False
    with pytest.raises(ConfigError, match=r"tracing\.sample_ratio"):
        parse_config({"tracing": {"sample_ratio": 1.5}})
    with pytest.raises(ConfigError, match=r"tracing\.endpoint"):
        parse_config({"tracing": {"endpoint": "otel:4317"}})
    with pytest.raises(ConfigError, match=r"unknown key tracing\.sampler"):
        parse_config({"tracing": {"sampler": "always_on"}})


def test_service_name_is_the_configs_then_otel_service_name_then_kvrouter(monkeypatch):
    from router.tracing import Tracer, TracingConfig

    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    names = []
    for configured, env in ((None, None), (None, "from-env"), ("from-config", "from-env")):
        if env is None:
            monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
        else:
            monkeypatch.setenv("OTEL_SERVICE_NAME", env)
        t = Tracer(TracingConfig(enabled=True, service_name=configured))
        names.append(t.provider.resource.attributes["service.name"])
        t.shutdown()
    assert names == ["kvrouter", "from-env", "from-config"]
