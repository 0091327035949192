"""The error a request is answered with when the router refuses or cannot route it."""

from __future__ import annotations

from starlette.responses import Response

from router.messages import error_response

__all__ = ["BodyError"]


class BodyError(Exception):
    """A request the router answers itself with an OpenAI-style error (4xx: the request is
    wrong; 5xx: the router cannot serve it)."""

    def __init__(self, status: int, message: str, etype: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.etype = etype or ("invalid_request_error" if status < 500 else "service_unavailable")
        self.headers: dict[str, str] = {}
        """Extra response headers (``retry-after`` on a 429)."""

    def response(self) -> Response:
        """The OpenAI-style error answer for this error."""
        r = error_response(self.status, self.message, self.etype)
        for k, v in self.headers.items():
            r.headers[k] = v
        return r
