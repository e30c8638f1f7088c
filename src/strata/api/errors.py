"""Errors an API route answers with, and their bodies in each dialect: the one place that maps errors to HTTP."""

from __future__ import annotations

from typing import Any

# HTTP status -> Anthropic's error type names.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class ApiError(Exception):
    """A request the server refuses or could not serve.

    Args:
        status: the HTTP status code.
        message: what is wrong, for a person to read.
        kind: OpenAI's error `type` (Anthropic's is derived from `status`).
        param: the request field at fault, when there is one.
    """

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param


def openai_error_body(error: ApiError) -> dict[str, Any]:
    return {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": None}}


def anthropic_error_body(error: ApiError) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}
