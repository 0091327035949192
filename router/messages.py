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
    "CACHE_MARKS",
    "HOP_BY_HOP",
    "WORKER_HEADER",
    "SseUsage",
    "cached_from_sse",
    "cached_tokens_of",
    "completion_tokens_in",
    "error_of",
    "error_response",
    "has_cache_usage",
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


ERROR_TEXT_CHARS = 300
"""An error answer whose message cannot be read is quoted up to this many characters."""


def error_of(content: bytes) -> tuple[str, str | None]:
    """A worker's error answer: its message and type (vLLM's ``{"error": {"message",
    "type"}}``; a top-level ``message`` or ``detail``, as FastAPI's own 404 says it, with no
    type), else the start of its text, at most :data:`ERROR_TEXT_CHARS` characters."""
    with contextlib.suppress(msgspec.DecodeError):
        doc = msgspec.json.decode(content)
        if isinstance(doc, dict):
            err = doc.get("error")
            if isinstance(err, dict) and isinstance(err.get("message"), str):
                etype = err.get("type")
                return err["message"], etype if isinstance(etype, str) else None
            for key in ("message", "detail"):
                if isinstance(doc.get(key), str):
                    return doc[key], None
    return content[:ERROR_TEXT_CHARS].decode(errors="replace").strip(), None


def sse_error_event(message: str, etype: str, code: int) -> bytes:
    doc = {"error": {"message": message, "type": etype, "code": code}}
    return b"data: " + msgspec.json.encode(doc) + b"\n\ndata: [DONE]\n\n"


_usage_dec = msgspec.json.Decoder()


CACHE_MARKS = (b"cached_tokens", b"cache_read_input_tokens")
"""Bytes that show a usage report with the prompt's cached tokens in it, in any API's shape."""


def has_cache_usage(data: bytes) -> bool:
    """Whether ``data`` may hold a usage report with cached tokens: a byte test that saves
    decoding the bodies and chunks that cannot."""
    return any(mark in data for mark in CACHE_MARKS)


def _usage(doc: Any) -> dict[str, Any] | None:
    """The usage report of an answer or stream event: at the top (chat, completions, an
    Anthropic ``message_delta``), in ``response`` (a Responses ``response.completed`` event)
    or in ``message`` (an Anthropic ``message_start``)."""
    if not isinstance(doc, dict):
        return None
    for holder in (doc, doc.get("response"), doc.get("message")):
        if isinstance(holder, dict) and isinstance(holder.get("usage"), dict):
            return holder["usage"]
    return None


def _count(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def cached_tokens_of(doc: Any) -> int | None:
    """The prompt tokens vLLM found cached: ``prompt_tokens_details.cached_tokens`` (chat and
    completions), ``input_tokens_details.cached_tokens`` (Responses API) or
    ``cache_read_input_tokens`` (Anthropic messages)."""
    usage = _usage(doc)
    if usage is None:
        return None
    for key in ("prompt_tokens_details", "input_tokens_details"):
        details = usage.get(key)
        if isinstance(details, dict) and _count(details.get("cached_tokens")) is not None:
            return details["cached_tokens"]
    return _count(usage.get("cache_read_input_tokens"))


def prompt_tokens_of(doc: Any) -> int | None:
    """The prompt's length as vLLM counted it: ``prompt_tokens``; a Responses answer's
    ``input_tokens``; an Anthropic answer's ``input_tokens`` (the part not read from the
    cache) plus its cache read and cache creation."""
    usage = _usage(doc)
    if usage is None:
        return None
    if _count(usage.get("prompt_tokens")) is not None:
        return usage["prompt_tokens"]
    n = _count(usage.get("input_tokens"))
    if n is None:
        return None
    if "input_tokens_details" in usage:
        return n
    read = _count(usage.get("cache_read_input_tokens"))
    if read is None:
        return None  # an Anthropic report without its cache fields: the total is not known
    return n + read + (_count(usage.get("cache_creation_input_tokens")) or 0)


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
        if line.startswith(b"data: {") and has_cache_usage(line):
            with contextlib.suppress(msgspec.DecodeError):
                doc = _usage_dec.decode(line[6:])
                v = cached_tokens_of(doc)
                if v is not None:
                    return v, prompt_tokens_of(doc)
    return None


class SseUsage:
    """The usage report with cached tokens in an SSE stream, read across reads: a data line
    split between two chunks is joined before it is parsed. A Responses stream puts its usage
    in ``response.completed``, one line carrying the whole response (instructions and tools
    included), which a read splits as often as not. ``usage`` holds the last report found as
    ``(cached_tokens, prompt_tokens)``.

    Bounded: an unterminated line is kept up to :data:`MAX_LINE` bytes; a longer one is
    dropped (its report, if any, is not read)."""

    MAX_LINE = 1 << 20

    __slots__ = ("_carry", "usage")

    def __init__(self) -> None:
        self._carry = b""
        self.usage: tuple[int, int | None] | None = None

    def feed(self, chunk: bytes) -> None:
        data = self._carry + chunk if self._carry else chunk
        end = data.rfind(b"\n") + 1
        rest = data[end:]
        self._carry = rest if len(rest) <= self.MAX_LINE else b""
        if end and has_cache_usage(data):
            found = cached_from_sse(data[:end])
            if found is not None:
                self.usage = found


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
