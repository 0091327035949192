"""The least an ext_proc server in Python can do per message: the floor under the EPP's cost.

A ``grpc.aio`` ``ExternalProcessor`` (the same library and server setup as ``router/epp.py``)
that picks fixed endpoints in turn and, in FULL_DUPLEX_STREAMED mode, hands every body chunk
straight back (the request body in kvrouter's chunk size, so both send as many messages). No
parsing, no routing, no accounting: what it spends per streamed response chunk, and per request,
is what any Python EPP on grpcio spends before doing any work of its own. ``bench/epp_bench.py``
runs it behind the same Envoy as kvrouter's EPP and reports both.

Run: ``python -m bench.ext_proc_floor PORT ENDPOINTS [--threads]`` (``ENDPOINTS``: ``ip:port``
list, comma separated, picked in turn; ``--threads``: grpcio's thread-pool server instead of
asyncio).
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from router.epp import CHUNK

DEST = "x-gateway-destination-endpoint"


def _headers_response(endpoint: str) -> pb.ProcessingResponse:
    opt = base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=DEST, raw_value=endpoint.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )
    common = pb.CommonResponse(
        header_mutation=pb.HeaderMutation(set_headers=[opt]), clear_route_cache=True
    )
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common))


def _echo(field: str, body: bytes, eos: bool) -> pb.ProcessingResponse:
    mutation = pb.BodyMutation(
        streamed_response=pb.StreamedBodyResponse(body=body, end_of_stream=eos)
    )
    return pb.ProcessingResponse(
        **{field: pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation))}
    )


def _answer(endpoints: Iterator[str], req: pb.ProcessingRequest, body: bytearray) -> Iterator[Any]:
    kind = req.WhichOneof("request")
    if kind == "request_headers":
        if req.request_headers.end_of_stream:
            yield _headers_response(next(endpoints))
    elif kind == "request_body":
        body += req.request_body.body
        if req.request_body.end_of_stream:
            yield _headers_response(next(endpoints))
            data = bytes(body)
            last = max(len(data) - 1, 0) // CHUNK
            for i in range(last + 1):
                yield _echo("request_body", data[i * CHUNK : (i + 1) * CHUNK], i == last)
    elif kind == "request_trailers":
        yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
    elif kind == "response_headers":
        yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
    elif kind == "response_body":
        rb = req.response_body
        yield _echo("response_body", rb.body, rb.end_of_stream)
    elif kind == "response_trailers":
        yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


class Floor(pb_grpc.ExternalProcessorServicer):
    """The asyncio server, as router/epp.py runs it."""

    def __init__(self, endpoints: str) -> None:
        self.endpoints = itertools.cycle(endpoints.split(","))

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        body = bytearray()
        async for req in request_iterator:
            for resp in _answer(self.endpoints, req, body):
                yield resp


class ThreadedFloor(pb_grpc.ExternalProcessorServicer):
    """grpcio's thread-pool server: the other way grpcio serves a stream."""

    def __init__(self, endpoints: str) -> None:
        self.endpoints = itertools.cycle(endpoints.split(","))

    def Process(
        self, request_iterator: Iterator[pb.ProcessingRequest], context: Any
    ) -> Iterator[pb.ProcessingResponse]:
        body = bytearray()
        for req in request_iterator:
            yield from _answer(self.endpoints, req, body)


_OPTIONS = [
    ("grpc.max_receive_message_length", 16 << 20),
    ("grpc.max_send_message_length", 16 << 20),
]


async def serve(port: int, endpoints: str) -> None:
    server = grpc.aio.server(options=_OPTIONS)
    pb_grpc.add_ExternalProcessorServicer_to_server(Floor(endpoints), server)
    if not server.add_insecure_port(f"127.0.0.1:{port}"):
        raise OSError(f"cannot listen on 127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def serve_threaded(port: int, endpoints: str) -> None:
    server = grpc.server(ThreadPoolExecutor(max_workers=64), options=_OPTIONS)
    pb_grpc.add_ExternalProcessorServicer_to_server(ThreadedFloor(endpoints), server)
    if not server.add_insecure_port(f"127.0.0.1:{port}"):
        raise OSError(f"cannot listen on 127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


if __name__ == "__main__":
    if sys.argv[3:] == ["--threads"]:
        serve_threaded(int(sys.argv[1]), sys.argv[2])
    else:
        asyncio.run(serve(int(sys.argv[1]), sys.argv[2]))
