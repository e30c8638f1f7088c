"""The expert cache of the device backend: the routed experts held in device memory, which the policy
(`ExpertPolicy`: the decisions of the simulator's `strata.experts.simulate.AdaptiveLrfuCache`, made in C)
chooses step by step.

Each step (a forward pass of the backend), layer by layer, the backend tells `step` the distinct experts the layer's
tokens chose; the experts held are hits (computed on the device from their slot), the rest misses (computed by the
CPU from the mapped file). The policy then names misses to upload for later steps and the experts they evict: an
upload copies the expert's three matrices into the evicted expert's slot, or a new one while the cache is filling,
on the upload stream. An expert is only ever computed from its slot a step after its upload was queued: when the
next step begins, an event marks the uploads queued so far (one event, recorded again each step), and the compute
stream waits on it just before the first launch that reads one of them. The host never waits on the link, and the
compute stream only where a step reads an expert whose upload may still be under way; with the link paced (below)
it has arrived by then.

How many uploads a step may start is paced by the link: while the CPU computes a step's misses, the upload stream
moves `link_rate` bytes a second, so the next step may start as many uploads as fit in the time this step's misses
took (at least `MIN_UPLOADS_PER_STEP`, so a cache whose steps are all hits still takes in a new hot expert now and
then). Until a step has had misses the budget is `uploads_per_step`. Without a link rate (None) the budget stays
`uploads_per_step`, as the simulator's fixed budget.

A prior (a placement learned from a routing trace recorded earlier, `strata.experts.simulate.most_frequent`) is
uploaded when the slots are made, its slots one allocation: the cache starts holding it, as `AdaptiveLrfuCache`
starts following it. A cache that holds every expert is given them all as its prior; the backend's resident steps
then count their hits with `count_held` and do not step the policy (nothing can be evicted or uploaded).

The counts (hits, misses, uploads) are those the simulator's `replay` counts on the same routing; the prior's
experts are counted apart (`preloaded`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from strata.engine_cffi.device import Device
from strata.engine_cffi.expert_policy import ExpertPolicy
from strata.experts.simulate import Key, StepOutcome

# Uploads a step may start, over all its layers: what the link moves during a decode step of a mid-sized MoE
# without delaying it (the policy releases the budget evenly over the layers; see strata.experts.simulate).
UPLOADS_PER_STEP = 4.0
# The paced budget's floor: a step that kept the CPU busy for no time may still start an upload every fourth step.
MIN_UPLOADS_PER_STEP = 0.25


@dataclass
class ExpertCounts:
    """Layer-steps' experts since the backend started: computed on the device (hits) and by the CPU (misses),
    and the uploads the policy started."""

    hits: int = 0
    misses: int = 0
    uploads: int = 0
    preloaded: int = 0  # the prior's experts, uploaded when the slots were made


class ExpertSlots:
    """Up to `capacity` experts in device memory, each in a slot holding its gate, up and down matrices one after
    another (a slot is the largest layer's expert: a model may mix types from layer to layer).

    Args:
        device: where the slots live (allocated as the cache fills, freed when the device closes).
        n_layer, n_expert: the model's MoE layers and experts per layer.
        capacity: experts held over all layers.
        expert_bytes: per layer, the (gate, up, down) bytes of one of its experts.
        layers: per layer, where its experts lie in host memory (a `strata_host_layer_experts *` of the device's
            interface: each matrix's base and an expert's bytes), which an upload reads in one call.
        upload_stream: the device stream the uploads go on.
        compute_stream: the device stream that computes the hits, which waits for their uploads.
        uploads_per_step: the uploads a step may start (None: no bound); with a link rate, the budget until the
            first step with misses.
        prior: (layer, expert) pairs to hold from the start (at most `capacity`).
        link_rate: bytes a second the upload stream moves (None: the budget is not paced).
    """

    def __init__(self, device: Device, n_layer: int, n_expert: int, capacity: int,
                 expert_bytes: Sequence[tuple[int, int, int]],
                 layers: Sequence[Any], upload_stream: int,
                 uploads_per_step: float | None = UPLOADS_PER_STEP, prior: Sequence[Key] = (),
                 link_rate: float | None = None, compute_stream: int = 0) -> None:
        self.device, self.capacity = device, capacity
        self.expert_bytes = list(expert_bytes)
        self.slot_bytes = max(sum(sizes) for sizes in self.expert_bytes)
        self._layers, self._stream, self._compute = layers, upload_stream, compute_stream
        self.policy = ExpertPolicy(n_layer, n_expert, capacity, uploads_per_step=uploads_per_step, prior=prior)
        self.link_rate = link_rate
        self.counts = ExpertCounts(preloaded=len(prior))
        self._slot: dict[tuple[int, int], Any] = {}  # (layer, expert) -> its slot (a device pointer)
        self.n_expert = n_expert
        # every expert's slot address by layer * n_expert + expert, 0 where it is not held: a layer's hits' slots
        # in one array (`slots_of`)
        self.table = np.zeros(n_layer * n_expert, np.uint64)
        self._free: list[Any] = []  # slots of evicted experts, to be reused
        self._miss_seconds: float | None = None  # what the current step's misses took, once it had some
        self._queued: set[Key] = set()  # experts whose uploads were queued since the event was last recorded
        self._arriving: set[Key] = set()  # experts whose uploads the event marks, until the compute stream waits
        self._uploaded: int | None = None  # the event: the uploads queued before this step began
        if prior:  # the prior's slots in one allocation (a device checks each copy against its allocations)
            block = device.ffi.cast("char *", device.alloc(len(prior) * self.slot_bytes))
            for i, (layer, expert) in enumerate(prior):
                self._upload(layer, expert, block + i * self.slot_bytes)

    def begin_step(self) -> None:
        """Start a forward pass: it may read the experts whose uploads the last one queued (the compute stream
        waits for them before the first such read), and start as many uploads as the link moves in the time the
        last one's misses took."""
        if self._queued:
            if self._uploaded is None:
                self._uploaded = self.device.record(self._stream)
            else:
                self.device.rerecord(self._stream, self._uploaded)
            self._arriving |= self._queued
            self._queued = set()
        if self.link_rate is not None and self._miss_seconds is not None:
            paced = self._miss_seconds * self.link_rate / self.slot_bytes
            self.policy.uploads_per_step = max(MIN_UPLOADS_PER_STEP, paced)
            self._miss_seconds = 0.0
        self.policy.begin_step()

    def misses_took(self, seconds: float) -> None:
        """A layer's misses kept the CPU busy for `seconds` of this step (the uploads it queued overlap them)."""
        self._miss_seconds = (self._miss_seconds or 0.0) + seconds

    def step(self, layer: int, experts: Sequence[int] | np.ndarray) -> StepOutcome:
        """The layer needs `experts` (distinct): count them, and queue the uploads the policy starts."""
        outcome = self.policy.step(layer, experts)
        if self._arriving and any((layer, e) in self._arriving for e in outcome.hits):
            assert self._uploaded is not None
            self.device.wait(self._compute, self._uploaded)  # covers every upload the event marks
            self._arriving = set()
        self.counts.hits += len(outcome.hits)
        self.counts.misses += len(outcome.misses)
        self.counts.uploads += len(outcome.uploads)
        for key in outcome.evictions:
            self._free.append(self._slot.pop(key))
            self.table[key[0] * self.n_expert + key[1]] = 0
            self._arriving.discard(key)
            self._queued.discard(key)
        for e in outcome.uploads:
            self._upload(layer, e)
        return outcome

    def count_held(self, experts: int) -> None:
        """A step of a cache that holds every expert: `experts` distinct experts over its layer-steps, each a hit
        (the policy is not stepped: nothing can be evicted or uploaded)."""
        self.counts.hits += experts

    def slots_of(self, layer: int, experts: Sequence[int]) -> np.ndarray:
        """The slot addresses of held experts of a layer (uint64: a `void *[]` for the device's calls)."""
        return self.table[layer * self.n_expert + np.asarray(experts, np.int64)]

    def matrices(self, layer: int, expert: int) -> tuple[Any, Any, Any]:
        """The device pointers of a held expert's gate, up and down matrices."""
        base = self.device.ffi.cast("char *", self._slot[(layer, expert)])
        gate, up, _ = self.expert_bytes[layer]
        return base, base + gate, base + gate + up

    def _upload(self, layer: int, expert: int, slot: Any = None) -> None:
        if slot is None:
            slot = self._free.pop() if self._free else self.device.alloc(self.slot_bytes)
        self._slot[(layer, expert)] = slot
        self.table[layer * self.n_expert + expert] = int(self.device.ffi.cast("uintptr_t", slot))
        self._queued.add((layer, expert))
        self.device.upload_expert(slot, self._layers[layer], expert, self._stream)
