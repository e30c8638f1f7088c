"""One served model's state: its engine and tokenizer, its family, prompts and answer grammars, its slots (the
turn, the batcher and its prefix cache, the engine thread) and its image encoder; loading it off the event loop
and unloading it. `strata.model_set` holds one or several of them; `strata.service` runs requests on one.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, Literal

import trio

from strata.config import Config
from strata.models.hub import Transfer
from strata.models.resolve import resolve_config
from strata.progress import Stage, with_progress
from strata.prompts import Prompts
from strata.request_errors import ServiceUnavailable
from strata.scheduling.batcher import Batcher
from strata.scheduling.engine_like import EngineLike
from strata.scheduling.engine_loop import EngineLoop
from strata.scheduling.turn import Turn
from strata.text.constraints import Grammars
from strata.text.families import family_of
from strata.text.family import ModelFamily
from strata.vision.client import VisionClient, VisionStartError

# "downloading": an "hf:" model's files come from the hub (`transfer` counts them). "failed": the last download or
# load failed (`load_error` says why); the next request that names the model tries again.
ModelState = Literal["not loaded", "downloading", "loading", "loaded", "unloading", "failed"]


class ServedModel:
    """A model the service serves under `names` (the first is the one answers report), with its own `config`
    (the top-level keys, or a `models` entry's: `Config.for_model`).

    Attributes:
        state: "not loaded", "loading", "loaded", "unloading" or "failed".
        users: requests that use the model now (from the moment they name it): it is never unloaded while
            any does.
        last_used: `time.monotonic()` of its last use (least recently used idle models are unloaded first).
        footprint: the bytes it takes when loaded, as `strata.model_set` counts them against `models_memory`.
    """

    def __init__(self, config: Config, names: list[str]):
        self.config = config
        self.names = names
        self.name = names[0]
        self.state: ModelState = "not loaded"
        self.load_error: BaseException | None = None
        self.loads = 0  # load attempts begun on demand (`strata.model_set`)
        self.users = 0
        self.last_used = 0.0
        self.footprint = 0
        self.transfer: Transfer | None = None  # the download of an "hf:" model, while it runs
        self.turn = Turn(max_queued=config.limits.queue_length, slots=config.slots)
        self.engine: Any = None  # an EngineLike once loaded
        self.tokenizer: Any = None
        self.family: ModelFamily | None = None  # chosen from its vocabulary (attach)
        self.grammars: Grammars | None = None  # its compiled answer grammars (constrained decoding)
        self.prompts: Prompts | None = None
        self.loop: EngineLoop | None = None  # its batcher and engine thread (attach)
        self.vision: VisionClient | None = None  # its image encoder, when it has one
        self._vision_scope: trio.CancelScope | None = None

    @property
    def ready(self) -> bool:
        return self.state == "loaded"

    def attach(self, engine: EngineLike, tokenizer: Any, template: str | None = None) -> None:
        """Serve with an engine and tokenizer that are already loaded."""
        template = template or tokenizer.chat_template
        if not template:
            raise ServiceUnavailable("the model has no chat template (tokenizer.chat_template)")
        if tokenizer is not self.tokenizer or self.prompts is None:  # else the text side kept from before an unload
            self.tokenizer, self.family = tokenizer, family_of(tokenizer)
            self.grammars = Grammars(tokenizer, self.family, engine.n_vocab)
            self.prompts = Prompts(tokenizer, self.family, template, engine.n_ctx, engine.n_vocab,
                                   self.config.limits.max_tokens)
        self.engine = engine
        # as many slots as the engine has sequences (an engine passed in may have fewer than config.slots)
        self.turn = Turn(max_queued=self.config.limits.queue_length, slots=engine.n_seq)
        batcher = Batcher(engine, self.config.step_tokens, self.config.batch, self.config.step_slowdown)
        self.loop = EngineLoop(batcher)
        self.state = "loaded"

    # --- loading

    async def download(self, log: Callable[[str], None]) -> None:
        """An "hf:" model's files downloaded (or found in the hub's cache) in a worker thread; its config then
        names them. The download's progress is `transfer` while it runs.

        Raises:
            HubError: one line: the repository, the quant, the disk or the network.
        """
        self.state = "downloading"

        def watch(transfer: Transfer) -> None:
            self.transfer = transfer

        try:
            self.config = await resolve_config(self.config, log, watch)
        finally:
            self.transfer = None

    async def load(self, nursery: trio.Nursery, log: Callable[[str], None]) -> None:
        """Load the model in a worker thread, then start its image encoder in `nursery`; a failure is kept in
        `load_error` (state "failed") and re-raised."""
        self.state, self.load_error = "loading", None
        try:
            engine, tokenizer = await with_progress(
                log, f"loading {self.config.model}",
                lambda stage: trio.to_thread.run_sync(self._load_blocking, log, stage))
            try:
                await self.start_vision(engine, nursery, log)
                self.attach(engine, tokenizer)
            except BaseException:
                await self._stop_vision()
                engine.close()
                raise
            bands = f", output weight in bands {engine.prepared_bytes / 2**20:.0f} MiB" if engine.prepared_bytes else ""
            copied = f", weights copied to huge pages {engine.copied_bytes / 2**20:.0f} MiB" if engine.copied_bytes \
                else ""
            log(f"model: {self.config.model} ({engine.arch}), context {engine.n_ctx}, threads {engine.threads}, "
                f"backend {engine.backend}{bands}{copied}")
            budget = "" if self.config.kv_budget is None else f" of a {self.config.kv_budget:g} MiB budget"
            log(f"KV cache: {engine.n_seq} slots x {engine.n_ctx} positions ({self.config.kv}), "
                f"{engine.kv_bytes / 2**20:.0f} MiB{budget}")
        except BaseException as error:
            self.state, self.load_error = "failed", error
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
            # A model loaded again keeps its text side (`unload`).
            tokenizer = self.tokenizer or Tokenizer.from_gguf(config.model)
        except BaseException:
            engine.close()
            raise
        log(f"loaded in {time.perf_counter() - started:.1f} s")
        return engine, tokenizer

    async def start_vision(self, engine: EngineLike, nursery: trio.Nursery,
                           log: Callable[[str], None] = print) -> None:
        """Start the model's image encoder in `nursery` (after the model, whose width its rows must have), in a
        cancel scope of its own that `unload` cancels.

        Raises:
            VisionStartError: a local encoder that could not start, or whose rows do not fit the model.
        """
        vision = self.config.vision
        if not (vision.mmproj or vision.exe):
            return
        client = self.vision = VisionClient(vision, engine_threads=engine.threads, log=log)
        what = f"vision: starting the {client.mode()} encoder"
        log(f"{what} ...")
        scope = self._vision_scope = trio.CancelScope()

        async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with scope:
                await client.run(task_status=task_status)

        await with_progress(log, what, lambda stage: nursery.start(run))
        ready, n_embd = client.last_ready, engine.picture_width
        if ready is not None and ready.n_embd != n_embd and not vision.remote:
            raise VisionStartError(f"the image encoder's rows are {ready.n_embd} wide and the model's embeddings "
                                   f"{n_embd}: {vision.mmproj} was made for another model")

    async def _stop_vision(self) -> None:
        if self._vision_scope is not None:
            self._vision_scope.cancel()
            self._vision_scope = None
        self.vision = None

    # --- unloading

    async def unload(self) -> None:
        """Free the model: its engine thread ended, its encoder stopped, its engine closed. Shielded: an unload
        begun always ends. (Invariant, kept by `strata.model_set`: no request held the model when its unload
        began; one that names it since waits for the state "not loaded" and loads it again.)

        The text side stays (tokenizer, family, prompts, and the answer grammars with their llguidance
        tokenizer): tens of MB against the weights' and KV cache's hundreds, and rebuilt it costs the next load
        half a second for a 151k-token vocabulary and the next constrained answer about two more."""
        self.state = "unloading"
        with trio.CancelScope(shield=True):
            if self.loop is not None:
                await self.loop.close()
            await self._stop_vision()
            engine, self.engine, self.loop = self.engine, None, None
            if engine is not None:
                await trio.to_thread.run_sync(engine.close)
        self.state = "not loaded"

    def close(self) -> None:
        """Free the engine at the service's end (its thread has ended)."""
        if self.engine is not None:
            self.engine.close()

    # --- what the status routes show

    def slots(self) -> list[dict[str, Any]]:
        """Each slot: its state ("idle", "prompt", "decode"), the request on it, and the positions it holds."""
        if self.loop is None:
            return []
        return [{"slot": slot.seq, "request": None if slot.job is None else slot.job.tag,
                 "state": "idle" if slot.job is None else "decode" if slot.job.decoding else "prompt",
                 "cached_tokens": len(slot.keys)} for slot in self.loop.batcher.slots]

    def engine_problem(self) -> OSError | None:
        """Why the engine could not take a request now (no file descriptor or thread left to start its thread),
        or None."""
        return None if self.loop is None else self.loop.start_problem()

    @property
    def engine_running(self) -> bool:
        """Whether its engine thread is running (until trio has seen its end)."""
        return self.loop is not None and self.loop.periods > 0
