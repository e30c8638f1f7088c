"""The service: one loaded model, its engine's turn and the generation of chat requests as events.

Embedding it in a trio program::

    config = strata.Config(model="model.gguf")
    async with strata.open_service(config) as service:
        request = ChatRequest(messages=[{"role": "user", "content": "Hello"}])
        async with contextlib.aclosing(service.chat(request)) as events:
            async for event in events:
                print(event)

Cancelling the caller's cancel scope stops a request in any phase, exactly like an HTTP client hanging up.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import outcome
import trio

from strata.config import Config
from strata.events import ChatRequest, Event, Finish, FinishReason, Usage
from strata.history import History, HistoryRow
from strata.prompt import PromptError, render_chat
from strata.sampling import Sampler
from strata.toolcalls import StopMatcher, ToolCallParser
from strata.turn import Turn

# Variables the chat template gets from the request itself; `chat_template_kwargs` may not override them.
_RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "add_generation_prompt"})


class RequestError(ValueError):
    """A request this model cannot serve (too long for the context, refused by the chat template, ...)."""


class ServiceUnavailable(Exception):
    """The model is not loaded (still loading, or loading failed)."""


class EngineLike(Protocol):
    """What the service needs of `strata.engine_cffi.Engine` (tests substitute scripted engines)."""

    n_vocab: int
    n_ctx: int
    n_past: int

    def eval(self, tokens: Sequence[int]) -> Any: ...
    def keep(self, n: int) -> None: ...
    def abort(self) -> None: ...


@dataclass
class _Prepared:
    ids: list[int]
    max_tokens: int
    starts_in_reasoning: bool


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


class Service:
    """A loaded model serving chat requests one generation at a time (see `open_service`).

    Attributes:
        turn: the engine's FIFO turn (`turn.busy`, `turn.queued`).
        history: recent requests and totals.
        phase: "idle", "prompt" (processing a prompt) or "decode".
        current: the row of the request holding the turn, or None.
    """

    def __init__(self, config: Config):
        self.config = config
        self.turn = Turn(max_queued=config.limits.queue_length)
        self.history = History(config.limits.history_size)
        self.phase = "idle"
        self.current: HistoryRow | None = None
        self.model_name = _model_name(config.model)
        self.started = time.time()
        self.engine: Any = None
        self.tokenizer: Any = None
        self.template: str | None = None
        self.load_error: BaseException | None = None
        self.loaded = trio.Event()
        self.nursery: trio.Nursery | None = None  # the service's long-lived nursery (open_service)
        # Engine calls get their own thread slot so that other threaded work never delays them.
        self._limiter = trio.CapacityLimiter(1)
        # Invariant: token ids of the positions in the engine's KV cache, in order (updated after every call).
        self._kv_ids: list[int] = []

    @property
    def ready(self) -> bool:
        return self.loaded.is_set() and self.load_error is None

    # --- loading

    def attach(self, engine: EngineLike, tokenizer: Any, template: str | None = None) -> None:
        """Serve with an engine and tokenizer that are already loaded."""
        template = template or tokenizer.chat_template
        if not template:
            raise ServiceUnavailable("the model has no chat template (tokenizer.chat_template)")
        self.engine, self.tokenizer, self.template = engine, tokenizer, template
        self.loaded.set()

    async def load(self, log: Callable[[str], None] = print) -> None:
        """Load the configured model in a worker thread; a failure is kept in `load_error` and re-raised."""
        try:
            engine, tokenizer = await trio.to_thread.run_sync(self._load_blocking, log)
            self.attach(engine, tokenizer)
            log(f"model: {self.config.model} ({engine.arch}), context {engine.n_ctx}, threads {engine.threads}, "
                f"backend {engine.backend}")
        except BaseException as error:
            self.load_error = error
            self.loaded.set()
            raise

    def _load_blocking(self, log: Callable[[str], None]) -> tuple[Any, Any]:
        from strata.engine_cffi import Engine
        from strata.tokenizer import Tokenizer

        config = self.config
        if not config.model:
            raise ServiceUnavailable('no model configured (the "model" key or --model)')
        log(f"loading {config.model} ...")
        started = time.perf_counter()
        engine = Engine.load(config.model, n_ctx=config.context, threads=config.threads, kv=config.kv,
                             n_batch=config.batch)
        try:
            tokenizer = Tokenizer.from_gguf(config.model)
        except BaseException:
            engine.close()
            raise
        log(f"loaded in {time.perf_counter() - started:.1f} s")
        return engine, tokenizer

    async def wait_ready(self) -> None:
        """Wait until the model is loaded; raise `ServiceUnavailable` if loading failed."""
        await self.loaded.wait()
        if self.load_error is not None:
            raise ServiceUnavailable(f"the model failed to load: {self.load_error}")

    def close(self) -> None:
        if self.engine is not None and hasattr(self.engine, "close"):
            self.engine.close()

    # --- requests

    def render(self, request: ChatRequest) -> str:
        """The prompt text of a request (the chat template applied to its messages and tools)."""
        kwargs = dict(request.template_kwargs)
        clash = _RESERVED_TEMPLATE_VARS.intersection(kwargs)
        if clash:
            raise RequestError(f"chat_template_kwargs may not set {', '.join(sorted(clash))}")
        enable_thinking = kwargs.pop("enable_thinking", request.enable_thinking)
        try:
            return render_chat(self.template, request.messages, tools=request.tools or None,
                               add_generation_prompt=True, enable_thinking=enable_thinking, **kwargs)
        except PromptError as error:
            raise RequestError(str(error)) from None

    def count_tokens(self, request: ChatRequest) -> int:
        """How many prompt tokens a request has."""
        self._require_ready()
        return len(self.tokenizer.encode(self.render(request), special=True))

    def _require_ready(self) -> None:
        if not self.loaded.is_set():
            raise ServiceUnavailable("the model is still loading")
        if self.load_error is not None:
            raise ServiceUnavailable(f"the model failed to load: {self.load_error}")

    def _prepare(self, request: ChatRequest) -> _Prepared:
        self._require_ready()
        text = self.render(request)
        ids = self.tokenizer.encode(text, special=True)
        n_ctx = self.engine.n_ctx
        if len(ids) >= n_ctx:
            raise RequestError(f"the prompt has {len(ids)} tokens; the context holds {n_ctx} (prompt and answer)")
        max_tokens = n_ctx - len(ids)
        for cap in (request.max_tokens, self.config.limits.max_tokens):
            if cap is not None:
                max_tokens = min(max_tokens, cap)
        starts_in_reasoning = text.rstrip("\n").endswith("<think>")
        return _Prepared(ids, max_tokens, starts_in_reasoning)

    async def chat(self, request: ChatRequest, *, request_id: str | None = None) -> AsyncIterator[Event]:
        """Generate the answer to `request` as events, ending with `Usage` and `Finish`.

        Close the iterator when done with it early (`contextlib.aclosing`): it holds the engine's turn between
        its events. Cancellation (the caller's cancel scope) is clean in every phase: while queued the request
        just leaves the queue; on the engine it raises the abort flag and waits for the engine thread to return.

        Raises:
            RequestError: the request does not fit this model.
            ServiceUnavailable: the model is not loaded.
            turn.QueueFull: too many requests are waiting.
        """
        row = HistoryRow(id=request_id or uuid.uuid4().hex, route=request.route, start=time.time())
        started = time.perf_counter()
        try:
            prepared = self._prepare(request)
            row.prompt_tokens = len(prepared.ids)
            async with self.turn.hold():
                self.current = row
                try:
                    async with aclosing(self._generate(request, prepared, row)) as events:
                        async for event in events:
                            yield event
                finally:
                    self.current, self.phase = None, "idle"
        except (trio.Cancelled, GeneratorExit):
            row.finish = "cancel"
            raise
        except BaseException:
            row.finish = "error"
            raise
        finally:
            row.duration = time.perf_counter() - started
            self.history.record(row)

    async def _generate(self, request: ChatRequest, prepared: _Prepared, row: HistoryRow) -> AsyncIterator[Event]:
        sampler = Sampler(request.sampling, self.engine.n_vocab)
        context = list(prepared.ids)  # prompt and generated tokens
        self.phase = "prompt"
        t = time.perf_counter()
        token, row.reused_tokens = await self._on_engine(self._advance, context, sampler)
        row.prompt_seconds = time.perf_counter() - t
        self.phase = "decode"
        output = _Output(self.tokenizer, request, prepared.starts_in_reasoning)
        stop_ids = self.tokenizer.eos_ids
        finish: FinishReason = "length"
        decode_started = time.perf_counter()
        while True:
            if token in stop_ids:
                finish = "stop"
                break
            context.append(token)
            row.output_tokens += 1
            for event in output.push(token):
                yield event
            if output.stopped:
                finish = "stop"
                break
            if row.output_tokens >= prepared.max_tokens:
                break
            token, _ = await self._on_engine(self._advance, context, sampler)
            row.decode_seconds = time.perf_counter() - decode_started
        for event in output.finish():
            yield event
        if finish == "stop" and output.n_tool_calls:
            finish = "tool_calls"
        row.finish = finish
        yield Usage(prompt_tokens=len(prepared.ids), cached_tokens=row.reused_tokens,
                    completion_tokens=row.output_tokens)
        yield Finish(finish)

    # --- the engine, in its worker thread

    def _advance(self, ids: list[int], sampler: Sampler) -> tuple[int, int]:
        """Bring the KV cache to hold `ids` (keep the common prefix, evaluate the rest); sample the next token.

        Idempotent, so a call that a stale abort flag stopped can simply run again. Returns (token, reused).
        """
        engine = self.engine
        # At least the last token is evaluated: its logits choose the next one.
        reused = min(_common_prefix(self._kv_ids, ids), len(ids) - 1)
        if reused < engine.n_past:
            engine.keep(reused)
        try:
            logits = engine.eval(ids[reused:])
        finally:
            self._kv_ids = ids[: engine.n_past]
        return sampler.sample(logits, ids), reused

    async def _on_engine(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` in the engine's worker thread.

        Invariant: the thread is never abandoned. On cancellation the engine's abort flag is raised, the thread is
        awaited (it returns within one decode step or one layer), and only then does `Cancelled` propagate — so
        the turn is released only once the engine is idle.
        """
        from strata.engine_cffi import EngineAborted

        for _ in range(2):
            state = _CallState()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._abort_on_cancel, state)
                try:
                    result = await trio.to_thread.run_sync(outcome.capture, fn, *args, limiter=self._limiter)
                finally:
                    state.finished = True
                    nursery.cancel_scope.cancel()
            if state.aborted:
                await trio.lowlevel.checkpoint()  # raises the Cancelled that made us abort
            if not (isinstance(result, outcome.Error) and isinstance(result.error, EngineAborted)):
                return result.unwrap()
            # Aborted although nobody cancelled this call: a flag raised by a cancelled call that finished just
            # before its abort landed. The engine lowered it by aborting; run again.
        return result.unwrap()

    async def _abort_on_cancel(self, state: _CallState) -> None:
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            if not state.finished:
                state.aborted = True
                self.engine.abort()


