"""The models a server serves: one (the `model` key, loaded at startup), or several named by the `models` key, each
loaded when a request first names it and unloaded, least recently used first, when loading another would pass
`models_memory`.

Invariant: a model is never unloaded while a request uses it. A request pins its model (`ModelSet.use`) from the
moment it names it until its answer ends; a request whose model must wait for memory waits in its own task (a
checkpoint: its hang-up cancels the wait, like any other phase) and never holds anything meanwhile. The load
itself runs in the service's nursery, not in the request's task: a request that hangs up while its model loads
leaves the load to finish for the next one.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

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
        """Hold `model` for a request: loaded first if need be (models named by the `models` key), and never
        unloaded while held.

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

    async def _loaded(self, model: ServedModel) -> None:
        """Wait until `model` is loaded, loading it (after unloading idle ones to make room) when it is not."""
        attempt = None  # the load this request waits for
        while model.state != "loaded":
            if model.state == "failed" and attempt == model.loads:
                raise ServiceUnavailable(f"the model {model.name} failed to load: {model.load_error}",
                                         retry_after=LOAD_RETRY_AFTER)
            if model.state in ("not loaded", "failed") and self._make_room(model):
                self._start_load(model)
            if model.state in ("downloading", "loading"):
                attempt = model.loads
            await self._changed.wait()

    def _make_room(self, model: ServedModel) -> bool:
        """Whether `model` fits now; if not, unload idle models, least recently used first, until it will (their
        unloads run in the service's nursery: the caller waits for them).

        Raises:
            ServiceUnavailable: the model alone is over the budget.
        """
        if self.budget is None:
            return True
        if model.footprint > self.budget:
            raise ServiceUnavailable(f"the model {model.name} needs {model.footprint / 2**30:,.2f} GiB, more than "
                                     f"models_memory ({self.budget / 2**30:,.2f} GiB)")
        taken = self.taken(besides=model)
        if taken + model.footprint <= self.budget:
            return True
        idle = sorted((other for other in self.models if other.state == "loaded" and other.users == 0),
                      key=lambda other: other.last_used)
        for victim in idle:
            if taken + model.footprint <= self.budget:
                break
            self._start_unload(victim)
            taken -= victim.footprint
        return False

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
                while not self._make_room(model):
                    await self._changed.wait()
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
