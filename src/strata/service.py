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

import dataclasses
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from typing import Any

import trio

from strata.activity import Activity, RequestProgress
from strata.config import Config
from strata.events import (
    ChatRequest,
    Event,
    Finish,
    FinishReason,
    PromptLogprobs,
    PromptProcessed,
    TextDelta,
    Usage,
)
from strata.history import History, HistoryRow
from strata.mcp_tools import McpRequestError, McpServers, Toolset, open_toolset, run_rounds
from strata.pictures.downloads import DownloadPolicy, download_client
from strata.pictures.expand import marker_tokens
from strata.pictures.sources import DOWNLOAD_TIMEOUT
from strata.pictures.staging import (
    Downloads,
    PicturesRefused,
    PictureStaging,
    PicturesUnavailable,
    picture_places,
)
from strata.progress import Stage, with_progress
from strata.prompts import Prepared, Prompts, message_text, short
from strata.request_errors import RequestError, ServiceUnavailable
from strata.scheduling.batcher import Batcher, Job, salted
from strata.scheduling.engine_like import EngineLike
from strata.scheduling.engine_loop import EngineLoop, EngineStartError, Exclusive, Stream
from strata.scheduling.turn import QueueFull, Turn
from strata.shutdown import ShutdownCut, ShuttingDown
from strata.text.constraints import GrammarError, GrammarLimits, Grammars, Guide, plan_constraint
from strata.text.families import family_of
from strata.text.family import ModelFamily
from strata.text.output import LogprobNames, Output
from strata.text.sampling import Sampler
from strata.vision.client import Embedding, VisionClient, VisionStartError

# Requests' grammars and schemas converted and compiled at once, each in a worker thread: a conversion whose request
# has gone keeps its thread until it ends (it cannot be interrupted; its limits bound it to about a second).
GRAMMAR_THREADS = 2


