"""HTTP-level bounds the ASGI app cannot enforce itself.

**Header size** (``server.max_header_bytes``, 431). uvicorn's default parser (httptools) has no
bound on the request line + headers: it buffers a 20 MB header block and hands it to the app.
:func:`http_protocol` returns a subclass of uvicorn's ``HttpToolsProtocol`` that counts the
bytes received while a request's head is incomplete and answers ``431 Request Header Fields Too
Large`` (and closes the connection) as soon as they pass the bound, so memory per connection
stays bounded by the bound plus one socket read. Without httptools the pure-Python ``h11``
parser is used with ``h11_max_incomplete_event_size`` set to the same bound (it answers 400).

Use :func:`uvicorn_options` when building a ``uvicorn.Config`` for the router's apps.
"""

from __future__ import annotations

from typing import Any

__all__ = ["http_protocol", "uvicorn_options"]

_BODY = (
    b'{"error":{"message":"request header fields too large",'
    b'"type":"invalid_request_error","code":431}}'
)


class _HeadTooLarge(Exception):
    pass


def http_protocol(max_header_bytes: int) -> type[Any] | None:
    """An httptools protocol class bounded at ``max_header_bytes`` (None without httptools)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # pragma: no cover - httptools not installed
        return None

    class BoundedHttpToolsProtocol(HttpToolsProtocol):  # type: ignore[misc]
        limit = max_header_bytes

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._in_head = True
            self._head_bytes = 0
            self._rejected = False

        def on_headers_complete(self) -> None:
            self._in_head = False
            size = len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers)
            if size > self.limit:
                self._reject()
                raise _HeadTooLarge  # stops the parser (reported as a parser error: no 400)
            super().on_headers_complete()

        def send_400_response(self, msg: str) -> None:
            if not self._rejected:
                super().send_400_response(msg)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_head = True
            self._head_bytes = 0

        def data_received(self, data: bytes) -> None:
            if self._rejected:
                return
            if self._in_head:
                self._head_bytes += len(data)
            super().data_received(data)
            if self._in_head and self._head_bytes > self.limit and not self._rejected:
                self._reject()

        def _reject(self) -> None:
            self._rejected = True
            self.logger.warning("request head above %d bytes: 431", self.limit)
            head = (
                b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                b"content-type: application/json\r\n"
                b"content-length: " + str(len(_BODY)).encode() + b"\r\n"
                b"connection: close\r\n\r\n"
            )
            if not self.transport.is_closing():
                self.transport.write(head + _BODY)
                self.transport.close()

    return BoundedHttpToolsProtocol


def uvicorn_options(max_header_bytes: int) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config`` that bound the request head."""
    cls = http_protocol(max_header_bytes)
    if cls is not None:
        return {"http": cls}
    return {"http": "h11", "h11_max_incomplete_event_size": max_header_bytes}