@dataclass
class _CallState:
    finished: bool = False
    aborted: bool = False


class _Output:
    """Generated token ids to events: detokenise, cut at stop strings, split reasoning and tool calls."""

    def __init__(self, tokenizer: Any, request: ChatRequest, starts_in_reasoning: bool):
        self._decoder = tokenizer.stream_decoder()
        self._stops = StopMatcher(request.stop)
        self._parser = ToolCallParser(starts_in_reasoning=starts_in_reasoning, parse_tool_calls=bool(request.tools))

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    @property
    def n_tool_calls(self) -> int:
        return self._parser.n_tool_calls

    def push(self, token: int) -> list[Event]:
        return self._parser.feed(self._stops.feed(self._decoder.push(token)))

    def finish(self) -> list[Event]:
        if not self._stops.stopped:
            events = self._parser.feed(self._stops.feed(self._decoder.flush()))
            events += self._parser.feed(self._stops.flush())
        else:
            events = []
        return events + self._parser.finish()


def _model_name(path: str | None) -> str:
    if not path:
        return "strata"
    name = os.path.basename(path)
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


@asynccontextmanager
async def open_service(
    config: Config,
    *,
    engine: EngineLike | None = None,
    tokenizer: Any = None,
    wait: bool = True,
    log: Callable[[str], None] = print,
) -> AsyncIterator[Service]:
    """Open a `Service`: its long-lived nursery, the model loaded in a worker thread.

    Args:
        config: the configuration (`config.model` is loaded unless `engine` is given).
        engine, tokenizer: serve these instead of loading `config.model` (both or neither).
        wait: wait until the model is loaded (raising if it fails); False returns at once and loads in the
            background (`service.loaded`, `service.wait_ready()`), so a server can answer /health meanwhile.
        log: where startup lines go.
    """
    service = Service(config)
    try:
        async with trio.open_nursery() as nursery:
            service.nursery = nursery
            if engine is not None:
                service.attach(engine, tokenizer)
            elif wait:
                await service.load(log)
            else:
                nursery.start_soon(_load_quietly, service, log)
            try:
                yield service
            finally:
                nursery.cancel_scope.cancel()
    finally:
        if engine is None:
            service.close()


async def _load_quietly(service: Service, log: Callable[[str], None]) -> None:
    """Background loading: the failure is kept in `service.load_error` for whoever waits."""
    try:
        await service.load(log)
    except Exception as error:  # noqa: BLE001 - reported through service.load_error
        log(f"error: the model failed to load: {error}")


def new_request_id() -> str:
    return uuid.uuid4().hex[:24]

