"""Request ids and access lines of the proxied requests (``/v1/completions``,
``/v1/chat/completions``).

Every request gets an id: the client's ``x-request-id`` when it sent a usable one, else one made
here (a per-process random prefix and a counter: unique across replicas, and cheaper than a
UUID). The id goes to the worker in ``x-request-id`` (vLLM names its request after it) and back
to the client in the response's ``x-request-id``.

One access line per request, logged by ``kvrouter.access`` at INFO when the request ends (so
``server.log_level: warning`` turns them off), with the decision and what came of it; its fields
(``server.log_format: json`` puts them at the top level of the line):

``request_id``, ``path``, ``model``, ``status``, ``duration_s`` (arrival to the end of the
response), ``ttft_s`` (streams: arrival to the first chunk), ``worker`` and ``dp_rank`` (the
engine that served it), ``predicted_hit_tokens`` (the router's prediction for the engine it
chose), ``prompt_tokens`` (the router's count), ``cached_tokens`` and ``completion_tokens`` (the
usage the worker reported), and ``error`` for requests refused before routing.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterable
from typing import Any

__all__ = ["HEADER", "enabled", "log_request", "request_id"]

HEADER = b"x-request-id"
_MAX_ID = 128
"""Longer client ids are replaced: they would bloat every log line and the worker's ids."""

_prefix = os.urandom(4).hex()
_seq = itertools.count(1)
_log = logging.getLogger("kvrouter.access")


def request_id(headers: Iterable[tuple[bytes, bytes]]) -> tuple[str, bool]:
    """The request's id and whether the client sent it (ASGI headers: lower-case names)."""
    for k, v in headers:
        if k == HEADER:
            if 0 < len(v) <= _MAX_ID and v.isascii():
                return v.decode("ascii"), True
            break
    return f"{_prefix}-{next(_seq):x}", False


def enabled() -> bool:
    """Whether access lines are logged: the caller builds the fields only then."""
    return _log.isEnabledFor(logging.INFO)


def log_request(fields: dict[str, Any]) -> None:
    # makeRecord + handle: Logger.info would also walk the stack for the caller's file and
    # line, which an access line has no use for and which is a sizeable share of its cost.
    record = _log.makeRecord(
        _log.name, logging.INFO, __file__, 0, "request", (), None, extra={"fields": fields}
    )
    _log.handle(record)
