"""kvrouter as a Gateway API Inference Extension Endpoint Picker (EPP).

A gRPC ``envoy.service.ext_proc.v3.ExternalProcessor`` server: the gateway (Envoy, or any
data plane speaking ext_proc) streams each request's headers and body to it, kvrouter picks the
engines (router/epp_core.py, the same routing core as the HTTP proxy) and answers with

* header ``x-gateway-destination-endpoint: ip:port[,ip:port...]`` (best first; as many as
  ``server.epp_endpoints``) and the same value as dynamic metadata
  ``envoy.lb`` / ``x-gateway-destination-endpoint``, with ``clear_route_cache`` so the route
  (and its cluster) is chosen again with the header set;
* an ImmediateResponse 503 when no endpoint is eligible, 429 when every eligible one is at its
  request limit, 400 / 413 for bodies the proxy rejects too, and the proxy's 401 / 429 for API
  keys and their per-key limits (router/client_auth.py; same OpenAI-style JSON).

The gateway may restrict the pick with ``envoy.lb.subset_hint`` /
``x-gateway-destination-endpoint-subset`` (a list of ``ip:port``) in the request's metadata.

**Request body modes** (from ``protocol_config``, which Envoy sends in the first message):
FULL_DUPLEX_STREAMED (what GAIE gateways configure) defers the headers response until the body
is complete, then answers headers, then streams the body back (62,000-byte chunks, under Envoy's
64 KiB). BUFFERED answers the headers at once and puts the pick on the body response (header
mutations there take effect in that mode). Without a usable body (NONE, STREAMED, or a request
without one) the pick is made at the headers by load only (or, for a stored Responses API
answer, where it lives). A message without ``protocol_config`` is taken as FULL_DUPLEX_STREAMED.
Other vLLM APIs are picked as the proxy routes them (router/passthrough.py), their bodies never
rewritten.

**Response path**: the served endpoint (``envoy.lb`` / ``x-gateway-destination-endpoint-served``
in the metadata, else the same-named response header, else the primary pick) carries the load
and the speculative entry; queued prefill is released at the first response chunk, and the
usage in a response body streamed through is checked against the prediction. With response
body mode NONE only the headers come: the load is released when the gateway ends the stream,
and nothing is verified.

``grpc.health.v1`` answers for ``""``, ``liveness`` (always serving), ``readiness``,
``inference-extension`` and the ext_proc service (serving when the router is ready).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
import msgspec
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router import passthrough
from router import stored_responses as stored
from router.core import Router
from router.epp_core import Pick, Picker, RequestState
from router.errors import BodyError
from router.messages import (
    SseUsage,
    cached_tokens_of,
    completion_tokens_in,
    has_cache_usage,
    prompt_tokens_of,
)
from router.verify import StreamUsageFilter

__all__ = ["DESTINATION", "SERVED", "SUBSET", "EppServer", "serve_epp"]

log = logging.getLogger("kvrouter.epp")

DESTINATION = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
CHUNK = 62_000
"""Largest body chunk sent back (Envoy's limit per streamed chunk is 64 KiB)."""

_Mode = processing_mode_pb2.ProcessingMode
DUPLEX = _Mode.FULL_DUPLEX_STREAMED
BUFFERED = (_Mode.BUFFERED, _Mode.BUFFERED_PARTIAL)
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_ROUTES = {"/v1/completions": False, "/v1/chat/completions": True}
_json = msgspec.json.Decoder()
_COMPLETION = b'"completion_tokens"'


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE
    )


def _headers_of(hm: Any) -> dict[str, str]:
    return {h.key: h.raw_value.decode("latin-1") if h.raw_value else h.value for h in hm.headers}


def _immediate(exc: BodyError) -> pb.ProcessingResponse:
    """The proxy's answer to the same error, as an ImmediateResponse."""
    body = bytes(exc.response().body)
    headers = [_header("content-type", "application/json")]
    headers += [_header(k, v) for k, v in exc.headers.items()]
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=exc.status),
            headers=pb.HeaderMutation(set_headers=headers),
            body=body,
            details=f"kvrouter_epp_{exc.status}",
        )
    )


