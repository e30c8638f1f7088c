"""The models a server serves: one (the `model` key, loaded at startup), or several named by the `models` key, each
loaded when a request first names it and unloaded, least recently used first, when loading another would pass
`models_memory`.

Invariant: a model is never unloaded while a request uses it. A request pins its model (`ModelSet.use`) from the
moment it names it until its answer ends; a request whose model must wait for memory waits in its own task (a
checkpoint: its hang-up cancels the wait, like any other phase) and never holds anything meanwhile. The load
itself runs in the service's nursery, not in the request's task: a request that hangs up while its model loads
leaves the load to finish for the next one.

Fairness: swaps happen in arrival order. A request whose model is not loaded joins one line (`_Waiter`); only the
line's head makes room, choosing the models to unload (idle ones first, then the least recently used) and
keeping that choice. From then on those models drain: the requests using them finish, and a new request for one
of them joins the line behind the head instead of starting, so a stream of requests for a busy model cannot
starve a request waiting to swap it out. A request for a loaded model that no waiter needs unloaded starts at
once.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio

from strata.config import Config
from strata.gguf_file import GGUFError, GGUFFile
from strata.models.hub import is_hub_model
from strata.request_errors import ServiceUnavailable
from strata.served_model import ServedModel

LOAD_RETRY_AFTER = 5  # seconds a request whose model failed to load is asked to wait before trying again


class UnknownModel(LookupError):
    """A request named a model the server does not serve; `names` are the ones it does."""

    def __init__(self, name: str, names: list[str]):
        what = f"the model {name!r} does not exist" if name else "the request names no model"
        super().__init__(f"{what}: this server serves {', '.join(names)}")
        self.name = name
        self.names = names


@dataclass(eq=False)
class _Waiter:
    """A place in the line for memory: a request's, whose model must be loaded (or, drained, loaded again), or a
    download's load task's (`room`), whose model's size is known only once downloaded."""

    model: ServedModel
    room: bool = False
    victims: list[ServedModel] = field(default_factory=list)  # the models the head unloads as they go idle


