"""Where a stored Responses API response lives.

vLLM started with ``VLLM_ENABLE_RESPONSES_API_STORE=1`` keeps every ``/v1/responses`` answer
(its id: the request's ``request_id``, else ``resp_<uuid>``) in the memory of the server that
produced it. A later request naming it (``previous_response_id``), ``GET
/v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel`` find it on that server only;
anywhere else vLLM answers 404. So the router notes which engine answered each id and sends
those requests there, whatever the cache or the load say.

The notes live in the session table (router/sessions.py, shared between replicas through Redis)
under keys of their own: bounded by ``session.max_sessions``, kept ``session.ttl_s`` after
their last use. An id the router never saw answered (another gateway, an expired note) is
routed by load.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["RESPONSES", "SCAN_BYTES", "named_id", "owner_key", "response_id_in", "stored_path"]

RESPONSES = "/v1/responses"

SCAN_BYTES = 65_536
"""An answer's id is read from at most its first this many bytes (it is the first field of
the response object, and of the first event of a stream: ``response.created``)."""

_ID = re.compile(rb'"id"\s*:\s*"([^"\\]{1,256})"')
_STORED = re.compile(r"^/v1/responses/([^/]{1,256})(/cancel)?$")


def response_id_in(data: bytes) -> str | None:
    """The first ``"id"`` of an answer's leading bytes: the response's id."""
    m = _ID.search(data, 0, SCAN_BYTES)
    return m.group(1).decode("latin-1") if m else None


def owner_key(response_id: str) -> str:
    """The session-table key noting the engine that holds ``response_id``."""
    return "response:" + response_id


def named_id(path: str, body: dict[str, Any] | None) -> str | None:
    """The stored response a request names: the one its path is about (:func:`stored_path`),
    or the one a ``/v1/responses`` body continues (``previous_response_id``)."""
    held = stored_path(path)
    if held is not None:
        return held[0]
    prev = body.get("previous_response_id") if path == RESPONSES and body is not None else None
    return prev if isinstance(prev, str) and prev else None


def stored_path(path: str) -> tuple[str, bool] | None:
    """``(id, cancel)`` for ``/v1/responses/{id}`` and ``/v1/responses/{id}/cancel``."""
    m = _STORED.match(path)
    return (m.group(1), m.group(2) is not None) if m else None
