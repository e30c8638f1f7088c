"""The HTTP app: routes, API key, error mapping, and the request lifecycle around `Service.chat`.

Invariant (one request = one nursery): every request runs in the nursery `_RequestConnection` opens. Its cancel
scope covers the whole request — reading the body, waiting for the engine's turn, prompt processing, generation
and streaming out — and two things cancel it: the watcher task that reads ASGI messages (`http.disconnect`), and
a send that fails. Cancellation reaches `Service.chat`, which leaves the queue or aborts the engine cleanly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import math
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio
from hypercorn.events import Closed, RawData
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, ASGISendEvent
from quart import Quart, Response, request
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection
from werkzeug.exceptions import HTTPException

from strata.api import (
    anthropic,
    openai_chat,
    openai_completions,
    openai_responses,
    prompt_render,
    sse,
    status,
    tokens,
    web,
)
from strata.api.body import INLINE_BYTES, parse_body
from strata.api.cors import add_cors
from strata.api.errors import ApiError, as_api_error, dialect_for_path, error_body
from strata.api.hosts import add_host_check
from strata.api.render import Renderer, SseEvent
from strata.config import Config, load_config
from strata.events import ChatRequest, Event, Finish, PromptProcessed
from strata.model_file import ModelFileError, check_model_file
from strata.request_errors import RequestError
from strata.served_model import ServedModel
from strata.service import Service, open_service

# Exceptions a failed ASGI send may raise, depending on the server.
_SEND_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError)


def _patch_tcp_server_send() -> None:
    """Two changes to the send of hypercorn's trio worker, `TCPServer.protocol_send` (as 0.17 and 0.18 have it:
    pyproject.toml pins hypercorn below 0.19, and tests/server/test_http_send.py fails when the internals used
    here change — the lock, the stream, the original's fallback, trio's socket):

    - A write goes to the socket at once when nobody else is writing and the socket takes it all (the usual case:
      a streamed token is a few hundred bytes), instead of through the send lock and `send_all`, whose two
      checkpoints each cost a pass of trio's scheduler: with them a streamed token took four passes, two
      without. A write the socket does not take whole (a slow reader, a closed connection), or while another
      is in flight, goes hypercorn's way, which waits and reports a closed connection as before.
    - A race: `TCPServer._close` shuts the socket's write side with `send_eof`, which holds trio's one-sender
      guard across a checkpoint, without taking the send lock that every write takes. A write at that moment
      from the connection's other task raises `BusyResourceError`: when a body timeout's 408 and the client's
      hang-up meet, the reader's error response hits it, and the exception escapes the connection's task and
      stops the whole server. The connection is being closed, so the write is moot: it is treated as a write to
      a closed socket, as hypercorn already treats `ClosedResourceError`."""
    send = TCPServer.protocol_send
    if getattr(send, "patched", False):
        return

    async def protocol_send(self: TCPServer, event: Any) -> None:
        if isinstance(event, RawData) and not self.send_lock.locked():
            await trio.lowlevel.checkpoint_if_cancelled()  # a cancelled task writes nothing, as with the lock
            sent = _send_now(self.stream, event.data)
            if sent == len(event.data):
                return
            event = RawData(data=event.data[sent:])
        try:
            await send(self, event)
        except trio.BusyResourceError:
            await self.protocol.handle(Closed())

    protocol_send.patched = True  # type: ignore[attr-defined]
    TCPServer.protocol_send = protocol_send  # type: ignore[method-assign]


def _send_now(stream: Any, data: bytes) -> int:
    """Write what a plain TCP stream's socket takes of `data` without waiting: the bytes written (0 for another
    kind of stream, a shut or full socket, or an error, which the caller's ordinary send then meets)."""
    sock = getattr(getattr(stream, "socket", None), "_sock", None) if isinstance(stream, trio.SocketStream) else None
    if sock is None or stream.socket.did_shutdown_SHUT_WR:
        return 0
    try:
        return int(sock.send(data))
    except OSError:  # BlockingIOError included
        return 0


