"""The two ingest implementations the index tests run against, by name.

``python``: every event decoded into Python objects (``decode_payload_py``) and applied by the
Python code, the reference. ``native``: the C decoder's packed events (``decode_payload``), applied
in C where ingest.py takes its native path; with KVROUTER_REQUIRE_NATIVE=1 (CI) the extension
must be built, else this is the Python path again under another name.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import msgspec

from indexer import wire
from indexer.wire import DecodedBatch, Event, decode_payload, decode_payload_py

IMPLS = ("python", "native")

_encode = msgspec.msgpack.Encoder().encode


def require_native() -> None:
    if os.environ.get("KVROUTER_REQUIRE_NATIVE") == "1":
        assert wire._native_decode is not None, "KVROUTER_REQUIRE_NATIVE=1: build the extension"


def decoder(impl: str) -> Callable[[bytes], DecodedBatch]:
    """``decode_payload`` of the named implementation."""
    if impl == "python":
        return decode_payload_py
    require_native()
    return decode_payload


def as_impl(events: Sequence[Event], impl: str) -> Sequence[Event]:
    """``events`` as the named implementation hands them to the index: the Python objects, or
    the packed form the C decoder makes of them on the wire (where it takes their shape)."""
    if impl == "python":
        return list(events)
    return decoder(impl)(_encode([1.0, list(events), 0])).events
