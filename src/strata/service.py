"""The service: its models' lifetime (`strata.model_set`: loading, unloading, each one's image encoder) and the
phases of a chat request on its model (its prompt prepared, its answer's constraint compiled, a round generated on
the model's turn) as events. A response's rounds of MCP tool calls are `strata.mcp_tools.rounds`'; generated
tokens become events in `strata.text.output`.

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
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

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
from strata.kv_disk import KvDiskError, KvTier
from strata.mcp_tools import McpRequestError, McpServers, Toolset, open_toolset, run_rounds
from strata.model_set import ModelSet
from strata.models.hub import HubError, is_hub_model
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
from strata.prompts import Prepared, Prompts, message_text, short
from strata.request_errors import RequestError, ServiceUnavailable
from strata.scheduling.batcher import Job, salted
from strata.scheduling.drafts import speculation
from strata.scheduling.engine_like import EngineLike
from strata.scheduling.engine_loop import EngineLoop, EngineStartError, Exclusive, Stream
from strata.scheduling.turn import QueueFull, Turn
from strata.served_model import ServedModel
from strata.shutdown import ShutdownCut, ShuttingDown
from strata.text.constraints import GrammarError, GrammarLimits, Grammars, Guide, plan_constraint
from strata.text.family import ModelFamily
from strata.text.output import LogprobNames, Output
from strata.text.sampling import Sampler
from strata.vision.client import Embedding, VisionClient, VisionStartError
from strata.vision.pool import VisionPool

if TYPE_CHECKING:
    from strata.kv_events.publisher import Publisher

# Requests' grammars and schemas converted and compiled at once, each in a worker thread: a conversion whose request
# has gone keeps its thread until it ends (it cannot be interrupted; its limits bound it to about a second).
GRAMMAR_THREADS = 2


ENCODER_RETRY_AFTER = 5  # seconds: an encoder that crashed or hung is started again for the next picture


class Service:
    """The served models answering chat requests, each with its own slots (see `open_service`).

    The model's parts (`engine`, `tokenizer`, `turn`, `loop`, `vision`, ...) are the first model's: a
    single-model server's only one. A request's `model` names one of `models` (`strata.model_set`).

    Attributes:
        models: the served models, by name.
        turn: the FIFO of requests waiting for one of the first model's slots (`turn.busy`, `turn.queued`).
        history: recent requests and totals.
        activity: every request in flight, with its phase and prompt progress.
    """

    def __init__(self, config: Config):
        self.config = config
        self.models = ModelSet.from_config(config)
        self.history = History(config.limits.history_size)
        self._generating: list[tuple[HistoryRow, Stream]] = []  # requests on a slot, in arrival order
        self.activity = Activity()
        self.stopping = trio.Event()  # set when the server starts shutting down: endless streams end
        self.cut = ShutdownCut()  # what is still running when the shutdown's time runs out ends with an error event
        self.downloads = Downloads(self.stopping)  # image URLs (open_service gives it its client)
        self.model_names = self.models.default.names  # the served name first, then the other aliases
        self.model_name = self.model_names[0]
        self.started = time.time()
        # Startup: a single-model server's model loaded (or failed); a server of several models is ready at once.
        self.load_error: BaseException | None = None
        self.loaded = trio.Event()
        self.nursery: trio.Nursery | None = None  # the service's long-lived nursery (open_service)
        self.mcp = McpServers(config.mcp_servers, config.mcp)  # the configured MCP servers (open_service starts them)
        self.kv_events: Publisher | None = None  # the first model's KV event publisher, if configured (attach)
        self._compiling = trio.CapacityLimiter(GRAMMAR_THREADS)

    # --- the first model's parts

    @property
    def engine(self) -> Any:
        return self.models.default.engine

    @property
    def tokenizer(self) -> Any:
        return self.models.default.tokenizer

    @property
    def family(self) -> ModelFamily | None:
        return self.models.default.family

    @property
    def grammars(self) -> Grammars | None:
        return self.models.default.grammars

    @property
    def prompts(self) -> Prompts | None:
        return self.models.default.prompts

    @property
    def turn(self) -> Turn:
        return self.models.default.turn

    @property
    def loop(self) -> EngineLoop | None:
        return self.models.default.loop

    @property
    def vision(self) -> VisionClient | VisionPool | None:
        return self.models.default.vision

    @property
    def ready(self) -> bool:
        return self.loaded.is_set() and self.load_error is None

    # --- loading

    def attach(self, engine: EngineLike, tokenizer: Any, template: str | None = None,
               kv_tier: KvTier | None = None) -> None:
        """Serve with an engine and tokenizer that are already loaded (a single-model service; the disk tier
        opened for it, if any)."""
        self.models.default.attach(engine, tokenizer, template, kv_tier)
        self._publish_cache_events()
        self.loaded.set()

    def _publish_cache_events(self) -> None:
        """Start publishing the first model's prefix cache as KV events, if the config asks (`kv_events`: one
        model per server, as a router's replica serves)."""
        loop = self.models.default.loop
        if self.config.kv_events.endpoint is not None and loop is not None:
            from strata.kv_events.publisher import publish_cache_events

            self.kv_events = publish_cache_events(self.config.kv_events, loop.batcher)

    async def load(self, log: Callable[[str], None] = print) -> None:
        """Load the configured model in a worker thread (a single-model service), an "hf:" one downloaded first
        (its `transfer` on the status routes meanwhile); a failure is kept in `load_error` and re-raised."""
        assert self.nursery is not None
        model = self.models.default
        try:
            if is_hub_model(model.config.model):
                await model.download(log)
            await model.load(self.nursery, log)
            self._publish_cache_events()
        except BaseException as error:
            self.load_error = error
            raise
        finally:
            self.loaded.set()

    async def start_vision(self, engine: EngineLike, log: Callable[[str], None] = print) -> None:
        """Start the configured image encoder of the first model in the service's nursery (after the model,
        whose width its rows must have).

        Raises:
            VisionStartError: a local encoder that could not start, or whose rows do not fit the model.
        """
        assert self.nursery is not None
        await self.models.default.start_vision(engine, self.nursery, log)

    async def wait_ready(self) -> None:
        """Wait until the model is loaded; raise `ServiceUnavailable` if loading failed."""
        await self.loaded.wait()
        if self.load_error is not None:
            raise ServiceUnavailable(f"the model failed to load: {self.load_error}")

    def close(self) -> None:
        self.models.close_engines()

    # --- requests

    def render(self, request: ChatRequest) -> str:
        """The prompt text of a request to the first model (the chat template applied to its messages and
        tools)."""
        assert self.prompts is not None, "render before the model is loaded"
        return self.prompts.render(request)

    async def count_tokens(self, request: ChatRequest, model: str | None = None) -> int:
        """How many prompt tokens a request has, each picture counted as the rows its encoding takes: pictures
        are encoded to know that (cancellable like a chat request's, and cached for the request that follows).

        Raises: what preparing the same chat request would (`RequestError`, `ServiceUnavailable`,
            `UnknownModel`).
        """
        async with self.models.use(self.models.find(model)) as served:
            self._require_ready(served)
            if request.mcp:
                toolset = await self._toolset(request)
                await toolset.aclose()
                request = dataclasses.replace(request, tools=request.tools + toolset.functions())
            request, pictures, rendered = await self._pictures(served, request)
            prompts = served.prompts
            assert prompts is not None
            if rendered is None:
                rendered = await trio.to_thread.run_sync(prompts.text_and_ids, request)
            ids = rendered[1]
            # each picture's pad becomes its rows, and its parts' markers when it is split into tiles
            return len(ids) + sum(picture.n_tokens + marker_tokens(picture.grid, prompts.marker_ids) - 1
                                  for picture in pictures)

    def _require_ready(self, model: ServedModel) -> None:
        if not self.models.named:  # the single model: loaded at startup
            if not self.loaded.is_set():
                raise ServiceUnavailable("the model is still downloading" if model.state == "downloading"
                                         else "the model is still loading")
            if self.load_error is not None:
                raise ServiceUnavailable(f"the model failed to load: {self.load_error}")
        assert model.ready, "a named model is loaded before its request's phases"

    def _prepare(self, model: ServedModel, request: ChatRequest, pictures: list[Embedding],
                 rendered: tuple[str, list[int]] | None = None, results: int = 0) -> Prepared:
        """The request's prompt with its pictures' rows, and its token caps (`strata.prompts`); its last
        `results` messages are tool results the model has not read yet, cut to fit the context."""
        self._require_ready(model)
        assert model.prompts is not None
        return model.prompts.prepare(request, pictures, rendered, results)

    async def _guide(self, model: ServedModel, request: ChatRequest, prepared: Prepared) -> Guide | None:
        """The constraint of a request's answer (format, tool choice), converted and compiled in a worker thread
        when the request sends a format or tools; None when the answer is free.

        Raises:
            RequestError: a schema or grammar that cannot be enforced (naming its field).
        """
        grammars = model.grammars
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

    async def _pictures(self, model: ServedModel, request: ChatRequest, live: RequestProgress | None = None
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
            assert model.prompts is not None
            text, ids = await trio.to_thread.run_sync(model.prompts.text_and_ids,
                                                      dataclasses.replace(request, messages=messages))
            counted.append((text, ids))
            return len(ids) - ids.count(model.prompts.pad_id)

        try:
            places = picture_places(request.messages, self.config.limits.max_pictures, model.vision is not None)
            if not places:
                return request, [], None
            self._require_ready(model)
            assert model.vision is not None and model.loop is not None and model.prompts is not None
            staging = PictureStaging(model.vision, self.downloads, Exclusive(model.loop, model.turn),
                                     model.engine.n_ctx, model.engine.picture_width, model.prompts.marker_ids,
                                     text_tokens)
            messages, pictures = await staging.encode(request.messages, places, live)
        except PicturesRefused as error:
            raise RequestError(str(error), error.param, error.code) from None
        except PicturesUnavailable as error:
            raise ServiceUnavailable(str(error), retry_after=ENCODER_RETRY_AFTER) from None
        # The prompt counted has a placeholder for each picture staged: as many as were encoded, unless one was
        # omitted since (its text then differs).
        pad_id = model.prompts.pad_id
        rendered = counted[0] if counted and counted[0][1].count(pad_id) == len(pictures) else None
        return dataclasses.replace(request, messages=messages), pictures, rendered

    async def chat(self, request: ChatRequest, *, request_id: str | None = None,
                   model: str | None = None) -> AsyncGenerator[Event, None]:
        """Generate the answer to `request` as events, ending with `Usage` and `Finish`.

        Close the iterator when done with it early (`contextlib.aclosing`): it holds the engine's turn between
        its events. Cancellation (the caller's cancel scope) is clean in every phase: while queued the request
        just leaves the queue; on the engine it raises the abort flag and waits for the engine thread to return.

        Args:
            model: the name of the model to answer (`models`); a single-model server's answers whatever it is.

        Raises:
            UnknownModel: no served model has that name (raised before the first event).
            RequestError: the request does not fit this model.
            ServiceUnavailable: the model is not loaded, or failed to load.
            turn.QueueFull: too many requests are waiting.
        """
        served = self.models.find(model)
        row = HistoryRow(id=request_id or uuid.uuid4().hex, route=request.route, start=time.time(),
                         model=served.name)
        started = time.perf_counter()
        with self.activity.track(row) as live:
            toolset: Toolset | None = None
            try:
                if self.models.named and self.models.waits(served):
                    live.phase = "loading"  # waiting for the model, and for the memory to load it
                async with self.models.use(served):
                    if request.mcp:
                        toolset = await self._toolset(request)
                        request = dataclasses.replace(request, tools=request.tools + toolset.functions())
                    rounds = run_rounds(request, partial(self._round, served), toolset, live,
                                        max_rounds=self.config.mcp.max_rounds,
                                        sees_pictures=lambda: served.vision is not None, cut=self.cut)
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

    @asynccontextmanager
    async def _round(self, model: ServedModel, request: ChatRequest, live: RequestProgress,
                     results: int) -> AsyncIterator[AsyncIterator[Event]]:
        """One round of a response (`strata.mcp_tools.rounds.RoundEvents`): the request's pictures encoded, its
        prompt prepared (its last `results` tool results cut to fit) and its answer's constraint compiled, then
        the engine's turn held while the caller takes the generated events."""
        live.phase = "prepare"
        request, pictures, rendered = await self._pictures(model, request, live)
        if pictures or not short(request):
            prepared = await trio.to_thread.run_sync(self._prepare, model, request, pictures, rendered, results)
        else:  # a worker thread's round trip would cost more than the work
            prepared = self._prepare(model, request, pictures, rendered, results)
        guide = await self._guide(model, request, prepared)
        live.row.prompt_tokens += len(prepared.ids)  # the response's prompt: the earlier rounds' and this one
        live.phase = "queued"
        async with model.turn.hold():
            try:
                async with aclosing(self._generate(model, request, prepared, live, guide)) as events:
                    yield events
            finally:
                live.slot = None

    async def _generate(self, model: ServedModel, request: ChatRequest, prepared: Prepared, live: RequestProgress,
                        guide: Guide | None) -> AsyncGenerator[Event, None]:
        assert model.loop is not None
        self.cut.check()  # a request that got its turn after the shutdown's cut does not start
        row = live.row
        live.phase = "prompt"
        before = row.output_tokens  # tokens of earlier rounds of this response
        tokenizer = model.tokenizer
        sampler = Sampler(request.sampling, model.engine.n_vocab, mask=guide, logprobs=request.logprobs)
        echo = request.completion is not None and request.completion.echo
        spec = speculation(model.config.speculative, prepared.predicted, model.draft_model, model.mtp)
        drafted_before, accepted_before = row.draft_tokens, row.accepted_tokens
        job = Job(prepared.ids, sampler, prepared.max_tokens, tokenizer.eos_ids,
                  keys=salted(prepared.prompt.keys, request.cache_salt),
                  spans=prepared.prompt.spans, tag=row.id, progress=live,
                  prompt_logprobs=request.logprobs if echo else None, turn_starts=prepared.turn_starts,
                  speculation=spec)
        # Everything this task can make before the job goes: the engine thread needs the GIL to start the job's
        # call, and gets it only once this task waits for the first token.
        assert model.family is not None
        output = Output(tokenizer, model.family, request, prepared.starts_in_reasoning)
        names = LogprobNames(tokenizer.id_bytes)
        finish: FinishReason | None = None
        reasoning_tokens = 0
        stream = Stream(model.loop, job)
        self._generating.append((row, stream))
        try:
            while finish is None:
                tokens = await stream.next_tokens()
                if live.phase == "prompt":
                    for event in self._prompt_done(tokenizer, job, prepared.ids, names, echo):
                        yield event
                live.phase = "decode"
                row.reused_tokens, row.prompt_seconds, row.decode_seconds = job.reused, *stream.seconds()
                row.disk_tokens = job.disk_tokens
                if spec is not None:
                    row.draft_tokens = drafted_before + spec.drafted
                    row.accepted_tokens = accepted_before + spec.accepted
                    row.draft_length = spec.length
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
        await self._check_answer(model, guide, finish, output.stopped)
        for event in output.finish():
            yield event
        if finish == "stop" and output.n_tool_calls:
            finish = "tool_calls"
        row.finish = finish
        accepted = rejected = None  # of the prediction's tokens, when the client sent one
        if request.prediction is not None:
            accepted, rejected = (spec.predicted_accepted, spec.predicted_rejected) if spec is not None else (0, 0)
        yield Usage(prompt_tokens=len(prepared.ids), cached_tokens=row.reused_tokens,
                    completion_tokens=row.output_tokens - before, reasoning_tokens=reasoning_tokens,
                    accepted_prediction_tokens=accepted, rejected_prediction_tokens=rejected)
        yield Finish(finish, output.stop_sequence)

    async def _check_answer(self, model: ServedModel, guide: Guide | None, finish: FinishReason,
                            stopped: bool) -> None:
        """Invariant: a constrained answer that ended with an end-of-turn token (`finish` "stop", not `stopped` by
        a stop string) is what was asked, or the request fails with a 400 (an error event once streaming):
        llguidance giving up (on a schema no finite text satisfies) leaves only an end-of-turn token allowed, and
        must not pass for a finished answer.

        Raises:
            RequestError: code "constraint_failed", naming the format's field.
        """
        if guide is None or finish != "stop" or stopped:
            return
        assert model.grammars is not None
        failure = await trio.to_thread.run_sync(model.grammars.answer_error, guide)
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
        """The first model's slots: each one's state ("idle", "prompt", "decode"), the request on it, and the
        positions it holds."""
        return self.models.default.slots()

    @staticmethod
    def _prompt_done(tokenizer: Any, job: Job, ids: list[int], names: LogprobNames, echo: bool) -> list[Event]:
        """The events of a processed prompt: its size and what was cached, then (a completion's `echo`) the prompt
        itself, with its tokens' log-probabilities when asked."""
        events: list[Event] = [PromptProcessed(len(ids), job.reused)]
        if echo:
            if job.prompt_logprobs is not None:
                events.append(PromptLogprobs(names.prompt_logprobs(ids, job.prompt_records)))
            events.append(TextDelta(tokenizer.decode(ids)))
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
        """Why an engine could not take a request now (no file descriptor or thread left to start its thread),
        or None."""
        return next((problem for model in self.models.models if (problem := model.engine_problem()) is not None),
                    None)

    @property
    def engine_running(self) -> bool:
        """Whether an engine thread is running (until trio has seen its end)."""
        return any(model.engine_running for model in self.models.models)


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
    in `service.load_error` like a model that failed to load). With several models (`models`), none is loaded
    here: each loads when a request first names it (`strata.model_set`).

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
                if service.models.named:  # each model loads when a request first names it
                    assert engine is None, "a service of several models loads its own"
                    service.models.nursery, service.models.log = nursery, log
                    await trio.to_thread.run_sync(service.models.measure)
                    service.loaded.set()
                elif engine is not None:
                    await service.start_vision(engine, log)
                    await service.models.default.attach_loaded(engine, tokenizer, log)
                    service._publish_cache_events()
                    service.loaded.set()
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
                    await service.models.close()
                    if service.kv_events is not None:  # after the engine threads: nothing publishes any more
                        service.kv_events.close()
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
    except (VisionStartError, KvDiskError, HubError) as error:
        log(f"error: {error}")
    except Exception as error:  # noqa: BLE001 - reported through service.load_error
        log(f"error: the model failed to load: {error}")