class _RequestConnection(TrioASGIHTTPConnection):
    """quart-trio's per-request connection, with a send that cancels the request when it fails (see the module
    docstring; hypercorn's sends never fail, it reports hang-ups as `http.disconnect`)."""

    async def __call__(self, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        request_ = self._create_request_from_scope(send)
        async with trio.open_nursery() as nursery:
            guarded_send = _cancelling_send(send, nursery.cancel_scope)
            # The watcher: returns at `http.disconnect`, then cancels the nursery.
            nursery.start_soon(self.handle_messages, nursery, request_, receive)
            # The handler in this task, where quart-trio starts a second one: a start costs the request a pass
            # of trio's scheduler before its view runs (0.08 ms of the first token, by bench/serve.py --stamps).
            await self.handle_request(nursery, request_, guarded_send)


def _cancelling_send(send: ASGISendCallable, scope: trio.CancelScope) -> ASGISendCallable:
    async def guarded(message: ASGISendEvent) -> None:
        try:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                # The last send is shielded: inside it, hypercorn delivers http.disconnect (on which quart-trio
                # cancels this request's nursery, this task included) and then closes a `Connection: close`
                # socket; unshielded, that close is cancelled at its first checkpoint and the socket leaks.
                # (hypercorn already shields its socket writes, so this adds no new wait.)
                with trio.CancelScope(shield=True):
                    await send(message)
            else:
                await send(message)
        except _SEND_ERRORS:
            scope.cancel()
            await trio.lowlevel.checkpoint()  # raises Cancelled
    return guarded


@dataclass
class _State:
    config: Config
    service: Service | None = None
    registry: Any = None
    closing: trio.Event | None = None

    def ready_service(self) -> Service:
        if self.service is None:
            raise ApiError(503, "the server is starting", kind="server_error")
        return self.service


@dataclass(frozen=True)
class _Answer:
    """What a renderer is made from: the names the answer reports, the request (whose settings a Responses
    answer echoes) and its body (whose stream options an OpenAI stream follows)."""

    model: str
    request_id: str
    request: ChatRequest
    body: Any
    streamed: bool


def _check_model(config: Config, from_environment: bool) -> None:
    """A wrong model path, before the app is served: under another ASGI server's command line (the config from
    the environment), the same one line as `strata serve` prints, and the process ends; else `ModelFileError`."""
    try:
        for path in config.model_files():
            check_model_file(path)
    except ModelFileError as error:
        if from_environment:
            raise SystemExit(f"error: {error}") from None
        raise


@dataclass(frozen=True)
class _Dialect:
    """How one API speaks: parse a body, and render the answer's events (a stream, or its fold)."""

    parse: Callable[[Any], ChatRequest]
    renderer: Callable[[_Answer], Renderer]
    done: bytes | None = None  # a marker after the last event


def create_app(service: Service | None = None, config: Config | None = None) -> Quart:
    """The quart-trio app serving Strata's HTTP API.

    Args:
        service: an open service to mount (its config is used). None: the app opens its own service during
            its lifespan (startup fails if the model does not load).
        config: the configuration when the app opens its own service; None reads `STRATA_CONFIG` and the
            environment (`hypercorn 'strata.api:create_app()' --worker-class trio`).
    """
    from_environment = service is None and config is None
    if service is not None:
        config = service.config
    elif config is None:
        config = load_config()
    if service is None and not config.model and not config.models:
        from strata.models import with_demo_model

        config = with_demo_model(config)  # as `strata serve` does: `{}` is a working config
    if service is None:
        _check_model(config, from_environment)
    _patch_tcp_server_send()
    state = _State(config, service)
    app = QuartTrio(__name__)
    app.asgi_http_class = _RequestConnection
    app.config.update(
        RESPONSE_TIMEOUT=None,  # streams last as long as the generation
        BODY_TIMEOUT=config.limits.body_timeout,
        MAX_CONTENT_LENGTH=config.limits.max_body_bytes,
    )
    if service is None:
        _own_service(app, state)
    else:
        state.registry = status.metrics_registry(service)
    if config.cors_origins:
        add_cors(app, config.cors_origins)  # first: a preflight is answered before the API key check
    _add_auth(app, config)
    add_host_check(app, config)
    _add_error_handler(app)
    _add_info_routes(app, state)
    _add_status_routes(app, state)
    _add_chat_routes(app, state)
    _add_token_routes(app, state)
    if config.web:
        web.add_routes(app)
    return app


def _own_service(app: QuartTrio, state: _State) -> None:
    async def run_service(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        state.closing = trio.Event()
        async with open_service(state.config) as service:
            state.service = service
            state.registry = status.metrics_registry(service)
            task_status.started()
            await state.closing.wait()

    @app.before_serving
    async def start_service() -> None:
        await app.nursery.start(run_service)

    @app.after_serving
    async def stop_service() -> None:
        if state.closing is not None:
            state.closing.set()


# What `status_key` guards: the routes that show other clients' requests (ids, routes, tokens, timings).
_STATUS_ROUTES = ("/status", "/v1/status", "/v1/status/stream", "/v1/history", "/metrics")


def _given_key() -> str:
    given = request.headers.get("x-api-key", "")
    authorization = request.headers.get("authorization", "")
    if authorization[:7].lower() == "bearer ":
        given = authorization[7:].strip()
    return given


def _add_auth(app: Quart, config: Config) -> None:
    if not (config.api_key or config.status_key):
        return
    api_keys = [config.api_key.encode()] if config.api_key else []
    status_keys = [key.encode() for key in (config.api_key, config.status_key) if key]

    @app.before_request
    async def check_key() -> None:
        # The web page loads without the key; every API call it makes needs it.
        if request.path in ("/health", "/health/live") or (config.web and web.is_page(request.path)):
            return
        keys = status_keys if request.path in _STATUS_ROUTES else api_keys
        if not keys:
            return  # only status_key is set: the API is open
        given = _given_key().encode()
        if not any(hmac.compare_digest(given, key) for key in keys):
            raise ApiError(401, "invalid or missing API key", kind="authentication_error")


def _add_error_handler(app: Quart) -> None:
    async def handle(exc: Exception) -> Response:
        error = as_api_error(exc)
        if isinstance(exc, RequestError) and exc.param is not None:
            error.param = exc.param
        if error.status >= 500 and not isinstance(exc, (ApiError, HTTPException)):
            app.logger.exception("request failed", exc_info=exc)
        response = _json(error_body(error, dialect_for_path(request.path)), error.status)
        if error.retry_after is not None:
            response.headers["Retry-After"] = str(error.retry_after)
        return response

    app.register_error_handler(HTTPException, handle)
    app.register_error_handler(Exception, handle)


def _json(body: Any, status_code: int = 200) -> Response:
    return Response(json.dumps(body, ensure_ascii=False), status=status_code, content_type="application/json")


async def _json_body() -> Any:
    # A page on another origin can POST text/plain without a preflight; application/json needs one.
    if request.mimetype != "application/json":
        raise ApiError(415, f"the request body must be application/json, not {request.mimetype or 'untyped'}")
    data = await request.get_data()
    assert isinstance(data, bytes)
    return await parse_body(data)


async def _parse(parse: Callable[[Any], ChatRequest], data: Any, large: bool) -> ChatRequest:
    """A dialect's parse, in a worker thread when the body is large (its work grows with the body)."""
    if not large:
        return parse(data)
    return await trio.to_thread.run_sync(parse, data)


# --- information routes


def _add_info_routes(app: Quart, state: _State) -> None:
    @app.get("/health")
    async def health() -> Response:
        service = state.service
        if service is not None and service.ready:
            problem = service.engine_problem()
            if problem is not None:
                return _json({"status": "error", "error": f"the engine cannot start: {problem.strerror or problem}"},
                             503)
            return _json({"status": "ok"})
        if service is not None and service.load_error is not None:
            return _json({"status": "error", "error": str(service.load_error)}, 503)
        downloading = service is not None and service.models.default.state == "downloading"
        return _json({"status": "downloading" if downloading else "loading"}, 503)

    @app.get("/health/live")
    async def live() -> Response:
        """Liveness: the server answers (a probe that restarts the process; `/health` is readiness: the model)."""
        return _json({"status": "alive"})

    @app.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": status.model_list(state.ready_service())})

    @app.get("/v1/mcp")
    async def mcp_servers() -> Response:
        return _json({"object": "list", "data": state.ready_service().mcp.status()})


def _add_status_routes(app: Quart, state: _State) -> None:
    """The routes that show every client's requests (`_STATUS_ROUTES`: `status_key` guards them)."""
    stream_seats = status.StreamSeats(state.config.limits.status_streams)

    @app.get("/status")
    async def engine_status() -> Response:
        return _json(status.status(state.ready_service()))

    @app.get("/v1/status")
    async def server_status() -> Response:
        service = state.ready_service()
        body = status.server_status(service)
        body["vision"] = status.vision_status(service)
        body["mcp"] = [{**server, "tools": [tool["name"] for tool in server["tools"]]}
                       for server in service.mcp.status()]
        return _json(body)

    @app.get("/v1/status/stream")
    async def status_stream() -> Response:
        service = state.ready_service()
        try:
            interval = float(request.args.get("interval", 1.0))
        except ValueError:
            interval = math.nan
        if not 0.1 <= interval <= 10.0:
            raise ApiError(400, "interval must be 0.1 to 10 seconds", param="interval")
        return Response(await status.open_live_stream(service, interval, stream_seats),
                        content_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/v1/history")
    async def history() -> Response:
        return _json(status.history(state.ready_service()))

    @app.get("/metrics")
    async def metrics() -> Response:
        state.ready_service()
        return Response(status.metrics_text(state.registry), content_type="text/plain; version=0.0.4")


# --- chat routes


def _openai_usage(answer: _Answer) -> bool:
    """Whether an OpenAI stream ends with its usage chunk (asked for in the body of a streamed request only)."""
    return answer.streamed and openai_chat.include_usage(answer.body)


_DIALECTS = {
    "/v1/chat/completions": _Dialect(
        parse=openai_chat.parse_request,
        renderer=lambda answer: openai_chat.ChatRenderer(
            model=answer.model, request_id=answer.request_id, include_usage=_openai_usage(answer)),
        done=sse.DONE,
    ),
    "/v1/completions": _Dialect(
        parse=openai_completions.parse_request,
        renderer=lambda answer: openai_completions.CompletionRenderer(
            model=answer.model, request_id=answer.request_id, include_usage=_openai_usage(answer)),
        done=sse.DONE,
    ),
    "/v1/messages": _Dialect(
        parse=anthropic.parse_request,
        renderer=lambda answer: anthropic.MessageRenderer(model=answer.model, request_id=answer.request_id),
    ),
    "/v1/responses": _Dialect(
        parse=openai_responses.parse_request,
        renderer=lambda answer: openai_responses.ResponseRenderer(
            model=answer.model, request_id=answer.request_id, request=answer.request),
    ),
}


def _add_chat_routes(app: Quart, state: _State) -> None:
    for path, dialect in _DIALECTS.items():
        app.add_url_rule(path, endpoint=path, view_func=_chat_view(state, dialect), methods=["POST"])

    @app.post("/v1/messages/count_tokens")
    async def count_tokens() -> Response:
        body = await _json_body()
        chat_request = anthropic.parse_count_tokens_request(body)
        count = await state.ready_service().count_tokens(chat_request, _model_named(body))
        return _json(anthropic.render_count(count))

    @app.post("/v1/responses/input_tokens")
    async def input_tokens() -> Response:
        body = await _json_body()
        chat_request = openai_responses.parse_count_request(body)
        count = await state.ready_service().count_tokens(chat_request, _model_named(body))
        return _json({"object": "response.input_tokens", "input_tokens": count})


def _model_named(body: Any) -> str | None:
    """The model a request body names (its `model`), if it names one."""
    name = body.get("model") if isinstance(body, dict) else None
    return name if isinstance(name, str) else None


def _add_token_routes(app: Quart, state: _State) -> None:
    limiter = trio.CapacityLimiter(tokens.TOKENIZE_THREADS)

    @asynccontextmanager
    async def loaded(body: Any) -> AsyncIterator[ServedModel]:
        """The model a body names (llama.cpp's token routes name none: then the first), loaded and held for the
        block."""
        service = state.ready_service()
        if not service.ready:
            raise ApiError(503, "the model is not loaded", kind="server_error")
        name = _model_named(body)
        async with service.models.use(service.models.default if name is None else service.models.find(name)) \
                as model:
            yield model

    def on_model(answer: Callable[[ServedModel, Any, trio.CapacityLimiter], Awaitable[Any]]
                 ) -> Callable[[], Awaitable[Response]]:
        """A route that answers a JSON body with `answer(model, body, limiter)`, the model held meanwhile."""

        async def view() -> Response:
            body = await _json_body()
            async with loaded(body) as model:
                return _json(await answer(model, body, limiter))

        return view

    routes = {"/tokenize": tokens.tokenize, "/detokenize": tokens.detokenize,
              "/v1/chat/completions/render": prompt_render.render_chat,
              "/v1/responses/render": prompt_render.render_responses,
              "/v1/completions/render": prompt_render.render_completions}
    for path, answer in routes.items():
        app.add_url_rule(path, endpoint=path, view_func=on_model(answer), methods=["POST"])


def _chat_view(state: _State, dialect: _Dialect) -> Callable[[], Awaitable[Response]]:
    async def view() -> Response:
        data = await _json_body()
        large = (request.content_length or 0) > INLINE_BYTES
        chat_request = _with_sampling_defaults(await _parse(dialect.parse, data, large), data, state.config)
        chat_request = _with_cache_salt(chat_request, data, state.config)
        service = state.ready_service()
        request_id = uuid.uuid4().hex[:24]
        name = _model_named(data)
        model = service.models.find(name)  # an unknown name is a 404 before anything runs
        events = service.chat(chat_request, request_id=request_id, model=name)
        streamed = isinstance(data, dict) and data.get("stream") is True
        answer = _Answer(model.name, request_id, chat_request, data, streamed)
        if not streamed:
            async with aclosing(events):
                generated = [event async for event in events]
            return _json(dialect.renderer(answer).whole(generated))
        renderer = dialect.renderer(answer)
        # The first event is awaited here, before the status line goes out, so that a request the service
        # refuses (too long, queue full, engine error) gets its HTTP status instead of a broken stream.
        try:
            first = [await events.__anext__()]
            if isinstance(first[0], PromptProcessed):
                # The first token's events come at once after it: the first write carries them too.
                second = await anext(events, None)
                first += [second] if second is not None else []
        except BaseException:
            await events.aclose()
            raise
        return Response(_stream(events, first, renderer, dialect.done), content_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return view


MAX_CACHE_SALT_CHARS = 256


def _with_cache_salt(chat_request: ChatRequest, body: Any, config: Config) -> ChatRequest:
    """The request's `cache_salt` (any dialect may send it, as vLLM's OpenAI routes take it), joined by a digest of
    the client's key when `cache_isolation` is "api_key": only requests with the same salt share cached
    prefixes, so no client can learn another's prompt from `cached_tokens`."""
    salt = body.get("cache_salt") if isinstance(body, dict) else None
    if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT_CHARS):
        raise ApiError(400, f"cache_salt: must be a string of 1 to {MAX_CACHE_SALT_CHARS} characters",
                       param="cache_salt")
    if config.cache_isolation == "api_key":
        key = hashlib.sha256(_given_key().encode()).hexdigest()[:32]
        salt = f"key:{key}" if salt is None else f"key:{key}:{salt}"
    return chat_request if salt is None else dataclasses.replace(chat_request, cache_salt=salt)


def _with_sampling_defaults(chat_request: ChatRequest, body: Any, config: Config) -> ChatRequest:
    """The server's sampling defaults (config `sampling`) for the parameters the client left out. Every dialect
    names them as `SamplingParams` does (temperature, top_p, top_k, ...)."""
    given = body if isinstance(body, dict) else {}
    defaults = {key: value for key, value in vars(config.sampling).items()
                if value is not None and given.get(key) is None}
    if not defaults:
        return chat_request
    try:
        sampling = dataclasses.replace(chat_request.sampling, **defaults)
    except ValueError as error:
        raise ApiError(400, str(error)) from None
    return dataclasses.replace(chat_request, sampling=sampling)


async def _stream(events: AsyncGenerator[Event, None], first: list[Event], renderer: Renderer,
                  done: bytes | None) -> AsyncIterator[bytes]:
    """The SSE body, from the `first` events (already taken from `events`) on. Runs in the request's task: a
    hang-up cancels it at its next checkpoint, and the response machinery closes it, which closes `events` (the
    service's generator) and frees the engine's turn."""
    end = b""  # the finish's frames go out with the end marker, in one write
    async with aclosing(events):
        yield b"".join(_frames(renderer.feed(event)) for event in first)  # feed opens the stream: it may say how
        try:
            async for event in events:
                frames = _frames(renderer.feed(event))
                if isinstance(event, Finish):
                    end += frames
                elif frames:  # an empty body message would be a write of nothing
                    yield frames
        except Exception as exc:  # noqa: BLE001 - the status went out already: the error becomes an event
            end += _frames(renderer.error(as_api_error(exc)))
    end += done or b""
    if end:
        yield end


def _frames(events: list[SseEvent]) -> bytes:
    """The SSE frames of one event's renderings, as one write (a finish and its usage together): each write costs
    the server a pass through hypercorn and a send, and the client a wake-up."""
    return b"".join(sse.encode(data, name) for name, data in events)