def _metadata_string(req: pb.ProcessingRequest, namespace: str, key: str) -> str | None:
    fm = req.metadata_context.filter_metadata
    if namespace not in fm:
        return None
    v = fm[namespace].fields.get(key)
    if v is None or v.WhichOneof("kind") != "string_value":
        return None
    return v.string_value or None


def _subset_of(req: pb.ProcessingRequest) -> list[str] | None:
    """The gateway's subset hint: a list of ``ip:port`` (a comma-separated string is taken too).
    None when absent; an empty list restricts to nothing (503)."""
    fm = req.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in fm:
        return None
    v = fm[SUBSET_NAMESPACE].fields.get(SUBSET)
    if v is None:
        return None
    kind = v.WhichOneof("kind")
    if kind == "list_value":
        return [x.string_value.strip() for x in v.list_value.values if x.string_value]
    if kind == "string_value":
        return [s.strip() for s in v.string_value.split(",") if s.strip()]
    return []


def _streamed(field: str, data: bytes, eos: bool) -> pb.ProcessingResponse:
    """A FULL_DUPLEX_STREAMED body chunk handed back. Built from the outside in: nested
    constructors would copy ``data`` once per level."""
    r = pb.ProcessingResponse()
    sr = getattr(r, field).response.body_mutation.streamed_response
    sr.body = data
    sr.end_of_stream = eos
    return r


def _body_chunks(data: bytes, eos: bool) -> list[pb.ProcessingResponse]:
    if len(data) <= CHUNK:
        return [_streamed("request_body", data, eos)]
    last = (len(data) - 1) // CHUNK
    return [
        _streamed("request_body", data[i * CHUNK : (i + 1) * CHUNK], eos and i == last)
        for i in range(last + 1)
    ]


def _destination(endpoints: str) -> struct_pb2.Struct:
    """The pick as dynamic metadata: ``envoy.lb`` / ``x-gateway-destination-endpoint``."""
    s = struct_pb2.Struct()
    s.fields[DESTINATION_NAMESPACE].struct_value.fields[DESTINATION].string_value = endpoints
    return s


