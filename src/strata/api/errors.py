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
        code: OpenAI's machine-readable `code` (e.g. "context_length_exceeded"), when there is one.
        retry_after: seconds for a `Retry-After` header (SDKs retry a 503 that has one).
    """

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.retry_after = retry_after
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code
        self.retry_after = retry_after


def openai_error_body(error: ApiError) -> dict[str, Any]:
    return {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": error.code}}


def anthropic_error_body(error: ApiError) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


# --- the one place that maps exceptions to HTTP errors


def dialect_for_path(path: str) -> str:
    """The error dialect of a route: Anthropic's under /v1/messages, OpenAI's everywhere else."""
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def error_body(error: ApiError, dialect: str) -> dict[str, Any]:
    return anthropic_error_body(error) if dialect == "anthropic" else openai_error_body(error)


def as_api_error(exc: BaseException) -> ApiError:
    """The HTTP error an exception means, whatever part of the server raised it."""
    from werkzeug.exceptions import HTTPException

    from strata.model_set import UnknownModel
    from strata.request_errors import RequestError, ServiceUnavailable
    from strata.scheduling.turn import QueueFull
    from strata.shutdown import ShuttingDown

    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, UnknownModel):
        return ApiError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, RequestError):
        return ApiError(400, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, ServiceUnavailable):
        return ApiError(503, str(exc), kind="server_error", retry_after=exc.retry_after)
    if isinstance(exc, ShuttingDown):
        return ApiError(503, str(exc), kind="server_error", code=exc.code)
    if isinstance(exc, QueueFull):
        return ApiError(503, f"the server is busy: {exc}", kind="server_error", retry_after=1)
    if isinstance(exc, HTTPException):
        code = exc.code or 500
        kinds = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error"}
        message = exc.description or exc.name
        if code == 413:
            message = "the request body is too large"
        return ApiError(code, message, kind=kinds.get(code, "invalid_request_error" if code < 500 else "server_error"))
    # The log has the traceback; the client learns nothing of the server's insides.
    return ApiError(500, "internal server error", kind="server_error")
