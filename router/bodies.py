"""A proxied request's body: read within its bound, parsed as a JSON object, checked as vLLM would.

Shared by the HTTP front (router/app.py, router/handlers.py) and the Endpoint Picker
(router/epp_core.py), so both refuse the same bodies with the same answers.
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import Request
from starlette.requests import ClientDisconnect

from router.errors import BodyError

__all__ = ["parse_json_object", "read_body", "validate_request"]

_dec = msgspec.json.Decoder()


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, at most ``limit`` bytes (413 past it, by Content-Length or as counted).

    Reads the ASGI messages directly rather than through ``Request.headers``/``stream()``: that
    machinery costs a measurable share of the proxy path's budget, where the body usually
    arrives in one message (docs/benchmarks.md)."""
    cl = next((v for k, v in request.scope["headers"] if k == b"content-length"), None)
    if cl is not None:
        try:
            n = int(cl)
        except ValueError:
            raise BodyError(400, "invalid Content-Length header") from None
        if n > limit:
            raise BodyError(413, f"request body of {n} bytes exceeds the limit of {limit} bytes")
    receive = request.receive
    parts = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # http.disconnect: nothing more will come
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyError(413, f"request body exceeds the limit of {limit} bytes")
        if not message.get("more_body", False):
            if not parts:
                return chunk
            parts.append(chunk)
            return b"".join(parts)
        parts.append(chunk)


def parse_json_object(data: bytes) -> dict[str, Any]:
    if not data:
        raise BodyError(400, "request body is empty; expected a JSON object")
    try:
        body = _dec.decode(data)
    except msgspec.DecodeError as exc:
        raise BodyError(400, f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise BodyError(400, "request body must be a JSON object")
    return body


def validate_request(body: dict[str, Any], chat: bool) -> None:
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BodyError(400, "'messages' must be a non-empty list")
    elif "prompt" not in body:
        raise BodyError(400, "'prompt' is required")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BodyError(400, "'stream' must be a boolean")
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise BodyError(400, "'cache_salt' must be a string")