class ModelSet:
    """The served models, by name.

    Args:
        models: the models, in the order the configuration names them.
        named: requests pick their model by name (the `models` key); False: one model, which serves whatever
            name a request sends (as a single-model server always has).
        budget: the bytes the loaded models may take together (`models_memory`); None: no bound.
    """

    def __init__(self, models: list[ServedModel], named: bool, budget: int | None = None):
        self.models = models
        self.named = named
        self.budget = budget
        self._by_name = {name: model for model in models for name in model.names}
        self._changed = trio.Event()  # set (and replaced) when a model's state or users change
        self._line: list[_Waiter] = []  # those waiting for memory, in arrival order (the module's docstring)
        self.nursery: trio.Nursery | None = None  # where loads and unloads run (the service's)
        self.log: Callable[[str], None] = print

    @classmethod
    def from_config(cls, config: Config) -> ModelSet:
        if not config.models:
            return cls([ServedModel(config, model_names(config))], named=False)
        models = [ServedModel(config.for_model(entry), entry.names) for entry in config.models]
        return cls(models, named=True, budget=config.models_memory)

    @property
    def default(self) -> ServedModel:
        """The first model (the only one of a single-model server)."""
        return self.models[0]

    @property
    def names(self) -> list[str]:
        return [model.name for model in self.models]

    def find(self, name: str | None) -> ServedModel:
        """The model a request's `model` names; a single-model server's whatever the name.

        Raises:
            UnknownModel: no served model has that name or alias.
        """
        if not self.named:
            return self.default
        model = self._by_name.get(name or "")
        if model is None:
            raise UnknownModel(name or "", self.names)
        return model

    def measure(self) -> None:
        """Each named model's footprint, from its files (blocking: run it in a worker thread)."""
        for model in self.models:
            model.footprint = footprint(model.config)

    # --- a request's model

    @asynccontextmanager
    async def use(self, model: ServedModel) -> AsyncIterator[ServedModel]:
        """Hold `model` for a request: loaded first if need be (models named by the `models` key), after the
        requests that waited for memory before it (the module's docstring), and never unloaded while held.

        Raises:
            ServiceUnavailable: the model failed to load, or cannot fit `models_memory` at all.
        """
        model.users += 1
        try:
            if self.named:
                await self._loaded(model)
            model.last_used = time.monotonic()
            yield model
        finally:
            model.users -= 1
            model.last_used = time.monotonic()
            self._change()

    def waits(self, model: ServedModel) -> bool:
        """Whether a request for `model` made now would wait: its model is not loaded, or it drains for a swap,
        or earlier requests for it wait in the line."""
        return model.state != "loaded" or self.draining(model) or self.waiting(model) > 0

    def waiting(self, model: ServedModel) -> int:
        """Requests in the line for memory that want `model`."""
        return sum(1 for waiter in self._line if waiter.model is model and not waiter.room)

    async def _loaded(self, model: ServedModel) -> None:
        """Wait until `model` is loaded and this request's turn in the line has come (at once when the model is
        loaded and no waiter needs it unloaded)."""
        if not self.waits(model):
            return
        waiter = _Waiter(model)
        self._line.append(waiter)
        attempt = None  # the load this request waits for
        try:
            while model.state != "loaded" or waiter in self._line:
                if model.state == "failed" and attempt == model.loads:
                    raise ServiceUnavailable(f"the model {model.name} failed to load: {model.load_error}",
                                             retry_after=LOAD_RETRY_AFTER)
                if self._line and self._line[0] is waiter:
                    self._serve_head(waiter)
                if model.state in ("downloading", "loading"):
                    attempt = model.loads
                if model.state != "loaded" or waiter in self._line:
                    await self._changed.wait()
        finally:
            self._leave(waiter)

    async def _room(self, model: ServedModel) -> None:
        """Wait for the room to load `model`, a downloaded model measured only now. Its load had its turn when it
        began: it waits at the head of the line (behind it, a waiter could wait for the memory it takes)."""
        waiter = _Waiter(model, room=True)
        self._line.insert(0, waiter)
        try:
            while waiter in self._line:
                if self._line and self._line[0] is waiter:
                    self._serve_head(waiter)
                if waiter in self._line:
                    await self._changed.wait()
        finally:
            self._leave(waiter)

    def _serve_head(self, waiter: _Waiter) -> None:
        """The line's head: it leaves when its model is loaded or being loaded, or once room is made for it (its
        victims unloaded as they go idle), starting the load.

        Raises:
            ServiceUnavailable: the model alone is over the budget.
        """
        model = waiter.model
        if not waiter.room and model.state in ("loaded", "downloading", "loading"):
            self._leave(waiter)
        elif model.state != "unloading" and self._make_room(waiter):
            self._leave(waiter)
            if not waiter.room:
                self._start_load(model)

    def _make_room(self, waiter: _Waiter) -> bool:
        """Whether `waiter`'s model fits now; if not, choose the models to unload until it will (idle ones first,
        then the least recently used; a choice kept until the waiter leaves) and start the unload of those that
        are idle (their unloads run in the service's nursery: the waiter waits for them).

        Raises:
            ServiceUnavailable: the model alone is over the budget.
        """
        model = waiter.model
        if self.budget is None:
            return True
        if model.footprint > self.budget:
            raise ServiceUnavailable(f"the model {model.name} needs {model.footprint / 2**30:,.2f} GiB, more than "
                                     f"models_memory ({self.budget / 2**30:,.2f} GiB)")
        need = self.taken(besides=model) + model.footprint - self.budget
        if need <= 0:
            return True
        need -= sum(victim.footprint for victim in waiter.victims if victim.state in ("loaded", "unloading"))
        others = sorted((other for other in self.models
                         if other.state == "loaded" and other is not model and other not in waiter.victims),
                        key=lambda other: (not self._idle(other), other.last_used))
        for other in others:
            if need <= 0:
                break
            waiter.victims.append(other)
            need -= other.footprint
        for victim in waiter.victims:
            if victim.state == "loaded" and self._idle(victim):
                self._start_unload(victim)
        return False

    def _idle(self, model: ServedModel) -> bool:
        """No request holds `model` (those that named it, if any, all wait in the line)."""
        return model.users == self.waiting(model)

    def draining(self, model: ServedModel) -> bool:
        """The line's head will unload `model` once it is idle: a new request for it waits in the line."""
        return any(model in waiter.victims for waiter in self._line)

    def _leave(self, waiter: _Waiter) -> None:
        if waiter in self._line:
            self._line.remove(waiter)
            self._change()

    def taken(self, besides: ServedModel | None = None) -> int:
        """The bytes the loaded models take (and those loading or unloading), `besides` left out."""
        return sum(model.footprint for model in self.models
                   if model.state in ("loading", "loaded", "unloading") and model is not besides)

    def _start_load(self, model: ServedModel) -> None:
        assert self.nursery is not None
        model.state = "loading"  # at once: no other request starts the same load
        model.loads += 1
        self.nursery.start_soon(self._load, model)

    async def _load(self, model: ServedModel) -> None:
        """Load `model` (an "hf:" one downloaded first, then measured and given room under the budget)."""
        assert self.nursery is not None
        try:
            if is_hub_model(model.config.model):
                await model.download(self.log)
                model.footprint = await trio.to_thread.run_sync(footprint, model.config)
                model.state = "loading"
                await self._room(model)
            await model.load(self.nursery, self.log)
        except Exception as error:  # noqa: BLE001 - kept in model.load_error for its requests and /v1/models
            model.state, model.load_error = "failed", error
            self.log(f"error: the model {model.name} failed to load: {error}")
        finally:
            self._change()

    def _start_unload(self, model: ServedModel) -> None:
        assert self.nursery is not None
        model.state = "unloading"
        self.log(f"unloading {model.name} to make room in models_memory")
        self.nursery.start_soon(self._unload, model)

    async def _unload(self, model: ServedModel) -> None:
        try:
            await model.unload()
        finally:
            self._change()

    def _change(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # --- the service's end

    async def close(self) -> None:
        """End every model's engine thread (the service is closing: no request runs)."""
        for model in self.models:
            await model.stop()

    def close_engines(self) -> None:
        for model in self.models:
            model.close()


def model_names(config: Config) -> list[str]:
    """The names the model is served as: the `model_alias` names, else the file's name."""
    aliases = [name.strip() for name in (config.model_alias or "").split(",") if name.strip()]
    if aliases:
        return aliases
    return [os.path.basename(config.model).removesuffix(".gguf") if config.model else "strata"]


def footprint(config: Config) -> int:
    """What a model takes loaded, as the budget counts it: its file or files (the weights are copied, or mapped and
    read), its mmproj file, and its KV cache (`slots` x `context` positions). A model file that cannot be read
    counts 0: its load fails with the reason."""
    from strata.engine_cffi import kv_cache_bytes

    mmproj = config.vision.mmproj
    total = os.path.getsize(mmproj) if mmproj and os.path.isfile(mmproj) else 0
    try:
        with GGUFFile(config.model or "") as file:
            meta = file.metadata
            total += sum(os.path.getsize(path) for path in file.paths)  # a split model's every part
    except (GGUFError, OSError):
        return total
    arch = meta.get("general.architecture")
    n_layer, n_head = meta.get(f"{arch}.block_count"), meta.get(f"{arch}.attention.head_count")
    n_embd = meta.get(f"{arch}.embedding_length")
    if not (isinstance(n_layer, int) and isinstance(n_head, int) and isinstance(n_embd, int)):
        return total
    n_head_kv = meta.get(f"{arch}.attention.head_count_kv", n_head)
    head_dim = meta.get(f"{arch}.attention.key_length", n_embd // n_head)
    if not (isinstance(n_head_kv, int) and isinstance(head_dim, int)):  # per-layer values: not one of ours
        return total
    return total + kv_cache_bytes(n_layer, n_head_kv, head_dim, config.context, config.slots, config.kv)
