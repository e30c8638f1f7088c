"""The service: a loaded model's lifetime (loading, its image encoder, closing) and the phases of a chat request
(its prompt prepared, its answer's constraint compiled, a round generated on the engine's turn) as events. A
response's rounds of MCP tool calls are `strata.mcp_tools.rounds`'; generated tokens become events in
`strata.text.output`.

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

import collections
import dataclasses
import os
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing, asynccontextmanager, suppress
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import outcome
import trio

from strata.activity import Activity, RequestProgress
from strata.config import Config
from strata.events import (
    ChatRequest,
    CompletionPrompt,
    Event,
    Finish,
    FinishReason,
    PromptLogprobs,
    PromptProcessed,
    TextDelta,
    Usage,
)
from strata.history import History, HistoryRow
from strata.mcp_tools import McpRequestError, McpServers, Toolset, fit_results, open_toolset, run_rounds
from strata.pictures.downloads import DownloadPolicy, download_client
from strata.pictures.expand import PromptImages, expand_image_pads, marker_tokens
from strata.pictures.sources import DOWNLOAD_TIMEOUT, ImageRejected
from strata.pictures.staging import (
    Downloads,
    PicturesRefused,
    PictureStaging,
    PicturesUnavailable,
    picture_places,
)
from strata.progress import Stage, with_progress
from strata.scheduling.batcher import Batcher, Job
from strata.scheduling.turn import QueueFull, Turn
from strata.text.constraints import GrammarError, Grammars, Guide, plan_constraint
from strata.text.output import LogprobNames, Output
from strata.text.prompt import PromptError, render_chat
from strata.text.prompt_tokens import PromptTokens, strings_of
from strata.text.sampling import Sampler
from strata.vision.client import Embedding, VisionClient, VisionStartError

# Variables the chat template gets from the request itself; `chat_template_kwargs` may not override them.
_RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "add_generation_prompt"})
# A request with at most this many characters of text is rendered and tokenised on the event loop (under a
# millisecond, about what handing it to a worker thread and back costs on a busy core); longer ones in a thread.
INLINE_PROMPT_CHARS = 1024
IMAGE_PAD = "<|image_pad|>"  # the token a chat template renders once per picture, expanded to its rows


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


ENCODER_RETRY_AFTER = 5  # seconds: an encoder that crashed or hung is started again for the next picture


class EngineLike(Protocol):
    """What the service needs of `strata.engine_cffi.Engine` (tests substitute scripted engines): the calls
    `strata.scheduling.batcher.Batcher` makes, and a few properties."""

    n_vocab: int
    n_embd: int
    picture_width: int  # the width of a picture's rows: n_embd, wider with Qwen3-VL's deepstack slices
    n_ctx: int
    n_seq: int
    arch: str
    backend: str
    threads: int

    def eval_batch(self, items: Sequence[Any], notify_fd: int = -1) -> Any: ...
    def seq_n_past(self, seq: int) -> int: ...
    def keep(self, n: int, seq: int = 0) -> None: ...
    def copy_prefix(self, src: int, dst: int, n: int) -> None: ...
    def abort(self, seq: int = 0) -> None: ...
    def clear_abort(self, seq: int = 0) -> None: ...
    def close(self) -> None: ...


@dataclass
class _Prepared:
    prompt: PromptImages  # ids, what the KV cache holds at each position, and the pictures' rows
    max_tokens: int
    starts_in_reasoning: bool
    may_think: bool  # the prompt leaves the model free to open a reasoning block

    @property
    def ids(self) -> list[int]:
        return self.prompt.ids


class Service:
    """A loaded model serving chat requests, up to `config.slots` generating at once (see `open_service`).

    Attributes:
        turn: the FIFO of requests waiting for one of the engine's slots (`turn.busy`, `turn.queued`).
        history: recent requests and totals.
        activity: every request in flight, with its phase and prompt progress.
    """

    def __init__(self, config: Config):
        self.config = config
        self.turn = Turn(max_queued=config.limits.queue_length, slots=config.slots)
        self.history = History(config.limits.history_size)
        self._generating: list[tuple[HistoryRow, _Stream]] = []  # requests on a slot, in arrival order
        self.activity = Activity()
        self.stopping = trio.Event()  # set when the server starts shutting down: endless streams end
        self.downloads = Downloads(self.stopping)  # image URLs (open_service gives it its client)
        self.model_names = model_names(config)  # the served name first, then the other aliases
        self.model_name = self.model_names[0]
        self.started = time.time()
        self.engine: Any = None  # an EngineLike once loaded
        self.tokenizer: Any = None
        self.grammars: Grammars | None = None  # the model's compiled answer grammars (constrained decoding)
        self.template: str | None = None
        self.prompt_tokens: PromptTokens | None = None
        self.load_error: BaseException | None = None
        self.loaded = trio.Event()
        self.nursery: trio.Nursery | None = None  # the service's long-lived nursery (open_service)
        self.vision: VisionClient | None = None  # the image encoder, when the config has one
        self.mcp = McpServers(config.mcp_servers, config.mcp)  # the configured MCP servers (open_service starts them)
        self.loop: _EngineLoop | None = None  # the engine's batcher and its thread (attach)

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
        self.grammars = Grammars(tokenizer, engine.n_vocab)
        self.prompt_tokens = PromptTokens(tokenizer)
        # as many slots as the engine has sequences (an engine passed in may have fewer than config.slots)
        self.turn = Turn(max_queued=self.config.limits.queue_length, slots=getattr(engine, "n_seq", 1))
        self.loop = _EngineLoop(Batcher(engine, self.config.step_tokens, self.config.batch, self.config.step_slowdown))
        self.loaded.set()

    async def load(self, log: Callable[[str], None] = print) -> None:
        """Load the configured model in a worker thread; a failure is kept in `load_error` and re-raised."""
        try:
            engine, tokenizer = await with_progress(
                log, f"loading {self.config.model}",
                lambda stage: trio.to_thread.run_sync(self._load_blocking, log, stage))
            try:
                await self.start_vision(engine, log)
            except BaseException:
                engine.close()
                raise
            self.attach(engine, tokenizer)
            bands = f", output weight in bands {engine.prepared_bytes / 2**20:.0f} MiB" if engine.prepared_bytes else ""
            copied = f", weights copied to huge pages {engine.copied_bytes / 2**20:.0f} MiB" if engine.copied_bytes \
                else ""
            log(f"model: {self.config.model} ({engine.arch}), context {engine.n_ctx}, threads {engine.threads}, "
                f"backend {engine.backend}{bands}{copied}")
            budget = "" if self.config.kv_budget is None else f" of a {self.config.kv_budget:g} MiB budget"
            log(f"KV cache: {engine.n_seq} slots x {engine.n_ctx} positions ({self.config.kv}), "
                f"{engine.kv_bytes / 2**20:.0f} MiB{budget}")
        except BaseException as error:
            self.load_error = error
            self.loaded.set()
            raise

    def _load_blocking(self, log: Callable[[str], None], stage: Stage) -> tuple[Any, Any]:
        from strata.engine_cffi import Engine
        from strata.text.tokenizer import Tokenizer

        config = self.config
        if not config.model:
            raise ServiceUnavailable('no model configured (the "model" key or --model)')
        size = os.path.getsize(config.model) if os.path.isfile(config.model) else 0
        log(f"loading {config.model} ({size / 2**20:,.0f} MiB) ...")
        started = time.perf_counter()
        stage.now = "tensors and context"
        budget = None if config.kv_budget is None else int(config.kv_budget * 2**20)
        engine = Engine.load(config.model, n_ctx=config.context, threads=config.threads, kv=config.kv,
                             n_batch=config.batch, n_seq=config.slots, kv_budget=budget,
                             mapped_weights=config.mapped_weights)
        try:
            stage.now = "tokenizer"
            tokenizer = Tokenizer.from_gguf(config.model)
        except BaseException:
            engine.close()
            raise
        log(f"loaded in {time.perf_counter() - started:.1f} s")
        return engine, tokenizer

    async def start_vision(self, engine: EngineLike, log: Callable[[str], None] = print) -> None:
        """Start the configured image encoder in the service's nursery (after the model, whose width its rows
        must have).

        Raises:
            VisionStartError: a local encoder that could not start, or whose rows do not fit the model.
        """
        vision = self.config.vision
        if not (vision.mmproj or vision.exe):
            return
        assert self.nursery is not None
        client = self.vision = VisionClient(vision, engine_threads=engine.threads, log=log)
        what = f"vision: starting the {client.mode()} encoder"
        log(f"{what} ...")
        nursery = self.nursery
        await with_progress(log, what, lambda stage: nursery.start(client.run))
        ready, n_embd = client.last_ready, engine.picture_width
        if ready is not None and ready.n_embd != n_embd and not vision.remote:
            raise VisionStartError(f"the image encoder's rows are {ready.n_embd} wide and the model's embeddings "
                                   f"{n_embd}: {vision.mmproj} was made for another model")

    async def wait_ready(self) -> None:
        """Wait until the model is loaded; raise `ServiceUnavailable` if loading failed."""
        await self.loaded.wait()
        if self.load_error is not None:
            raise ServiceUnavailable(f"the model failed to load: {self.load_error}")

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()

    # --- requests

    def render(self, request: ChatRequest) -> str:
        """The prompt text of a request (the chat template applied to its messages and tools)."""
        kwargs = dict(request.template_kwargs)
        clash = _RESERVED_TEMPLATE_VARS.intersection(kwargs)
        if clash:
            raise RequestError(f"chat_template_kwargs may not set {', '.join(sorted(clash))}")
        enable_thinking = kwargs.pop("enable_thinking", request.enable_thinking)
        assert self.template is not None, "render before the model is loaded"
        try:
            text = render_chat(self.template, request.messages, tools=request.tools or None,
                               add_generation_prompt=not request.prefill, enable_thinking=enable_thinking, **kwargs)
        except PromptError as error:
            raise RequestError(str(error)) from None
        return _open_last_turn(text, request.messages[-1]) if request.prefill else text

    async def count_tokens(self, request: ChatRequest) -> int:
        """How many prompt tokens a request has, each picture counted as the rows its encoding takes: pictures
        are encoded to know that (cancellable like a chat request's, and cached for the request that follows).

        Raises: what preparing the same chat request would (`RequestError`, `ServiceUnavailable`).
        """
        self._require_ready()
        if request.mcp:
            toolset = await self._toolset(request)
            await toolset.aclose()
            request = dataclasses.replace(request, tools=request.tools + toolset.functions())
        request, pictures = await self._pictures(request)
        _, ids = await trio.to_thread.run_sync(self._prompt, request)
        # each picture's pad becomes its rows, and its parts' markers when it is split into tiles
        return len(ids) + sum(picture.n_tokens + marker_tokens(picture.grid, self._marker_ids) - 1
                              for picture in pictures)

    def _require_ready(self) -> None:
        if not self.loaded.is_set():
            raise ServiceUnavailable("the model is still loading")
        if self.load_error is not None:
            raise ServiceUnavailable(f"the model failed to load: {self.load_error}")

    def _prompt(self, request: ChatRequest) -> tuple[str, list[int]]:
        """The prompt text and token ids of a request, control tokens typed in its text tokenised as text (see
        `strata.text.prompt_tokens`). Blocking work (in a worker thread): a request whose text cannot fit the context
        is refused before any of it is done."""
        guard = self.prompt_tokens
        assert guard is not None, "prompt before the model is loaded"
        try:
            guard.check_length(list(strings_of([request.messages, request.tools, request.template_kwargs])),
                               self.engine.n_ctx)
        except ValueError as error:
            raise RequestError(str(error)) from None
        text = self.render(dataclasses.replace(request, messages=guard.protect(request.messages),
                                               tools=guard.protect(request.tools),
                                               template_kwargs=guard.protect(request.template_kwargs)))
        return text, self.tokenizer.with_bos(guard.encode(text))

    def _completion_prompt(self, completion: CompletionPrompt) -> tuple[str, list[int]]:
        """A raw completion's prompt text and ids: the text tokenised as plain text, or the ids checked; with a
        suffix, the fill-in-the-middle form `<prefix>prompt<suffix>suffix<middle>` with the tokens the model
        has (`Tokenizer.fim`)."""
        tokenizer, guard = self.tokenizer, self.prompt_tokens
        assert guard is not None, "prompt before the model is loaded"
        try:
            guard.check_length([completion.text or "", completion.suffix or ""], self.engine.n_ctx)
        except ValueError as error:
            raise RequestError(str(error), "prompt") from None
        if completion.ids is not None:
            bad = [token for token in completion.ids if not 0 <= token < self.engine.n_vocab]
            if bad:
                raise RequestError(f"prompt: token ids go up to {self.engine.n_vocab - 1}, got {bad[0]}", "prompt")
            ids = list(completion.ids)
        else:
            ids = guard.encode_text(completion.text or "")
        if completion.suffix is not None:
            fim = getattr(tokenizer, "fim", None)
            if fim is None:
                raise RequestError("suffix: this model has no fill-in-the-middle tokens (no "
                                   "tokenizer.ggml.fim_pre/suf/mid_token_id keys, and no <|fim_prefix|>, "
                                   "<|fim_suffix|>, <|fim_middle|> or similar tokens in its vocabulary)", "suffix")
            prefix, suffix, middle = fim
            ids = [prefix, *ids, suffix, *guard.encode_text(completion.suffix), middle]
        if not ids:
            raise RequestError("prompt: must not be empty", "prompt")
        if completion.ids is None:  # a text prompt starts with BOS when the model wants one, as a chat prompt does
            ids = tokenizer.with_bos(ids)
        return tokenizer.decode(ids), ids

    def _prepare(self, request: ChatRequest, pictures: list[Embedding], results: int = 0) -> _Prepared:
        """The request's prompt (its last `results` messages are tool results it may cut: `_fitted_prompt`),
        checked against the context, with its pictures' rows and its answer's room."""
        self._require_ready()
        if request.completion is not None:
            text, ids = self._completion_prompt(request.completion)
        elif results:
            text, ids = self._fitted_prompt(request, pictures, results)
        else:
            text, ids = self._prompt(request)
        pad_id = self.tokenizer.token_to_id(IMAGE_PAD)
        if pictures:
            try:
                prompt = expand_image_pads(ids, pad_id, pictures, self._marker_ids)
            except ImageRejected as error:
                raise RequestError(str(error)) from None
        else:
            prompt = PromptImages(ids, list(ids), [])
        ids = prompt.ids
        n_ctx = self.engine.n_ctx
        if len(ids) >= n_ctx:
            raise RequestError(f"the prompt has {len(ids)} tokens; the context holds {n_ctx} (prompt and answer)",
                               code="context_length_exceeded")
        if any(token >= self.engine.n_vocab for token, _ in request.sampling.logit_bias):
            raise RequestError(f"logit_bias: token ids go up to {self.engine.n_vocab - 1}", "logit_bias")
        max_tokens = n_ctx - len(ids)
        for cap in (request.max_tokens, self.config.limits.max_tokens):
            if cap is not None:
                max_tokens = min(max_tokens, cap)
        if request.completion is not None:
            return _Prepared(prompt, max_tokens, False, False)
        starts_in_reasoning = text.rstrip("\n").endswith("<think>")
        # An empty block closed by the template means no thinking; a continued answer is past its thinking.
        may_think = not text.rstrip().endswith("</think>") and not request.prefill
        return _Prepared(prompt, max_tokens, starts_in_reasoning, may_think)

    def _fitted_prompt(self, request: ChatRequest, pictures: list[Embedding], results: int) -> tuple[str, list[int]]:
        """`_prompt` of a response's next round, whose last `results` messages are the tool results the model has
        not read yet: cut to fit (`strata.mcp_tools.fit_results`) when the prompt would leave the answer less
        than a quarter of the context (or the request's max_tokens, if less)."""
        assert self.prompt_tokens is not None
        answer = min(cap for cap in (self.engine.n_ctx // 4, request.max_tokens, self.config.limits.max_tokens)
                     if cap is not None)
        budget = self.engine.n_ctx - answer - sum(picture.n_tokens + marker_tokens(picture.grid, self._marker_ids)
                                                  - 1 for picture in pictures)
        try:
            text, ids = self._prompt(request)
            if len(ids) <= budget:
                return text, ids
        except RequestError:
            pass  # its text alone is longer than the context: cut below
        messages = fit_results(request.messages, results, budget,
                               lambda messages: len(self._prompt(dataclasses.replace(request, messages=messages))[1]),
                               self.prompt_tokens.encode_text, self.tokenizer.decode)
        return self._prompt(dataclasses.replace(request, messages=messages))

    def _marker_ids(self, marker: str) -> list[int]:
        """The ids of a tiled picture's part marker: its token where the vocabulary has one (LFM2-VL's), else the
        marker's text (as llama.cpp reads a row-and-column marker)."""
        token = self.tokenizer.token_to_id(marker)
        if token is not None:
            return [token]
        assert self.prompt_tokens is not None, "prompt before the model is loaded"
        return self.prompt_tokens.encode_text(marker)

    async def _guide(self, request: ChatRequest, prepared: _Prepared) -> Guide | None:
        """The constraint of a request's answer (format, tool choice), compiled in a worker thread; None when the
        answer is free.

        Raises:
            RequestError: a schema or grammar that cannot be enforced (naming its field).
        """
        assert self.grammars is not None
        try:
            # A prefilled answer (past any reasoning) is the start of the constrained one.
            prefix = "" if not request.prefill or prepared.starts_in_reasoning else \
                _message_text(request.messages[-1]).rpartition("</think>")[2].strip()
            plan = plan_constraint(answer_format=request.answer_format, tools=request.tools,
                                   tool_choice=request.tool_choice, parallel_tool_calls=request.parallel_tool_calls,
                                   thinking=prepared.may_think, in_reasoning=prepared.starts_in_reasoning,
                                   tokens=self.grammars.tokens, prefix=prefix, tool_fields=request.tool_fields)
            if plan is None:
                return None
            # Abandoning is safe: a compiled grammar only lands in the cache.
            return await trio.to_thread.run_sync(self.grammars.guide, plan, abandon_on_cancel=True)
        except GrammarError as error:
            raise RequestError(str(error), error.param) from None

    # --- pictures

    async def _pictures(self, request: ChatRequest, live: RequestProgress | None = None
                        ) -> tuple[ChatRequest, list[Embedding]]:
        """Encode the request's pictures, in prompt order, in the calling task (the request's: cancellable); see
        `strata.pictures.staging`.

        A picture a tool returned that cannot be used becomes the text `[image omitted: <why>]`; the user's own
        is a `RequestError` (400), and an encoder that is not available a `ServiceUnavailable` (503).
        """
        try:
            places = picture_places(request.messages, self.config.limits.max_pictures, self.vision is not None)
            if not places:
                return request, []
            self._require_ready()
            assert self.vision is not None
            staging = PictureStaging(self.vision, self.downloads, _Exclusive(self), self.engine.n_ctx,
                                     self.engine.picture_width, self._marker_ids)
            messages, pictures = await staging.encode(request.messages, places, live)
        except PicturesRefused as error:
            raise RequestError(str(error), error.param, error.code) from None
        except PicturesUnavailable as error:
            raise ServiceUnavailable(str(error), retry_after=ENCODER_RETRY_AFTER) from None
        return dataclasses.replace(request, messages=messages), pictures

    async def chat(self, request: ChatRequest, *, request_id: str | None = None) -> AsyncGenerator[Event, None]:
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
        with self.activity.track(row) as live:
            toolset: Toolset | None = None
            try:
                if request.mcp:
                    toolset = await self._toolset(request)
                    request = dataclasses.replace(request, tools=request.tools + toolset.functions())
                rounds = run_rounds(request, self._round, toolset, live, max_rounds=self.config.mcp.max_rounds,
                                    sees_pictures=self._sees_pictures)
                async with aclosing(rounds) as events:
                    async for event in events:
                        yield event
            except (trio.Cancelled, GeneratorExit):
                row.finish = "cancel"
                raise
            except RequestError:
                row.finish = "refused"  # a 400: the request's fault, not a failure of the server
                raise
            except (ServiceUnavailable, QueueFull):
                row.finish = "unavailable"  # a 503
                raise
            except BaseException:
                row.finish = "error"
                raise
            finally:
                if toolset is not None:
                    await toolset.aclose()
                row.duration = time.perf_counter() - started
                self.history.record(row)

    async def _toolset(self, request: ChatRequest) -> Toolset:
        assert self.nursery is not None
        client_tools = {tool["function"]["name"] for tool in request.tools}
        try:
            return await open_toolset(request.mcp, self.mcp, client_tools, self.nursery)
        except McpRequestError as error:
            raise RequestError(str(error), error.param) from None

    def _sees_pictures(self) -> bool:
        """Whether the model is given the pictures MCP tools return: it has an image encoder."""
        return self.vision is not None

    @asynccontextmanager
    async def _round(self, request: ChatRequest, live: RequestProgress,
                     results: int) -> AsyncIterator[AsyncIterator[Event]]:
        """One round of a response (`strata.mcp_tools.rounds.RoundEvents`): the request's pictures encoded, its
        prompt prepared (its last `results` tool results cut to fit) and its answer's constraint compiled, then
        the engine's turn held while the caller takes the generated events."""
        live.phase = "prepare"
        request, pictures = await self._pictures(request, live)
        if pictures or not _short(request):
            prepared = await trio.to_thread.run_sync(self._prepare, request, pictures, results)
        else:  # a worker thread's round trip would cost more than the work
            prepared = self._prepare(request, pictures, results)
        guide = await self._guide(request, prepared)
        live.row.prompt_tokens += len(prepared.ids)  # the response's prompt: the earlier rounds' and this one
        live.phase = "queued"
        async with self.turn.hold():
            try:
                async with aclosing(self._generate(request, prepared, live, guide)) as events:
                    yield events
            finally:
                live.slot = None

    async def _generate(self, request: ChatRequest, prepared: _Prepared, live: RequestProgress,
                        guide: Guide | None) -> AsyncGenerator[Event, None]:
        assert self.loop is not None
        row = live.row
        live.phase = "prompt"
        before = row.output_tokens  # tokens of earlier rounds of this response
        sampler = Sampler(request.sampling, self.engine.n_vocab, mask=guide, logprobs=request.logprobs)
        echo = request.completion is not None and request.completion.echo
        job = Job(prepared.ids, sampler, prepared.max_tokens, self.tokenizer.eos_ids, keys=prepared.prompt.keys,
                  spans=prepared.prompt.spans, tag=row.id, progress=live,
                  prompt_logprobs=request.logprobs if echo else None)
        # Everything this task can make before the job goes: the engine thread needs the GIL to start the job's
        # call, and gets it only once this task waits for the first token.
        output = Output(self.tokenizer, request, prepared.starts_in_reasoning)
        names = LogprobNames(self.tokenizer.id_bytes)
        finish: FinishReason | None = None
        reasoning_tokens = 0
        stream = _Stream(self.loop, job)
        self._generating.append((row, stream))
        try:
            while finish is None:
                tokens = await stream.next_tokens()
                if live.phase == "prompt":
                    yield PromptProcessed(len(prepared.ids), job.reused)
                    if echo:
                        if job.prompt_logprobs is not None:
                            yield PromptLogprobs(names.prompt_logprobs(prepared.ids, job.prompt_records))
                        yield TextDelta(self.tokenizer.decode(prepared.ids))
                live.phase = "decode"
                row.reused_tokens, row.prompt_seconds, row.decode_seconds = job.reused, *stream.seconds()
                if not tokens:  # the job left its slot: a stop token, or the token budget is spent
                    finish = "stop" if job.finish == "stop" else "length"
                for token in tokens:
                    row.output_tokens += 1
                    was_reasoning = output.in_reasoning
                    events = output.push(token)
                    if request.logprobs is not None and was_reasoning == output.in_reasoning:  # not a tag
                        yield names.logprob(token, sampler.records[row.output_tokens - before - 1], was_reasoning)
                    for event in events:
                        yield event
                    reasoning_tokens += was_reasoning or output.in_reasoning  # the tags count as reasoning
                    if output.stopped:
                        finish = "stop"
                        break
                    if row.output_tokens - before >= prepared.max_tokens:
                        finish = "length"
                        break
        finally:
            try:
                await stream.stop()
            finally:
                self._generating.remove((row, stream))
        for event in output.finish():
            yield event
        if finish == "stop" and output.n_tool_calls:
            finish = "tool_calls"
        row.finish = finish
        yield Usage(prompt_tokens=len(prepared.ids), cached_tokens=row.reused_tokens,
                    completion_tokens=row.output_tokens - before, reasoning_tokens=reasoning_tokens)
        yield Finish(finish, output.stop_sequence)

    @property
    def phase(self) -> str:
        """"decode" while some request is generating tokens, "prompt" while requests only process their prompts,
        else "idle"."""
        phases = {"decode" if stream.job.decoding else "prompt" for _, stream in self._generating}
        return "decode" if "decode" in phases else phases.pop() if phases else "idle"

    @property
    def current(self) -> HistoryRow | None:
        """The row of the earliest request on a slot, or None."""
        return self._generating[0][0] if self._generating else None

    def slots(self) -> list[dict[str, Any]]:
        """Each slot: its state ("idle", "prompt", "decode"), the request on it, and the positions it holds."""
        if self.loop is None:
            return []
        return [{"slot": slot.seq, "request": None if slot.job is None else slot.job.tag,
                 "state": "idle" if slot.job is None else "decode" if slot.job.decoding else "prompt",
                 "cached_tokens": len(slot.keys)} for slot in self.loop.batcher.slots]

    @property
    def engine_running(self) -> bool:
        """Whether an engine thread is running (until trio has seen its end)."""
        return self.loop is not None and self.loop.periods > 0


class _Exclusive:
    """The engine taken whole, for an image encoder that shares its GPU: `hold()` waits until the engine thread
    is between two steps and keeps it there (the whole batch waits) for the block."""

    def __init__(self, service: Service):
        self._service = service

    @asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        assert self._service.loop is not None
        async with self._service.loop.paused():
            self._service.turn.exclusive += 1
            try:
                yield
            finally:
                self._service.turn.exclusive -= 1


class _EngineLoop:
    """The engine thread: while any job has work it runs `Batcher.step()` after step, adding the jobs that arrived
    between steps; with nothing left to do it waits `LINGER_SECONDS` for the next job, then ends (the next job
    starts it again), so an idle server holds no thread. Agents send their requests in bursts (a turn, a side
    request, a sub-agent's call): a job handed to the waiting thread starts 0.1-0.2 ms sooner than one that
    starts a thread through trio's thread cache, on the first token's path.

    Invariant: a job reaches the engine only through the batcher, in this thread; a cancelled job leaves at the
    next step boundary (an engine call in flight drops its sequence within one layer), and the others go on.

    The requests' tasks learn of their tokens through the thread's `_Relay`: a step's wake-ups go to trio as the
    next engine call starts, one wake-up for every stream of the step. A step that gave some job its first token
    (or ended one) wakes trio from the engine thread at once: the first token is what a client waits for. After
    a first token the engine thread also waits, at most `HANDOFF_SECONDS`, until those requests have taken it
    (the response's headers and first write, the most Python a request runs at once): run beside the next step,
    that work shared the cores with the engine's threads and took 2-3 times as long. The other streams lose that
    wait once per request that joins.
    """

    HANDOFF_SECONDS = 0.003
    LINGER_SECONDS = 1.0

    def __init__(self, batcher: Batcher):
        self.batcher = batcher
        self._cond = threading.Condition()
        self._inbox: list[_Stream] = []  # submitted, not yet added to the batcher (guarded by _cond)
        self._streams: dict[Job, _Stream] = {}  # the batcher's jobs (guarded by _cond)
        self.running = False  # the engine thread runs (guarded by _cond)
        self.periods = 0  # engine threads started whose end trio has not seen yet (trio only)
        self._pauses = 0  # paused() holders (guarded by _cond)
        self._pause_ack: trio.Event | None = None
        self._handoffs: set[_Stream] = set()  # woken with a first token, not taken yet (guarded by _cond)
        self._closing = False  # no job comes any more: a waiting engine thread ends (guarded by _cond)
        self._ended: trio.Event | None = None  # set when trio has seen the last engine thread end

    def submit(self, stream: _Stream) -> None:
        with self._cond:
            self._inbox.append(stream)
            if not self.running:
                self.running = True
                self.periods += 1
                relay = _Relay()  # this engine thread's
                trio.lowlevel.spawn_system_task(relay.deliver, name="strata engine relay")
                trio.lowlevel.start_thread_soon(partial(self._work, relay), partial(self._ended_with, relay),
                                                name="strata engine")
            self._cond.notify()

    def cancel(self, stream: _Stream) -> None:
        """Take a stream's job out: from the inbox at once, else at the batcher's next step."""
        with self._cond:
            if stream in self._inbox:
                self._inbox.remove(stream)
                stream.job.finish = "cancel"
                stream.wake()
            elif stream.job.finish is None:
                self.batcher.cancel(stream.job)
            self._handoffs.discard(stream)
            self._cond.notify()

    @asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """Keep the engine thread between two steps for the block."""
        with self._cond:
            self._pauses += 1
            ack = None
            if self.running:
                self._pause_ack = ack = trio.Event()
            self._cond.notify()
        try:
            if ack is not None:
                await ack.wait()
            yield
        finally:
            with self._cond:
                self._pauses -= 1
                self._cond.notify()

    async def close(self) -> None:
        """End the engine thread once it has no job (at once if it waits for one), and wait until trio has seen
        it end, at most `LINGER_SECONDS` longer than its jobs: the service is closing, no job comes."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self.periods:
            self._ended = trio.Event()
            with trio.CancelScope(shield=True), trio.move_on_after(self.LINGER_SECONDS):
                await self._ended.wait()

    def taken(self, stream: _Stream) -> None:
        """A stream woken with its first token has taken it (see `HANDOFF_SECONDS`)."""
        with self._cond:
            self._handoffs.discard(stream)
            if not self._handoffs:
                self._cond.notify()

    # in the engine thread

    def _work(self, relay: _Relay) -> None:
        try:
            self._steps(relay)
        finally:
            self.batcher.notify_fd = -1

    def _steps(self, relay: _Relay) -> None:
        idle_until = None  # the time this thread ends unless a job comes
        while True:
            with self._cond:
                if self._pauses:
                    relay.put(self._acknowledge_pause)
                    relay.notify()
                    while self._pauses:
                        self._cond.wait()
                arrived, self._inbox = self._inbox, []
                if not arrived and not self.batcher.jobs:
                    relay.flush()  # no engine call comes to carry the wake-ups queued
                    now = time.monotonic()
                    idle_until = idle_until or now + self.LINGER_SECONDS
                    if now >= idle_until or self._closing:
                        self.running = False
                        return
                    self._cond.wait(idle_until - now)
                    continue
                idle_until = None
                for stream in arrived:  # under the lock: cancel() finds a job either in the inbox or here
                    self.batcher.add(stream.job)
                    self._streams[stream.job] = stream
            # The next call carries the wake-ups queued, if any: a call that wakes trio for nothing (a prompt's)
            # shares the cores with the loop's turn for nothing.
            self.batcher.notify_fd = relay.fd if relay.queued else -1
            changed = self.batcher.step()
            if not changed:
                continue
            with self._cond:
                streams = [self._streams[job] if job.finish is None else self._streams.pop(job) for job in changed]
            wake = partial(_wake_all, streams)
            if any(len(stream.job.tokens) <= 1 for stream in streams):
                # A first token (or an end): trio is woken now, not as the next call starts, at the price of
                # this thread waiting for the GIL once before that call.
                firsts = {stream for stream in streams if stream.job.finish is None and len(stream.job.tokens) == 1}
                for stream in firsts:
                    stream.handing_off = True
                with self._cond:
                    self._handoffs = firsts
                relay.put(wake)
                relay.notify()
                if firsts:
                    self._await_handoffs()
            else:
                relay.put(wake)  # one wake-up of trio for every stream of the step, as the next call starts

    def _await_handoffs(self) -> None:
        deadline = time.monotonic() + self.HANDOFF_SECONDS
        with self._cond:
            while self._handoffs and not self._pauses and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            self._handoffs = set()

    def _ended_with(self, relay: _Relay, result: outcome.Outcome) -> None:
        """The engine thread's last act: trio learns its outcome after every wake-up it queued."""
        relay.end(partial(self._finish, result))

    # back in trio

    def _acknowledge_pause(self) -> None:
        if self._pause_ack is not None:
            self._pause_ack.set()

    def _finish(self, result: outcome.Outcome) -> None:
        """The engine thread ended. An exception there (a bug: engine errors end jobs, not the thread) fails every
        job it had."""
        self.periods -= 1
        self._acknowledge_pause()
        if self._ended is not None and not self.periods:
            self._ended.set()
        if isinstance(result, outcome.Error):
            with self._cond:
                self.running = False
                streams = list(self._streams.values()) + self._inbox
                self._streams.clear()
                self._inbox = []
            for stream in streams:
                stream.job.error, stream.job.finish = result.error, "error"
                stream.wake()


class _Relay:
    """One engine thread's wake-ups of trio: the thread queues calls, and an eventfd wakes a trio task (a system
    task: it lives as long as the thread) that runs them in order, the thread's outcome last.

    The engine call after a step carries the notification: it adds 1 to the eventfd as it starts, without the GIL
    (`strata_batch.notify_fd`), so the loop wakes while the engine computes, and finds the GIL free. The engine
    thread writes the eventfd itself only where no call follows (it waits, pauses or ends): the write releases the
    GIL, and a loop already awake takes it there and holds the thread for as long as it renders (0.1-0.25 ms a
    token, measured when the thread woke trio after every step). A thread of its own for the wake-ups, as before,
    cost a second wake-up per step on the cores the engine keeps busy, and 0.07 ms of CPU a token at one stream.
    The eventfd closes when both the engine thread and the task are done with it."""

    _END = None  # queued after the engine thread's outcome: the task ends there

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._calls: collections.deque[Callable[[], object] | None] = collections.deque()
        self._holders = 2  # the engine thread and the trio task
        self._lock = threading.Lock()

    # in the engine thread

    def put(self, call: Callable[[], object]) -> None:
        self._calls.append(call)

    def notify(self) -> None:
        os.eventfd_write(self.fd, 1)

    @property
    def queued(self) -> bool:
        return bool(self._calls)

    def flush(self) -> None:
        if self._calls:
            self.notify()

    def end(self, call: Callable[[], object]) -> None:
        self._calls.extend((call, self._END))
        self.notify()
        self._release()

    # in trio

    async def deliver(self) -> None:
        try:
            while True:
                await trio.lowlevel.wait_readable(self.fd)
                with suppress(BlockingIOError):  # a notification the last pass took already
                    os.eventfd_read(self.fd)
                while self._calls:
                    call = self._calls.popleft()
                    if call is self._END:
                        return
                    call()
        finally:
            trio.lowlevel.notify_closing(self.fd)
            self._release()

    def _release(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders:
                return
        os.close(self.fd)


def _wake_all(streams: list[_Stream]) -> None:
    for stream in streams:
        stream.wake()


class _Stream:
    """A request's view of its job: the tokens as they come, and `stop()`, awaited on every exit of the request
    (cancellation included), which takes the job out and waits, shielded, until it has left its slot."""

    def __init__(self, loop: _EngineLoop, job: Job):
        self.job, self._loop = job, loop
        self._taken = 0
        self.handing_off = False  # the engine thread waits for this stream to take its first token
        self._waiter: trio.Event | None = None
        self._ended = trio.Event()
        loop.submit(self)

    def seconds(self) -> tuple[float, float]:
        """(prompt seconds, decode seconds) so far."""
        job = self.job
        if not job.prompt_done:
            return time.perf_counter() - job.started, 0.0
        return job.prompt_done - job.started, max(job.last_token - job.prompt_done, 0.0)

    async def next_tokens(self) -> list[int]:
        """Wait for sampled tokens; [] once the job has left its slot and every token was taken.

        Raises: what the engine raised (EngineError, ...).
        """
        if self.handing_off:  # called again: the first token went out (or more tokens are needed for it)
            self.handing_off = False
            self._loop.taken(self)
        waited = False
        while True:
            ended = self.job.finish is not None  # read first: every token is appended before finish is set
            tokens = self.job.tokens[self._taken:]
            if tokens and not waited:
                # Tokens that came while the last ones were sent: give the loop a turn (the sends themselves need
                # not: see the API's `_patch_tcp_server_send`), then take them and any that came meanwhile.
                waited = True
                await trio.lowlevel.checkpoint()
                continue
            if tokens:
                self._taken += len(tokens)
                return tokens
            if ended:
                if self.job.error is not None:
                    raise self.job.error
                return []
            # `wake` runs in trio, so no wake-up falls between the reads above and this wait.
            self._waiter = waiter = trio.Event()
            await waiter.wait()
            waited = True

    def wake(self) -> None:
        if self._waiter is not None:
            self._waiter.set()
        if self.job.finish is not None:
            self._ended.set()

    async def stop(self) -> None:
        if not self._ended.is_set():
            self._loop.cancel(self)
            with trio.CancelScope(shield=True):
                await self._ended.wait()


def _short(request: ChatRequest) -> bool:
    """Whether the request's text (messages, tools, template arguments, a raw prompt) is at most
    `INLINE_PROMPT_CHARS` characters."""
    n = 0
    completion = request.completion
    if completion is not None:
        n = len(completion.text or "") + len(completion.ids or ()) + len(completion.suffix or "")
    for text in strings_of([request.messages, request.tools, request.template_kwargs]):
        n += len(text)
        if n > INLINE_PROMPT_CHARS:
            return False
    return n <= INLINE_PROMPT_CHARS


def _open_last_turn(text: str, message: dict[str, Any]) -> str:
    """The prompt of a conversation whose last (assistant) message the model continues: the rendering cut right
    after that message's text, before the template closes its turn.

    Raises:
        RequestError: the last message is not the assistant's, or the template's rendering does not hold its text.
    """
    if message.get("role") != "assistant":
        raise RequestError("continuing the final message needs an assistant message last", "messages")
    content = _message_text(message).strip()
    at = text.rfind(content) if content else -1
    if at < 0:
        raise RequestError("the chat template does not render the final assistant message's text, so it cannot be "
                           "continued", "messages")
    return text[: at + len(content)]


def _message_text(message: dict[str, Any]) -> str:
    content = message.get("content") or ""
    if not isinstance(content, str):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content


def model_names(config: Config) -> list[str]:
    """The names the model is served as: the `model_alias` names, else the file's name."""
    aliases = [name.strip() for name in (config.model_alias or "").split(",") if name.strip()]
    if aliases:
        return aliases
    return [os.path.basename(config.model).removesuffix(".gguf") if config.model else "strata"]


@asynccontextmanager
async def open_service(
    config: Config,
    *,
    engine: EngineLike | None = None,
    tokenizer: Any = None,
    wait: bool = True,
    log: Callable[[str], None] = print,
) -> AsyncIterator[Service]:
    """Open a `Service`: its long-lived nursery, the model loaded in a worker thread, then the image encoder when
    the config has one (a local encoder that cannot start raises `VisionStartError`; with `wait=False` it is kept
    in `service.load_error` like a model that failed to load).

    Args:
        config: the configuration (`config.model` is loaded unless `engine` is given).
        engine, tokenizer: serve these instead of loading `config.model` (both or neither).
        wait: wait until the model is loaded (raising if it fails); False returns at once and loads in the
            background (`service.loaded`, `service.wait_ready()`), so a server can answer /health meanwhile.
        log: where startup lines go.
    """
    service = Service(config)
    failure: VisionStartError | None = None
    try:
        images = config.images
        policy = DownloadPolicy.from_config(images.allow_private, images.allow_hosts)
        async with trio.open_nursery() as nursery, download_client(policy, DOWNLOAD_TIMEOUT) as http:
            service.nursery, service.downloads.client = nursery, (http if images.downloads else None)
            nursery.start_soon(service.downloads.stop_at_shutdown)
            service.mcp = McpServers(config.mcp_servers, config.mcp, log, policy)
            await service.mcp.start(nursery)
            try:
                if engine is not None:
                    await service.start_vision(engine, log)
                    service.attach(engine, tokenizer)
                elif wait:
                    await service.load(log)
                else:
                    nursery.start_soon(_load_quietly, service, log)
            except VisionStartError as error:
                failure = error
            if failure is None:
                try:
                    yield service
                finally:
                    if service.loop is not None:
                        await service.loop.close()
                    nursery.cancel_scope.cancel()
            nursery.cancel_scope.cancel()
    finally:
        if engine is None:
            service.close()
    if failure is not None:
        raise failure  # outside the nursery: the caller sees the reason itself, not an exception group


async def _load_quietly(service: Service, log: Callable[[str], None]) -> None:
    """Background loading: the failure is kept in `service.load_error` for whoever waits."""
    try:
        await service.load(log)
    except VisionStartError as error:
        log(f"error: {error}")
    except Exception as error:  # noqa: BLE001 - reported through service.load_error
        log(f"error: the model failed to load: {error}")