class Exchange:
    """One ext_proc stream: one HTTP request and its response (see the module docstring)."""

    def __init__(self, picker: Picker) -> None:
        self.p = picker
        self.max_body = picker.cfg.server.max_body_bytes
        self.body_mode: int = DUPLEX
        self.resp_mode: int = _Mode.NONE
        self.chat: bool | None = None
        self.parts: list[bytes] = []
        """The request body's chunks as they came (joined once, when complete)."""
        self.size = 0
        self.key: str | None = None
        self.subset: list[str] | None = None
        self.headers: dict[str, str] = {}
        self.path = ""
        self.scan = 0
        """Bytes of a ``/v1/responses`` answer still to read for its id."""
        self.t0 = 0.0
        self.decided = False
        self.state: RequestState | None = None
        self.strip: StreamUsageFilter | None = None
        self.sse = False
        self.usage = SseUsage()
        """The usage report of an SSE answer the router did not ask usage for (passthrough)."""
        self.ended = False
        """An ImmediateResponse was sent: the gateway stops consulting this stream."""
        self.response_done = False

    async def handle(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        kind = req.WhichOneof("request")
        if kind == "response_body":
            return self.on_response_body(req.response_body)
        if kind == "request_headers":
            return await self.on_request_headers(req)
        if kind == "request_body":
            return await self.on_request_body(req.request_body)
        if kind == "request_trailers":
            out = [] if self.decided else await self.decide(trailers=True)
            return [*out, pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if kind == "response_headers":
            return self.on_response_headers(req)
        if kind == "response_trailers":
            self.end_response()
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    # ---------------------------------------------------------------- request path

    async def on_request_headers(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self.t0 = time.perf_counter()
        if req.HasField("protocol_config"):
            self.body_mode = req.protocol_config.request_body_mode
            self.resp_mode = req.protocol_config.response_body_mode
        rh = req.request_headers
        headers = self.headers = _headers_of(rh.headers)
        self.path = headers.get(":path", "").split("?", 1)[0]
        self.chat = _ROUTES.get(self.path)
        self.subset = _subset_of(req)
        try:  # a listing (GET, as the proxy's /v1/models) is checked but costs no request
            charge = headers.get(":method") != "GET"
            self.key = await self.p.admit(headers.get("authorization"), charge)
        except BodyError as exc:
            return self.reject(exc)
        cl = headers.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > self.max_body:
            n = int(cl)
            return self.reject(
                BodyError(413, f"request body of {n} bytes exceeds the limit of {self.max_body}")
            )
        if rh.end_of_stream or (self.body_mode != DUPLEX and self.body_mode not in BUFFERED):
            return await self.pick_now()
        if self.body_mode == DUPLEX:
            return []  # answered with the body, once it is complete
        return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]

    async def pick_now(self) -> list[pb.ProcessingResponse]:
        """No body to route by: pick by load (or the holder of the stored response the path
        names), answer the headers with it."""
        self.decided = True
        try:
            pick = await self.pick_other(None)
        except BodyError as exc:
            return self.reject(exc)
        common = self.start(pick, None, changed=False)
        return [
            pb.ProcessingResponse(
                request_headers=pb.HeadersResponse(response=common), **self.meta(pick)
            )
        ]

    async def on_request_body(self, hb: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.decided:  # a body after a headers-time pick: pass it on unchanged
            if self.body_mode == DUPLEX:
                return _body_chunks(hb.body, hb.end_of_stream)
            return [pb.ProcessingResponse(request_body=pb.BodyResponse())]
        self.parts.append(hb.body)
        self.size += len(self.parts[-1])
        if self.size > self.max_body:
            return self.reject(
                BodyError(413, f"request body exceeds the limit of {self.max_body} bytes")
            )
        if self.body_mode == DUPLEX and not hb.end_of_stream:
            return []
        return await self.decide(trailers=False)

    async def decide(self, trailers: bool) -> list[pb.ProcessingResponse]:
        """The body is complete: pick, then answer headers + body (duplex) or body (buffered)."""
        self.decided = True
        parts, self.parts = self.parts, []
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        try:
            if self.chat is None:
                parsed, pick = None, await self.pick_other(data)
                await self.p.spend_prompt(self.key, pick)
            else:
                parsed = self.p.parse(data, self.chat)
                pick = await self.p.pick(
                    parsed, self.chat, self.subset, self.headers, self.key, size=len(data)
                )
                await self.p.spend_prompt(self.key, pick)
        except BodyError as exc:
            return self.reject(exc)
        new = data
        if parsed is not None:
            usage = self.resp_mode in (DUPLEX, _Mode.STREAMED)
            new, strip = self.p.upstream_body(parsed, data, pick, usage=usage)
            self.strip = StreamUsageFilter() if strip else None
        common = self.start(pick, len(new), changed=new is not data)
        meta = self.meta(pick)
        if self.body_mode == DUPLEX:
            head = pb.ProcessingResponse(
                request_headers=pb.HeadersResponse(response=common), **meta
            )
            return [head, *_body_chunks(new, not trailers)]
        if new is not data:
            common.body_mutation.body = new
        return [pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), **meta)]

    async def pick_other(self, data: bytes | None) -> Pick:
        """The rest of vLLM's API (router/passthrough.py), as the proxy routes it: by the prompt
        the Responses and Anthropic bodies carry as chat messages, to the holder of a stored
        response a request names, else by load. The body is never rewritten."""
        body = None
        if data and self.path in passthrough.BY_CACHE:
            body = passthrough.parse(data, self.headers.get("content-type", ""))
        prompt, traits = await self.p.router.read_prompt(self.path, body)
        if self.path == stored.RESPONSES:
            self.scan = stored.SCAN_BYTES  # its answer's id is noted (on_response_body)
        rid = stored.named_id(self.path, body)
        owner = await self.p.owner(rid) if rid is not None else None
        if prompt is None and owner is None:
            return self.p.pick_by_load(self.subset)
        routed = passthrough.routing_body(body, prompt, traits)
        return await self.p.pick(
            routed,
            True,
            self.subset,
            self.headers,
            self.key,
            tokenize=prompt is not None,
            owner=owner,
            session_body=body or {},
            size=len(data) if data else 0,
        )

    def start(self, pick: Pick, size: int | None, changed: bool) -> pb.CommonResponse:
        self.state = self.p.start(pick, self.t0, self.key)
        hdrs = [_header(DESTINATION, ",".join(pick.endpoints))]
        rank = self.p.dp_rank(pick.engines[0])
        if rank is not None:
            hdrs.append(_header("x-data-parallel-rank", str(rank)))
        if size is not None and (changed or self.body_mode == DUPLEX):
            hdrs.append(_header("content-length", str(size)))
        return pb.CommonResponse(
            header_mutation=pb.HeaderMutation(set_headers=hdrs), clear_route_cache=True
        )

    def meta(self, pick: Pick) -> dict[str, Any]:
        return {"dynamic_metadata": _destination(",".join(pick.endpoints))}

    def reject(self, exc: BodyError) -> list[pb.ProcessingResponse]:
        self.ended = True
        self.p.count_rejected(exc.status)
        return [_immediate(exc)]

    # ---------------------------------------------------------------- response path

    def on_response_headers(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        rh = req.response_headers
        headers = _headers_of(rh.headers)
        st = self.state
        mutation = pb.HeaderMutation()
        if SERVED in headers:
            mutation.remove_headers.append(SERVED)
        if st is not None:
            served = _metadata_string(req, DESTINATION_NAMESPACE, SERVED) or headers.get(SERVED)
            status = int(headers.get(":status", "0") or 0)
            self.p.served(st, served, status)
            self.sse = headers.get("content-type", "").startswith("text/event-stream")
            if st.engine is not None:
                mutation.set_headers.append(_header("x-kvrouter-worker", st.engine[0]))
            if not self.sse:
                self.strip = None
            if self.resp_mode == _Mode.NONE or rh.end_of_stream:
                self.p.first_chunk(st)  # nothing more will come through this stream
            if rh.end_of_stream:
                self.end_response()
        common = pb.CommonResponse(header_mutation=mutation)
        return [pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=common))]

    def on_response_body(self, hb: pb.HttpBody) -> list[pb.ProcessingResponse]:
        st = self.state
        chunk = hb.body
        out = chunk
        if st is not None:
            if st.ttft_s is None:
                self.p.first_chunk(st)
            if st.status == 200 and _COMPLETION in chunk:
                st.completion = completion_tokens_in(chunk)
            if self.scan > 0 and st.status == 200:  # a stored response's id: note its holder
                rid = stored.response_id_in(chunk)
                self.scan = 0 if rid is not None else self.scan - len(chunk)
                if rid is not None:
                    self.p.note_owner(st, rid)
            if self.strip is not None:
                out = self.strip.feed(chunk)
                if hb.end_of_stream:
                    out += self.strip.flush()
                if self.strip.usage is not None:
                    st.cached, st.prompt = self.strip.usage
            elif self.resp_mode in BUFFERED:
                self.usage_of_json(st, chunk)
            elif self.sse:
                self.usage.feed(chunk)
                if self.usage.usage is not None:
                    st.cached, st.prompt = self.usage.usage
            else:
                self.usage_of_json(st, chunk)
            if hb.end_of_stream:
                self.end_response()
        if self.resp_mode == DUPLEX:
            return [_streamed("response_body", out, hb.end_of_stream)]
        if out is not chunk:
            common = pb.CommonResponse(body_mutation=pb.BodyMutation(body=out))
        else:
            common = None
        return [pb.ProcessingResponse(response_body=pb.BodyResponse(response=common))]

    @staticmethod
    def usage_of_json(st: RequestState, data: bytes) -> None:
        if st.status != 200 or not has_cache_usage(data):
            return
        with contextlib.suppress(msgspec.DecodeError):
            doc = _json.decode(data)
            st.cached, st.prompt = cached_tokens_of(doc), prompt_tokens_of(doc)

    def end_response(self) -> None:
        self.response_done = True
        if self.state is not None:
            self.p.finish(self.state)

    def close(self) -> None:
        """The gateway ended the stream. With response body mode NONE the response headers
        were the last message; otherwise a stream that ends before the response did is a
        request the client (or the gateway) gave up on."""
        st = self.state
        if st is None or st.finished:
            return
        complete = self.response_done or (self.resp_mode == _Mode.NONE and st.status is not None)
        self.p.finish(st, aborted=not complete)


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, picker: Picker) -> None:
        self.picker = picker

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        ex = Exchange(self.picker)
        try:
            async for req in request_iterator:
                for resp in await ex.handle(req):
                    yield resp
                if ex.ended:
                    return
        except Exception:
            log.exception("ext_proc stream failed")
            raise
        finally:
            ex.close()


