"""Time stamps along one streamed request, in the server's process, for `bench/serve.py --stamps`.

`Stamps.install(service)` wraps, from the outside, the calls a request passes through and notes `perf_counter()`
at each (the client's process reads the same monotonic clock, so its send and its first chunk fit on the same
line): bytes arrived (hypercorn's connection), request parsed (hypercorn's stream gets the request's head), app
called (the ASGI connection of the request), handler started (quart's, before the request's context), view entered
and body parsed (the route's body reader), prompt prepared (rendered and tokenised), job submitted to the engine
thread, engine call started and returned, token sampled (the job's own stamp), wake sent (the engine thread has
handed the token to trio), trio woken for it, tokens taken (by the request's task), view returned (its streamed
response made), head written (the status line and headers), the first content write to the socket.
"""

from __future__ import annotations

import re
import time
from typing import Any

import hypercorn.events as hypercorn_events
import hypercorn.protocol.events as stream_events
import hypercorn.protocol.h11 as h11_protocol
import hypercorn.protocol.http_stream as http_stream
import quart_trio

import strata.api.app as app_module
import strata.scheduling.engine_loop as engine_loop

_TOKEN = re.compile(rb'"(?:reasoning_)?content":"[^"]')  # a chunk with text: the role chunk has ""
MARKS = ("bytes arrived", "request parsed", "app called", "handler started", "view entered", "body parsed",
         "prompt ready", "job submitted", "engine call", "engine returned", "token sampled", "wake sent", "trio woken",
         "tokens taken", "view returned", "head written", "first write")


class Stamps:
    def __init__(self) -> None:
        self.marks: dict[str, float] = {}
        self._undo: list[tuple[Any, str, Any]] = []

    def reset(self) -> None:
        self.marks = {}

    def note(self, mark: str) -> None:
        self.marks.setdefault(mark, time.perf_counter())  # the first time in the request

    def _wrap(self, owner: Any, name: str, make: Any) -> None:
        original = getattr(owner, name)
        self._undo.append((owner, name, original))
        setattr(owner, name, make(original))

    def install(self, service: Any) -> Stamps:
        note = self.note

        def handle(original: Any) -> Any:
            async def wrapped(protocol: Any, event: Any) -> None:
                if isinstance(event, hypercorn_events.RawData) and event.data:
                    note("bytes arrived")
                await original(protocol, event)
            return wrapped

        def stream_handle(original: Any) -> Any:
            async def wrapped(stream: Any, event: Any) -> None:
                if isinstance(event, stream_events.Request):
                    note("request parsed")
                await original(stream, event)
            return wrapped

        def app_call(original: Any) -> Any:
            async def wrapped(connection: Any, receive: Any, send: Any) -> None:
                note("app called")
                await original(connection, receive, send)
            return wrapped

        def handler(original: Any) -> Any:
            async def wrapped(app: Any, request: Any) -> Any:
                note("handler started")
                return await original(app, request)
            return wrapped

        def body(original: Any) -> Any:
            async def wrapped() -> Any:
                note("view entered")
                data = await original()
                note("body parsed")
                return data
            return wrapped

        def prepare(original: Any) -> Any:
            def wrapped(*args: Any) -> Any:
                result = original(*args)
                note("prompt ready")
                return result
            return wrapped

        def submit(original: Any) -> Any:
            def wrapped(loop: Any, stream: Any) -> None:
                note("job submitted")
                self.job = stream.job
                original(loop, stream)
            return wrapped

        def eval_batch(original: Any) -> Any:
            def wrapped(items: Any, notify_fd: int = -1) -> Any:
                note("engine call")
                try:
                    return original(items, notify_fd=notify_fd)
                finally:
                    note("engine returned")
            return wrapped

        def handoff(original: Any) -> Any:
            def wrapped(loop: Any) -> None:
                note("wake sent")
                original(loop)
            return wrapped

        def wake_all(original: Any) -> Any:
            def wrapped(streams: Any) -> None:
                note("trio woken")
                original(streams)
            return wrapped

        def next_tokens(original: Any) -> Any:
            async def wrapped(stream: Any) -> Any:
                tokens = await original(stream)
                if "trio woken" in self.marks:
                    note("tokens taken")
                return tokens
            return wrapped

        def streamed(original: Any) -> Any:
            def wrapped(*args: Any) -> Any:
                note("view returned")
                return original(*args)
            return wrapped

        def app_send(original: Any) -> Any:
            async def wrapped(stream: Any, message: Any) -> None:
                await original(stream, message)
                if message is not None and message["type"] == "http.response.start":
                    note("head written")
            return wrapped

        def send_now(original: Any) -> Any:
            def wrapped(stream: Any, data: bytes) -> int:
                sent = original(stream, data)
                if _TOKEN.search(data):
                    note("first write")
                return sent
            return wrapped

        self._wrap(h11_protocol.H11Protocol, "handle", handle)
        self._wrap(http_stream.HTTPStream, "handle", stream_handle)
        self._wrap(app_module._RequestConnection, "__call__", app_call)
        self._wrap(quart_trio.QuartTrio, "handle_request", handler)
        self._wrap(app_module, "_json_body", body)
        self._wrap(service, "_prepare", prepare)
        self._wrap(engine_loop.EngineLoop, "submit", submit)
        self._wrap(service.engine, "eval_batch", eval_batch)
        self._wrap(engine_loop.EngineLoop, "_await_handoffs", handoff)
        self._wrap(engine_loop, "_wake_all", wake_all)
        self._wrap(engine_loop.Stream, "next_tokens", next_tokens)
        self._wrap(app_module, "_stream", streamed)
        self._wrap(http_stream.HTTPStream, "app_send", app_send)
        self._wrap(app_module, "_send_now", send_now)
        return self

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo = []

    def row(self, sent: float, first: float) -> dict[str, float]:
        """Milliseconds from the client's send to each mark, the token's sampling and the client's first chunk."""
        marks = dict(self.marks)
        job = getattr(self, "job", None)
        if job is not None and job.prompt_done:
            marks["token sampled"] = job.prompt_done
        out = {mark: (marks[mark] - sent) * 1e3 for mark in MARKS if mark in marks}
        out["client's first chunk"] = (first - sent) * 1e3
        return out
