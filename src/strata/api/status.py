"""What the status routes say: `/status` (the engine now), `/v1/status` (the server), `/v1/history`, the live
stream (`/v1/status/stream`) and the Prometheus metrics (`/metrics`), all read from the service when asked; and
how many live streams may be open at once."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import aclosing, contextmanager
from typing import Any

import trio
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest

import strata
from strata.api import sse
from strata.api.errors import ApiError
from strata.api.vllm_metrics import VllmMetrics
from strata.history import Totals
from strata.served_model import ServedModel
from strata.service import Service

STREAM_RETRY_AFTER = 5  # seconds a client refused a status stream is asked to wait


def status(service: Service) -> dict[str, Any]:
    """The engine right now: whether a request holds a slot, how many wait, each slot, and the progress of the
    earliest request on a slot."""
    current = service.current
    return {
        "busy": service.turn.busy,
        "queued": service.turn.queued,
        "phase": service.phase,
        "slots": service.slots(),
        "request": None if current is None else {
            "id": current.id,
            "route": current.route,
            "prompt_tokens": current.prompt_tokens,
            "reused_tokens": current.reused_tokens,
            "generated_tokens": current.output_tokens,
            "draft_length": current.draft_length,
            "acceptance_rate": current.acceptance_rate,
        },
    }


def server_status(service: Service) -> dict[str, Any]:
    """The server: version, model, engine settings, vision state, totals and the last request."""
    engine = service.engine
    config = service.config
    last = service.history.last
    return {
        "version": strata.__version__,
        "model": service.model_name,
        "loaded": service.ready,
        "context": engine.n_ctx if engine is not None else config.context,
        "engine": {
            "backend": engine.backend if engine is not None else None,
            "threads": engine.threads if engine is not None else config.threads,
            "kv": config.kv,
            # the GPU backend's expert cache: capacity, bytes, hits, misses, uploads (None on the CPU engine)
            "expert_cache": engine.expert_counts() if engine is not None else None,
        },
        "vision": {"state": "not available", "mmproj": service.models.default.config.vision.mmproj},
        "kv_disk": None if service.models.default.kv_tier is None else service.models.default.kv_tier.status(),
        "kv_events": service.kv_events.status() if service.kv_events is not None else None,
        "totals": service.history.totals.as_dict(),
        "last": None if last is None else last.as_dict(),
        "models": models_status(service),
        **status(service),
    }


def vision_status(service: Service) -> dict[str, Any]:
    return _vision(service.models.default)


def _vision(model: ServedModel) -> dict[str, Any]:
    vision = model.vision
    return vision.status() if vision is not None else {"mode": "off", "state": "off", "available": False}


def model_list(service: Service) -> list[dict[str, Any]]:
    """`/v1/models`: a single-model server's names (each alias its own entry, as OpenAI lists models), or each
    of several models with its aliases and state ("loaded", "loading", "not loaded", "unloading", "failed")."""
    created = int(service.started)
    if not service.models.named:
        model = service.models.default
        context = model.engine.n_ctx if service.ready else model.config.context
        return [{"id": name, "object": "model", "created": created, "owned_by": "strata",
                 "context_length": context, "max_model_len": context, "state": model.state}
                for name in model.names]
    listed = []
    for model in service.models.models:
        context = model.engine.n_ctx if model.ready else model.config.context
        entry = {"id": model.name, "object": "model", "created": created, "owned_by": "strata",
                 "context_length": context, "max_model_len": context, "aliases": model.names[1:],
                 "state": model.state}
        if model.state == "failed":
            entry["error"] = str(model.load_error)
        listed.append(entry)
    return listed


def models_status(service: Service) -> dict[str, Any]:
    """Every model: its names, state (an "hf:" model's download while it runs: bytes, rate, ETA), its requests
    (`users`: those that named it; `waiting`: those of them in the line for memory; `draining`: the line's head
    unloads it once idle), slots and queue, encoder and totals, and the memory budget they share."""
    models = service.models
    totals = service.history.by_model
    return {
        "memory": {"budget": models.budget, "taken": models.taken(), "named": models.named},
        "data": [{
            "name": model.name,
            "aliases": model.names[1:],
            "state": model.state,
            "download": None if model.transfer is None else model.transfer.as_dict(),
            "error": None if model.load_error is None else str(model.load_error),
            "file": model.config.model,
            "footprint": model.footprint,
            "users": model.users,
            "waiting": models.waiting(model),
            "draining": models.draining(model),
            "context": model.engine.n_ctx if model.ready else model.config.context,
            "busy": model.turn.busy,
            "queued": model.turn.queued,
            "slots": model.slots(),
            "vision": _vision(model),
            "totals": totals[model.name].as_dict() if model.name in totals else None,
        } for model in models.models],
    }


def live_status(service: Service, recent: int = 20) -> dict[str, Any]:
    """Everything the monitor shows, in one snapshot: the engine's slots (each one's state, request and cached
    tokens) and queue, every request in flight with its phase, slot and prompt progress, the encoder, the totals
    and the most recent finished requests."""
    return {
        "time": time.time(),
        "model": service.model_name,
        "slots": service.slots(),
        "busy": service.turn.busy,
        "queued": service.turn.queued,
        "requests": [progress.as_dict() for progress in service.activity],
        "vision": vision_status(service),
        "totals": service.history.totals.as_dict(),
        "recent": [row.as_dict() for row in list(reversed(service.history.rows))[:recent]],
        "models": models_status(service),
    }


def _generated(service: Service) -> int:
    """Tokens generated since startup, those of requests still running included."""
    return service.history.totals.output_tokens + sum(progress.row.output_tokens for progress in service.activity)


class StreamSeats:
    """The status streams open at once, at most `limit` (`limits.status_streams`): each one renders a snapshot on
    the event loop every interval for as long as its client stays, so without a bound a few hundred of them slow
    every request, `/health` included."""

    def __init__(self, limit: int):
        self.limit = limit
        self.taken = 0

    @contextmanager
    def seat(self) -> Iterator[None]:
        """Held for a stream's life.

        Raises:
            ApiError: 503 with a Retry-After when `limit` streams are open.
        """
        if self.taken >= self.limit:
            raise ApiError(503, f"{self.limit} status streams are open, the most this server allows",
                           kind="server_error", retry_after=STREAM_RETRY_AFTER)
        self.taken += 1
        try:
            yield
        finally:
            self.taken -= 1


async def open_live_stream(service: Service, interval: float, seats: StreamSeats) -> AsyncIterator[bytes]:
    """`live_status` as a server-sent event every `interval` seconds, with the decode rate over the interval
    (`decode_tokens_per_second`). Ends when the client hangs up (the request's nursery is cancelled) or the server
    starts shutting down (`service.stopping`).

    The stream takes its seat and its first snapshot here, before the status line goes out, so that a refusal
    gets its own status; from then on the seat is freed however the stream ends: closed by the response
    machinery, or, if the response never started its body, finalised by trio as a started generator.

    Raises:
        ApiError: 503 when every seat is taken.
    """
    stream = _live_stream(service, interval, seats)
    first = await anext(stream)
    return _resumed(first, stream)


async def _resumed(first: bytes, stream: AsyncGenerator[bytes, None]) -> AsyncIterator[bytes]:
    async with aclosing(stream):
        yield first
        async for event in stream:
            yield event


async def _live_stream(service: Service, interval: float, seats: StreamSeats) -> AsyncGenerator[bytes, None]:
    with seats.seat():
        before, generated = time.monotonic(), _generated(service)
        rate = 0.0
        while True:
            body = live_status(service)
            body["decode_tokens_per_second"] = rate
            yield sse.encode(body, "status")
            with trio.move_on_after(interval):
                await service.stopping.wait()
            if service.stopping.is_set():
                return
            now, total = time.monotonic(), _generated(service)
            rate = (total - generated) / (now - before)
            before, generated = now, total


def history(service: Service) -> dict[str, Any]:
    return {"object": "list", "data": [row.as_dict() for row in reversed(service.history.rows)]}


class _ServiceCollector:
    """Prometheus metrics computed from the service at scrape time (nothing to update on the request path). With
    several models (`models`), every metric has a `model` label: each model's requests, tokens, queue and slots,
    and its state (`strata_model_loaded`, `strata_model_footprint_bytes`)."""

    def __init__(self, service: Service):
        self._service = service

    def collect(self) -> Iterator[Metric]:
        service = self._service
        named = service.models.named
        label = ["model"] if named else []
        per_model = [(([model.name] if named else []), model) for model in service.models.models]
        totals = [(values, service.history.by_model.get(model.name) if named else service.history.totals)
                  for values, model in per_model]
        requests = CounterMetricFamily("strata_requests", "Finished requests by finish reason.",
                                       labels=["finish", *label])
        tokens = CounterMetricFamily("strata_tokens", "Tokens by kind.", labels=["kind", *label])
        prompt = CounterMetricFamily("strata_prompt_seconds", "Time spent processing prompts.", labels=label)
        decode = CounterMetricFamily("strata_decode_seconds", "Time spent generating tokens.", labels=label)
        sources = CounterMetricFamily("strata_prompt_tokens", "Prompt tokens by where their KV rows came from: a "
                                      "slot's cache (ram), the disk tier (disk), or computed (a miss).",
                                      labels=["source", *label])
        drafts = CounterMetricFamily("strata_draft_tokens", "Speculative decoding's draft tokens, verified and "
                                     "accepted (finished requests).", labels=["outcome", *label])
        for values, total in totals:
            total = total or Totals()
            for finish in ("stop", "length", "tool_calls", "cancel", "error", "refused", "unavailable"):
                requests.add_metric([finish, *values], total.finishes.get(finish, 0))
            tokens.add_metric(["prompt", *values], total.prompt_tokens)
            tokens.add_metric(["reused", *values], total.reused_tokens)
            tokens.add_metric(["generated", *values], total.output_tokens)
            prompt.add_metric(values, total.prompt_seconds)
            decode.add_metric(values, total.decode_seconds)
            sources.add_metric(["ram", *values], total.reused_tokens - total.disk_tokens)
            sources.add_metric(["disk", *values], total.disk_tokens)
            sources.add_metric(["computed", *values], total.prompt_tokens - total.reused_tokens)
            drafts.add_metric(["verified", *values], total.draft_tokens)
            drafts.add_metric(["accepted", *values], total.accepted_tokens)
        yield from (requests, tokens, sources, drafts, prompt, decode)
        yield from _expert_cache_metrics(per_model, label)
        gauges = {
            "strata_queue_length": ("Requests waiting for the engine.", lambda m: m.turn.queued),
            "strata_busy": ("1 while a request holds a slot (or the engine is held whole).",
                            lambda m: int(m.turn.busy)),
            "strata_slots": ("Sequences the engine holds at once.", lambda m: len(m.slots())),
            "strata_slots_busy": ("Slots with a request generating on them.",
                                  lambda m: sum(slot["state"] != "idle" for slot in m.slots())),
            "strata_batch_tokens": ("Tokens in the last engine step (all its sequences).",
                                    lambda m: m.loop.batcher.last_batch if m.loop is not None else 0),
        }
        if named:
            gauges["strata_model_loaded"] = ("1 while the model is loaded.", lambda m: int(m.ready))
            gauges["strata_model_footprint_bytes"] = ("What the model takes loaded, as models_memory counts it.",
                                                      lambda m: m.footprint)
        for name, (text, read) in gauges.items():
            gauge = GaugeMetricFamily(name, text, labels=label)
            for values, model in per_model:
                gauge.add_metric(values, read(model))
            yield gauge


def _expert_cache_metrics(per_model: list[tuple[list[str], ServedModel]], label: list[str]) -> Iterator[Metric]:
    """The GPU backend's expert cache, for the loaded models that have one."""
    counts = [(values, model.engine.expert_counts()) for values, model in per_model if model.ready]
    counts = [(values, c) for values, c in counts if c is not None]
    if not counts:
        return
    experts = CounterMetricFamily("strata_expert_cache_experts", "The GPU backend's routed experts by layer-step: "
                                  "computed from the device's expert cache (hit) or by the CPU (miss), and those "
                                  "uploaded to the cache (upload).", labels=["outcome", *label])
    size = GaugeMetricFamily("strata_expert_cache_bytes", "Device memory the expert cache may fill.", labels=label)
    for values, c in counts:
        for outcome, key in (("hit", "hits"), ("miss", "misses"), ("upload", "uploads")):
            experts.add_metric([outcome, *values], c[key])
        size.add_metric(values, c["bytes"])
    yield from (experts, size)


def metrics_registry(service: Service) -> CollectorRegistry:
    """A registry of its own per app, so that several apps in one process never share or clash."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_ServiceCollector(service))
    registry.register(VllmMetrics(service))  # the names the routers in front of a fleet read
    return registry


def metrics_text(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
