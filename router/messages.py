"""The gateway's message shapes, apart from bodies it forwards untouched: which headers cross
it, the OpenAI-style error answer and its SSE form, and the usage a worker reports.

Shared by the HTTP proxy, the Endpoint Picker, the self-check and ``kvrouter doctor``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import httpx
import msgspec
from starlette.responses import JSONResponse, Response

__all__ = [
    "HOP_BY_HOP",
    "WORKER_HEADER",
    "cached_from_sse",
    "cached_tokens_of",
    "completion_tokens_in",
    "error_response",
    "prompt_tokens_of",
    "request_headers",
    "response_headers",
    "sse_error_event",
]

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
_RESP_DROP = HOP_BY_HOP | {"date", "server", "x-request-id"}
"""``x-request-id``: the router sets its own (router/access.py), vLLM may echo the same."""
WORKER_HEADER = "x-kvrouter-worker"


def error_response(
    status: int, message: str, etype: str, code: str | int | None = None
) -> Response:
    return JSONResponse(
        {
            "error": {
                "message": message,
                "type": etype,
                "code": code if code is not None else status,
            }
        },
        status_code=status,
    )


def sse_error_event(message: str, etype: str, code: int) -> bytes:
    doc = {"error": {"message": message, "type": etype, "code": code}}
    return b"data: " + msgspec.json.encode(doc) + b"\n\ndata: [DONE]\n\n"


_usage_dec = msgspec.json.Decoder()


def cached_tokens_of(doc: Any) -> int | None:
    if not isinstance(doc, dict):
        return None
    usage = doc.get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return details["cached_tokens"]
    return None


def prompt_tokens_of(doc: Any) -> int | None:
    usage = doc.get("usage") if isinstance(doc, dict) else None
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        return usage["prompt_tokens"]
    return None


_COMPLETION_KEY = b'"completion_tokens"'


def completion_tokens_in(data: bytes) -> int | None:
    """``usage.completion_tokens`` of a response body or SSE chunk: the last one in ``data``
    (a stream with continuous usage repeats it, growing). A byte scan rather than a JSON decode:
    it runs on every answer, and a body without the key costs one ``rfind``."""
    i = data.rfind(_COMPLETION_KEY)
    if i < 0:
        return None
    j = i + len(_COMPLETION_KEY)
    n = len(data)
    while j < n and data[j] in b" \t:":
        j += 1
    k = j
    while k < n and 48 <= data[k] <= 57:
        k += 1
    return int(data[j:k]) if k > j else None


def cached_from_sse(chunk: bytes) -> tuple[int, int | None] | None:
    """(cached_tokens, prompt_tokens) of the usage event in an SSE chunk, if any."""
    for line in chunk.split(b"\n"):
        if line.startswith(b"data: {") and b"cached_tokens" in line:
            with contextlib.suppress(msgspec.DecodeError):
                doc = _usage_dec.decode(line[6:])
                v = cached_tokens_of(doc)
                if v is not None:
                    return v, prompt_tokens_of(doc)
    return None


def request_headers(
    headers: list[tuple[bytes, bytes]], forward_authorization: bool
) -> list[tuple[bytes, bytes]]:
    out = []
    for k, v in headers:
        lk = k.lower().decode("latin-1")
        if lk in HOP_BY_HOP:
            continue
        if lk == "authorization" and not forward_authorization:
            continue
        out.append((k, v))
    return out


def response_headers(resp: httpx.Response, worker: str) -> list[tuple[bytes, bytes]]:
    out = [(k, v) for k, v in resp.headers.raw if k.lower().decode("latin-1") not in _RESP_DROP]
    out.append((WORKER_HEADER.encode(), worker.encode()))
    return out