ENCODER_RETRY_AFTER = 5  # seconds: an encoder that crashed or hung is started again for the next picture




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
        self._generating: list[tuple[HistoryRow, Stream]] = []  # requests on a slot, in arrival order
        self.activity = Activity()
        self.stopping = trio.Event()  # set when the server starts shutting down: endless streams end
        self.cut = ShutdownCut()  # what is still running when the shutdown's time runs out ends with an error event
        self.downloads = Downloads(self.stopping)  # image URLs (open_service gives it its client)
        self.model_names = model_names(config)  # the served name first, then the other aliases
        self.model_name = self.model_names[0]
        self.started = time.time()
        self.engine: Any = None  # an EngineLike once loaded
        self.tokenizer: Any = None
        self.family: ModelFamily | None = None  # the model's family, chosen from its vocabulary (attach)
        self.grammars: Grammars | None = None  # the model's compiled answer grammars (constrained decoding)
        self.prompts: Prompts | None = None  # the model's prompts (attach)
        self.load_error: BaseException | None = None
        self.loaded = trio.Event()
        self.nursery: trio.Nursery | None = None  # the service's long-lived nursery (open_service)
        self.vision: VisionClient | None = None  # the image encoder, when the config has one
        self.mcp = McpServers(config.mcp_servers, config.mcp)  # the configured MCP servers (open_service starts them)
        self.loop: EngineLoop | None = None  # the engine's batcher and its thread (attach)
        self._compiling = trio.CapacityLimiter(GRAMMAR_THREADS)

    @property
    def ready(self) -> bool:
        return self.loaded.is_set() and self.load_error is None

    # --- loading

    def attach(self, engine: EngineLike, tokenizer: Any, template: str | None = None) -> None:
        """Serve with an engine and tokenizer that are already loaded."""
        template = template or tokenizer.chat_template
        if not template:
            raise ServiceUnavailable("the model has no chat template (tokenizer.chat_template)")
        self.engine, self.tokenizer = engine, tokenizer
        self.family = family_of(tokenizer)
        self.grammars = Grammars(tokenizer, self.family, engine.n_vocab)
        self.prompts = Prompts(tokenizer, self.family, template, engine.n_ctx, engine.n_vocab,
                               self.config.limits.max_tokens)
        # as many slots as the engine has sequences (an engine passed in may have fewer than config.slots)
        self.turn = Turn(max_queued=self.config.limits.queue_length, slots=engine.n_seq)
        self.loop = EngineLoop(Batcher(engine, self.config.step_tokens, self.config.batch, self.config.step_slowdown))
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
            state = f", recurrent state {engine.n_seq} x {engine.state_bytes / 2**20:.1f} MiB" if engine.recurrent \
                else ""
            log(f"KV cache: {engine.n_seq} slots x {engine.n_ctx} positions ({self.config.kv}), "
                f"{engine.kv_bytes / 2**20:.0f} MiB{budget}{state}")
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
        assert self.prompts is not None, "render before the model is loaded"
        return self.prompts.render(request)

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
        request, pictures, rendered = await self._pictures(request)
        prompts = self.prompts
        assert prompts is not None
        if rendered is None:
            rendered = await trio.to_thread.run_sync(prompts.text_and_ids, request)
        ids = rendered[1]
        # each picture's pad becomes its rows, and its parts' markers when it is split into tiles
        return len(ids) + sum(picture.n_tokens + marker_tokens(picture.grid, prompts.marker_ids) - 1
                              for picture in pictures)

    def _require_ready(self) -> None:
        if not self.loaded.is_set():
            raise ServiceUnavailable("the model is still loading")
        if self.load_error is not None:
            raise ServiceUnavailable(f"the model failed to load: {self.load_error}")

    def _prepare(self, request: ChatRequest, pictures: list[Embedding],
                 rendered: tuple[str, list[int]] | None = None, results: int = 0) -> Prepared:
        """The request's prompt with its pictures' rows, and its token caps (`strata.prompts`); its last
        `results` messages are tool results the model has not read yet, cut to fit the context."""
        self._require_ready()
        assert self.prompts is not None
        return self.prompts.prepare(request, pictures, rendered, results)

    async def _guide(self, request: ChatRequest, prepared: Prepared) -> Guide | None:
        """The constraint of a request's answer (format, tool choice), converted and compiled in a worker thread
        when the request sends a format or tools; None when the answer is free.

        Raises:
            RequestError: a schema or grammar that cannot be enforced (naming its field).
        """
        grammars = self.grammars
        assert grammars is not None
        limits = GrammarLimits(self.config.limits.max_grammar_bytes, self.config.limits.max_grammar_rules)
        # A prefilled answer (past any reasoning) is the start of the constrained one.
        prefix = "" if not request.prefill or prepared.starts_in_reasoning else \
            grammars.tokens.family.after_reasoning(message_text(request.messages[-1])).strip()

        def compile_guide() -> Guide | None:
            plan = plan_constraint(answer_format=request.answer_format, tools=request.tools,
                                   tool_choice=request.tool_choice, parallel_tool_calls=request.parallel_tool_calls,
                                   thinking=prepared.may_think, in_reasoning=prepared.starts_in_reasoning,
                                   tokens=grammars.tokens, prefix=prefix, tool_fields=request.tool_fields,
                                   limits=limits)
            return None if plan is None else grammars.guide(plan)

        try:
            if request.answer_format is None and not request.tools:
                return compile_guide()  # nothing to convert or compile: at most the tool-call tag is banned
            # Abandoning is safe: a compiled grammar only lands in the cache, and the limiter holds the thread's
            # place until it ends.
            return await trio.to_thread.run_sync(compile_guide, abandon_on_cancel=True, limiter=self._compiling)
        except GrammarError as error:
            raise RequestError(str(error), error.param) from None

    # --- pictures

    async def _pictures(self, request: ChatRequest, live: RequestProgress | None = None
                        ) -> tuple[ChatRequest, list[Embedding], tuple[str, list[int]] | None]:
        """Encode the request's pictures, in prompt order, in the calling task (the request's: cancellable); see
        `strata.pictures.staging`. Before any encode, the prompt is rendered and tokenised (in a worker thread) to
        count its text with the pictures' rows.

        A picture a tool returned that cannot be used becomes the text `[image omitted: <why>]`; the user's own
        is a `RequestError` (400), and an encoder that is not available a `ServiceUnavailable` (503).

        Returns:
            The request with its messages as encoded (pictures omitted as text), the pictures, and the prompt's
            text and ids as counted when those are still the request's (no picture was omitted after counting).
        """
        counted: list[tuple[str, list[int]]] = []

        async def text_tokens(messages: list[dict[str, Any]]) -> int:
            assert self.prompts is not None
            text, ids = await trio.to_thread.run_sync(self.prompts.text_and_ids,
                                                      dataclasses.replace(request, messages=messages))
            counted.append((text, ids))
            return len(ids) - ids.count(self.prompts.pad_id)

        try:
            places = picture_places(request.messages, self.config.limits.max_pictures, self.vision is not None)
            if not places:
                return request, [], None
            self._require_ready()
            assert self.vision is not None and self.loop is not None and self.prompts is not None
            staging = PictureStaging(self.vision, self.downloads, Exclusive(self.loop, self.turn), self.engine.n_ctx,
                                     self.engine.picture_width, self.prompts.marker_ids, text_tokens)
            messages, pictures = await staging.encode(request.messages, places, live)
        except PicturesRefused as error:
            raise RequestError(str(error), error.param, error.code) from None
        except PicturesUnavailable as error:
            raise ServiceUnavailable(str(error), retry_after=ENCODER_RETRY_AFTER) from None
        # The prompt counted has a placeholder for each picture staged: as many as were encoded, unless one was
        # omitted since (its text then differs).
        pad_id = self.prompts.pad_id
        rendered = counted[0] if counted and counted[0][1].count(pad_id) == len(pictures) else None
        return dataclasses.replace(request, messages=messages), pictures, rendered

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
                                    sees_pictures=self._sees_pictures, cut=self.cut)
                async with aclosing(rounds) as events:
                    async for event in events:
                        yield event
            except (trio.Cancelled, GeneratorExit):
                row.finish = "cancel"
                raise
            except RequestError:
                row.finish = "refused"  # a 400: the request's fault, not a failure of the server
                raise
            except (ServiceUnavailable, QueueFull, ShuttingDown):
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
        request, pictures, rendered = await self._pictures(request, live)
        if pictures or not short(request):
            prepared = await trio.to_thread.run_sync(self._prepare, request, pictures, rendered, results)
        else:  # a worker thread's round trip would cost more than the work
            prepared = self._prepare(request, pictures, rendered, results)
        guide = await self._guide(request, prepared)
        live.row.prompt_tokens += len(prepared.ids)  # the response's prompt: the earlier rounds' and this one
        live.phase = "queued"
        async with self.turn.hold():
            try:
                async with aclosing(self._generate(request, prepared, live, guide)) as events:
                    yield events
            finally:
                live.slot = None

    async def _generate(self, request: ChatRequest, prepared: Prepared, live: RequestProgress,
                        guide: Guide | None) -> AsyncGenerator[Event, None]:
        assert self.loop is not None
        self.cut.check()  # a request that got its turn after the shutdown's cut does not start
        row = live.row
        live.phase = "prompt"
        before = row.output_tokens  # tokens of earlier rounds of this response
        sampler = Sampler(request.sampling, self.engine.n_vocab, mask=guide, logprobs=request.logprobs)
        echo = request.completion is not None and request.completion.echo
        job = Job(prepared.ids, sampler, prepared.max_tokens, self.tokenizer.eos_ids,
                  keys=salted(prepared.prompt.keys, request.cache_salt),
                  spans=prepared.prompt.spans, tag=row.id, progress=live,
                  prompt_logprobs=request.logprobs if echo else None)
        # Everything this task can make before the job goes: the engine thread needs the GIL to start the job's
        # call, and gets it only once this task waits for the first token.
        assert self.family is not None
        output = Output(self.tokenizer, self.family, request, prepared.starts_in_reasoning)
        names = LogprobNames(self.tokenizer.id_bytes)
        finish: FinishReason | None = None
        reasoning_tokens = 0
        stream = Stream(self.loop, job)
        self._generating.append((row, stream))
        try:
            while finish is None:
                tokens = await stream.next_tokens()
                if live.phase == "prompt":
                    for event in self._prompt_done(job, prepared.ids, names, echo):
                        yield event
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
        except EngineStartError as error:
            raise ServiceUnavailable(str(error), retry_after=1) from None
        finally:
            try:
                await stream.stop()
            finally:
                self._generating.remove((row, stream))
        await self._check_answer(guide, finish, output.stopped)
        for event in output.finish():
            yield event
        if finish == "stop" and output.n_tool_calls:
            finish = "tool_calls"
        row.finish = finish
        yield Usage(prompt_tokens=len(prepared.ids), cached_tokens=row.reused_tokens,
                    completion_tokens=row.output_tokens - before, reasoning_tokens=reasoning_tokens)
        yield Finish(finish, output.stop_sequence)

    async def _check_answer(self, guide: Guide | None, finish: FinishReason, stopped: bool) -> None:
        """Invariant: a constrained answer that ended with an end-of-turn token (`finish` "stop", not `stopped` by
        a stop string) is what was asked, or the request fails with a 400 (an error event once streaming):
        llguidance giving up (on a schema no finite text satisfies) leaves only an end-of-turn token allowed, and
        must not pass for a finished answer.

        Raises:
            RequestError: code "constraint_failed", naming the format's field.
        """
        if guide is None or finish != "stop" or stopped:
            return
        assert self.grammars is not None
        failure = await trio.to_thread.run_sync(self.grammars.answer_error, guide)
        if failure is not None:
            param = guide.plan.parts[0][1] if guide.plan.parts else "tool_choice"
            raise RequestError(f"{param}: {failure}", param, code="constraint_failed")

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

    def _prompt_done(self, job: Job, ids: list[int], names: LogprobNames, echo: bool) -> list[Event]:
        """The events of a processed prompt: its size and what was cached, then (a completion's `echo`) the prompt
        itself, with its tokens' log-probabilities when asked."""
        events: list[Event] = [PromptProcessed(len(ids), job.reused)]
        if echo:
            if job.prompt_logprobs is not None:
                events.append(PromptLogprobs(names.prompt_logprobs(ids, job.prompt_records)))
            events.append(TextDelta(self.tokenizer.decode(ids)))
        return events

    def begin_shutdown(self, grace: float) -> None:
        """The server stops taking requests; those in flight get `grace` seconds, and what still runs a little
        before they end is cut with `ShuttingDown` (`strata.shutdown`), which each route renders as an error."""
        self.cut.begin(grace)
        self.stopping.set()

    def _interrupt_generations(self) -> None:
        for _, stream in self._generating:
            stream.interrupt()

    def engine_problem(self) -> OSError | None:
        """Why the engine could not take a request now (no file descriptor or thread left to start its thread),
        or None."""
        return None if self.loop is None else self.loop.start_problem()

    @property
    def engine_running(self) -> bool:
        """Whether an engine thread is running (until trio has seen its end)."""
        return self.loop is not None and self.loop.periods > 0




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
            nursery.start_soon(service.cut.run, service._interrupt_generations, service.stopping)
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