class Health(health_pb2_grpc.HealthServicer):
    """``grpc.health.v1`` computed on each call from the router's readiness."""

    SERVICES = ("", "readiness", "inference-extension", SERVICE)

    def __init__(self, picker: Picker) -> None:
        self.picker = picker

    def status(self, service: str) -> int | None:
        S = health_pb2.HealthCheckResponse
        if service == "liveness":
            return S.SERVING
        if service in self.SERVICES:
            return S.SERVING if self.picker.ready()[0] else S.NOT_SERVING
        return None

    async def Check(self, request: Any, context: Any) -> Any:
        st = self.status(request.service)
        if st is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=st)

    async def Watch(self, request: Any, context: Any) -> AsyncIterator[Any]:
        last = None
        while True:
            st = self.status(request.service)
            if st is None:
                st = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            if st != last:
                last = st
                yield health_pb2.HealthCheckResponse(status=st)
            await asyncio.sleep(1.0)


def self_signed_pair(hosts: Iterable[str] = ("localhost",)) -> tuple[bytes, bytes]:
    """(private key PEM, certificate PEM) made now: gateways that speak TLS to the EPP (GAIE's
    default) do not validate it, they only want the channel encrypted."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvrouter-epp")])
    now = datetime.datetime.now(datetime.UTC)
    alt: list[x509.GeneralName] = []
    for h in hosts:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            alt.append(x509.DNSName(h))
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


class EppServer:
    """The gRPC server: ext_proc + health on ``host:port``, plaintext or TLS."""

    def __init__(self, router: Router, port: int, *, host: str = "0.0.0.0", tls: bool = False):
        self.picker = Picker(router)
        self.port = port
        self.host = host
        self.tls = tls
        self.server: grpc.aio.Server | None = None

    async def start(self) -> None:
        limit = self.picker.cfg.server.max_body_bytes + (1 << 20)
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
            ]
        )
        pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(self.picker), server)
        health_pb2_grpc.add_HealthServicer_to_server(Health(self.picker), server)
        host = f"[{self.host}]" if ":" in self.host else self.host
        addr = f"{host}:{self.port}"
        if self.tls:
            creds = grpc.ssl_server_credentials([self_signed_pair(("localhost", "127.0.0.1"))])
            bound = server.add_secure_port(addr, creds)
        else:
            bound = server.add_insecure_port(addr)
        if not bound:
            raise OSError(f"EPP could not listen on {addr}")
        await server.start()
        self.server = server
        log.info("EPP (ext_proc) listening on %s (%s)", addr, "TLS" if self.tls else "plaintext")

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=1.0)
            self.server = None


async def serve_epp(router: Router) -> EppServer | None:
    """Start the EPP when ``server.epp_port`` is set (None otherwise)."""
    sc = router.cfg.server
    if sc.epp_port is None:
        return None
    srv = EppServer(router, sc.epp_port, host=sc.host, tls=sc.epp_tls)
    await srv.start()
    return srv
