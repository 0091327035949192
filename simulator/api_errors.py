"""vLLM's error answers: ``{"error": {"message", "type", "param", "code"}}`` with the status."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def error_response(
    status: int, message: str, type_: str = "BadRequestError", param: str | None = None
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": type_, "param": param, "code": status}},
        status_code=status,
    )
