"""One served model's state: its engine and tokenizer, its family, prompts and answer grammars, its slots (the
turn, the batcher and its prefix cache, the engine thread), the disk tier under that cache, its speculative
decoding's draft model and its image encoder; loading it off the event loop and unloading it. `strata.model_set`
holds one or several of them; `strata.service` runs requests on one.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, Literal

import trio

from strata.config import Config
from strata.kv_disk import KvTier
from strata.models.hub import Transfer
from strata.models.resolve import resolve_config
from strata.progress import Stage, with_progress
from strata.prompts import Prompts
from strata.request_errors import ServiceUnavailable
from strata.scheduling.batcher import Batcher
from strata.scheduling.draft_model import DraftModel
from strata.scheduling.drafts import MtpEngine
from strata.scheduling.engine_like import EngineLike
from strata.scheduling.engine_loop import EngineLoop
from strata.scheduling.turn import Turn
from strata.text.constraints import Grammars
from strata.text.families import family_of
from strata.text.family import ModelFamily
from strata.vision.client import VisionClient, VisionStartError
from strata.vision.pool import VisionPool

# "downloading": an "hf:" model's files come from the hub (`transfer` counts them). "failed": the last download or
# load failed (`load_error` says why); the next request that names the model tries again.
ModelState = Literal["not loaded", "downloading", "loading", "loaded", "unloading", "failed"]


def _mib(n_bytes: int) -> str:
    """Bytes in MiB for a startup line: a tenth of a MiB, or two figures below one (a tiny model's state)."""
    mib = n_bytes / 2**20
    return f"{mib:,.1f}" if mib >= 1 else f"{mib:.2g}"


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
        self.vision: VisionClient | VisionPool | None = None  # its image encoder(s), when it has them
        self.kv_tier: KvTier | None = None  # the disk tier under its prefix cache (config.kv_disk)
        self.draft_model: DraftModel | None = None  # speculative decoding's draft model, when configured
        self.mtp: MtpEngine | None = None  # the engine, when it runs the model's MTP block for drafts
        self._vision_scope: trio.CancelScope | None = None

    @property
    def ready(self) -> bool:
        return self.state == "loaded"

    def attach(self, engine: EngineLike, tokenizer: Any, template: str | None = None,
               kv_tier: KvTier | None = None) -> None:
        """Serve with an engine and tokenizer that are already loaded (and the disk tier opened for it)."""
        template = template or tokenizer.chat_template
        if not template:
            raise ServiceUnavailable("the model has no chat template (tokenizer.chat_template)")
        if tokenizer is not self.tokenizer or self.prompts is None:  # else the text side kept from before an unload
            self.tokenizer, self.family = tokenizer, family_of(tokenizer, template)
            self.grammars = Grammars(tokenizer, self.family, engine.n_vocab)
            self.prompts = Prompts(tokenizer, self.family, template, engine.n_ctx, engine.n_vocab,
                                   self.config.limits.max_tokens)
        self.engine = engine
        # as many slots as the engine has sequences (an engine passed in may have fewer than config.slots)
        self.turn = Turn(max_queued=self.config.limits.queue_length, slots=engine.n_seq)
        snapshots = self.config.snapshot_budget
        batcher = Batcher(engine, self.config.step_tokens, self.config.batch, self.config.step_slowdown,
                          snapshot_bytes=None if snapshots is None else int(snapshots * 2**20), tier=kv_tier)
        self.kv_tier = kv_tier
        self.loop = EngineLoop(batcher)
        self.state = "loaded"

    def open_kv_tier(self, engine: EngineLike, log: Callable[[str], None] = print) -> KvTier | None:
        """The configured disk tier for `engine`'s KV rows (blocking: it scans the directory), or None.

        Raises:
            KvDiskError: the directory cannot be used (another server holds it).
        """
        kv_disk = self.config.kv_disk
        if kv_disk.path is None:
            return None
        tier = KvTier(kv_disk.path, engine.kv_identity, kv_disk.max_bytes, engine.kv_position_bytes,
                      kv_disk.block_tokens, log)
        records = f", {tier.store.states} state records" if engine.recurrent else ""
        log(f"kv_disk: {kv_disk.path}: {len(tier.store) - tier.store.states} blocks{records}, "
            f"{tier.store.bytes / 2**20:,.0f} MiB of {kv_disk.max_bytes / 2**20:,.0f} MiB")
        return tier

    async def attach_loaded(self, engine: EngineLike, tokenizer: Any, log: Callable[[str], None]) -> None:
        """`attach` with the disk tier opened for the engine (in a worker thread), closing the tier if that
        fails (its threads and the directory's lock go with it)."""
        tier = await trio.to_thread.run_sync(self.open_kv_tier, engine, log)
        try:
            self.attach(engine, tokenizer, kv_tier=tier)
        except BaseException:
            if tier is not None:
                tier.close()
            raise

    def close_kv_tier(self) -> None:
        """Save every idle slot's blocks, write what is queued, and close the tier (blocking: a worker thread's
        job, once the engine thread has ended)."""
        tier, self.kv_tier = self.kv_tier, None
        if tier is None:
            return
        try:
            if self.loop is not None and not self.loop.running:  # a step still running owns the slots
                self.loop.batcher.save_all()
        finally:
            tier.close()

    # --- loading

    async def download(self, log: Callable[[str], None]) -> None:
        """An "hf:" model's files downloaded (or found in the hub's cache) in a worker thread; its config then
        names them. The download's progress is `transfer` while it runs.

        Raises:
            HubError: one line: the repository, the quant, the disk or the network.
        """
        self.state, self.load_error = "downloading", None

        def watch(transfer: Transfer) -> None:
            self.transfer = transfer

        try:
            self.config = await resolve_config(self.config, log, watch)
        except BaseException as error:
            self.state, self.load_error = "failed", error
            raise
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
                await self.attach_loaded(engine, tokenizer, log)
            except BaseException:
                await self._stop_vision()
                self._close_engines(engine)
                raise
            bands = f", output weight in bands {engine.prepared_bytes / 2**20:.0f} MiB" if engine.prepared_bytes else ""
            copied = f", weights copied to huge pages {engine.copied_bytes / 2**20:.0f} MiB" if engine.copied_bytes \
                else ""
            log(f"model: {self.config.model} ({engine.arch}), context {engine.n_ctx}, threads {engine.threads}, "
                f"backend {engine.backend}{bands}{copied}")
            budget = "" if self.config.kv_budget is None else f" of a {self.config.kv_budget:g} MiB budget"
            log(f"KV cache: {engine.n_seq} slots x {engine.n_ctx} positions ({self.config.kv}), "
                f"{engine.kv_bytes / 2**20:.0f} MiB{budget}")
            snapshots = self.loop.batcher.snapshots if self.loop is not None else None
            if snapshots is not None:
                log(f"recurrent state: {_mib(engine.state_bytes)} MiB a sequence; snapshots for prefix reuse: "
                    f"{snapshots.capacity} ({_mib(snapshots.budget)} MiB)")
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
        mtp = None if config.speculative.source in ("auto", "mtp") else False  # None: where the file has one
        engine = self._on_device(budget, mtp, log) if config.device != "cpu" else None
        if engine is None:
            engine = Engine.load(config.model, n_ctx=config.context, threads=config.threads, kv=config.kv,
                                 n_batch=config.batch, n_seq=config.slots, kv_budget=budget,
                                 mapped_weights=config.mapped_weights, record_routing=config.record_routing, mtp=mtp,
                                 mtp_window=config.speculative.mtp_window)
        try:
            if config.speculative.source == "mtp" and not engine.mtp:
                raise ServiceUnavailable(f"speculative.source is mtp, and {config.model} has no MTP block")
            self.mtp = engine if engine.mtp else None
            stage.now = "tokenizer"
            # A model loaded again keeps its text side (`unload`).
            tokenizer = self.tokenizer or Tokenizer.from_gguf(config.model)
            if config.speculative.draft_model is not None:
                stage.now = "draft model"
                self.draft_model = DraftModel(self._load_draft_model(engine))
        except BaseException:
            engine.close()
            raise
        log(f"loaded in {time.perf_counter() - started:.1f} s")
        return engine, tokenizer

    def _on_device(self, kv_budget: int | None, mtp: bool | None, log: Callable[[str], None]) -> Any:
        """The model on the GPU backend (`device` cuda, or host for tests; running its MTP block as `mtp` says), or
        None where it cannot run there (no CUDA build or GPU, an architecture it does not run): the CPU engine
        then, said in one line."""
        from strata.engine_cffi.device import DeviceUnavailable
        from strata.engine_cffi.device_engine import ARCHITECTURES, DeviceEngine, open_device
        from strata.gguf_file import read_metadata

        config = self.config
        assert config.model is not None
        arch = read_metadata(config.model).get("general.architecture")
        if arch not in ARCHITECTURES:
            log(f"device {config.device}: the GPU backend runs {', '.join(ARCHITECTURES)} models, not {arch}; "
                "running on the CPU")
            return None
        prior = self._expert_prior()  # before the device opens, and before recording truncates the same file
        share = self._vision_share()
        try:
            device = open_device(config.device, None if config.gpu_memory is None else int(config.gpu_memory * 2**30),
                                 share)
        except DeviceUnavailable as exc:
            log(f"device {config.device} unavailable ({exc}); running on the CPU")
            return None
        engine = DeviceEngine.open(config.model, device, n_ctx=config.context, threads=config.threads, kv=config.kv,
                                   n_batch=config.batch, n_seq=config.slots, kv_budget=kv_budget,
                                   record_routing=config.record_routing, prior=prior, mtp=mtp,
                                   mtp_window=config.speculative.mtp_window)
        cache = engine.expert_counts()
        left = f" ({share / 2**20:,.0f} MiB left to the GPU image encoder)" if share else ""
        log(f"expert cache: {cache['capacity']} experts, {cache['bytes'] / 2**30:.2f} GiB"
            + (f", {cache['preloaded']} from the prior" if prior is not None else "")
            + (f", and the MTP block's {cache['mtp']}" if cache["mtp"] else "") + left)
        return engine

    def _expert_prior(self) -> Any:
        """The config's `expert_prior` trace, read; None without one."""
        from strata.experts.trace import TraceError, read_trace

        path = self.config.expert_prior
        if path is None:
            return None
        try:
            return read_trace(path)
        except (OSError, TraceError) as exc:
            raise ServiceUnavailable(f"expert_prior: {exc}") from None

    def _vision_share(self) -> int:
        """The device bytes a local GPU image encoder takes on the engine's card, from its mmproj file (its READY
        reports the same as `device_bytes`); 0 for a CPU, remote or own-command encoder, or a file it cannot load
        (the encoder's start says why)."""
        from strata.vision.device_encoder import encoder_share
        from strata.vision.mmproj import MmprojError

        vision = self.config.vision
        if not (vision.gpu and vision.mmproj) or vision.exe or vision.remote or vision.pool:
            return 0
        try:
            return encoder_share(vision.mmproj, vision.min_tokens, vision.max_tokens)
        except MmprojError:
            return 0

    def _load_draft_model(self, engine: Any) -> Any:
        """The config's draft model on a context like the model's (as long, as many slots, its threads)."""
        from strata.engine_cffi import Engine

        config = self.config
        path = config.speculative.draft_model
        assert path is not None
        draft = Engine.load(path, n_ctx=engine.n_ctx, threads=config.threads, kv=config.kv, n_batch=config.batch,
                            n_seq=engine.n_seq)
        if draft.n_vocab != engine.n_vocab:
            draft.close()
            raise ServiceUnavailable(f'speculative.draft_model: {path} has {draft.n_vocab} tokens, the model '
                                     f'{engine.n_vocab}: a draft model needs the same vocabulary')
        return draft

    def _close_engines(self, engine: Any) -> None:
        """Close `engine` and the draft model (blocking: quick, their threads are idle)."""
        draft, self.draft_model, self.mtp = self.draft_model, None, None
        if draft is not None:
            draft.engine.close()
        if engine is not None:
            engine.close()

    async def start_vision(self, engine: EngineLike, nursery: trio.Nursery,
                           log: Callable[[str], None] = print) -> None:
        """Start the model's image encoder in `nursery` (after the model, whose width its rows must have), in a
        cancel scope of its own that `unload` cancels.

        Raises:
            VisionStartError: a local encoder that could not start, or whose rows do not fit the model.
        """
        vision = self.config.vision
        if not (vision.mmproj or vision.exe or vision.pool):
            return
        gpu_device = "host" if self.config.device == "host" else "cuda"  # the test device runs both, as the card
        client = self.vision = (VisionPool(vision, engine_threads=engine.threads, log=log) if vision.pool
                                else VisionClient(vision, engine_threads=engine.threads, log=log,
                                                  gpu_device=gpu_device))
        what = f"vision: starting the {client.mode()} encoder"
        log(f"{what} ...")
        scope = self._vision_scope = trio.CancelScope()

        async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with scope:
                await client.run(task_status=task_status)

        await with_progress(log, what, lambda stage: nursery.start(run))
        ready, n_embd = client.last_ready, engine.picture_width
        if ready is not None and ready.n_embd != n_embd and not client.remote:
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
            await self.stop()
            await self._stop_vision()
            engine, self.engine, self.loop = self.engine, None, None
            await trio.to_thread.run_sync(self._close_engines, engine)
        self.state = "not loaded"

    async def stop(self) -> None:
        """End the engine thread, then save the idle slots' blocks to the disk tier and close it (in a worker
        thread, shielded: the writes a clean stop owes a restart)."""
        if self.loop is not None:
            await self.loop.close()
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(self.close_kv_tier)

    def close(self) -> None:
        """Free the engines at the service's end (its thread has ended)."""
        self._close_engines(self.engine)

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
