"""What the service answers when it cannot serve a request: the request's fault (`RequestError`, a 400), or
something it needs that is not there now (`ServiceUnavailable`, a 503). `api/errors.py` maps them to each
dialect's error body."""

from __future__ import annotations


class RequestError(ValueError):
    """A request this model cannot serve (too long for the context, refused by the chat template, a picture that
    cannot be used, ...); `param` names the request field at fault, when there is one, `code` the error's code."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code  # OpenAI's error code, e.g. "context_length_exceeded"


class ServiceUnavailable(Exception):
    """Something the request needs is not there now: the model (still loading, or loading failed), or the image
    encoder (absent, crashed or hung). `retry_after`: seconds after which trying again may work."""

    def __init__(self, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.retry_after = retry_after
