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
    another (a slot is the largest layer's expert: a model may mix types from layer to layer). The bookkeeping is
    `strata_expert_slots` (cuda/expert_cache.c), which the backend's layer call (`strata_dev_moe_layer`) steps
    itself; this class makes it and steps it for the tests.

    Args:
        device: where the slots live (allocated as the cache fills, freed when the device closes).
        n_layer, n_expert: the model's MoE layers and experts per layer.
        capacity: experts held over all layers.
        expert_bytes: per layer, the (gate, up, down) bytes of one of its experts.
        layers: per layer, where its experts lie in host memory (a `strata_host_layer_experts *` of the device's
            interface: each matrix's base and an expert's bytes), which an upload reads in one call; kept alive by
            the caller as long as the slots.
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
        self.device, self.capacity, self.n_expert = device, capacity, n_expert
        self.expert_bytes = list(expert_bytes)
        self.slot_bytes = max(sum(sizes) for sizes in self.expert_bytes)
        self.policy = ExpertPolicy(n_layer, n_expert, capacity, uploads_per_step=uploads_per_step, prior=prior)
        self.link_rate = link_rate
        self._preloaded, self._held_hits = len(prior), 0
        ffi, lib = device.ffi, device.lib
        keys = [layer * n_expert + e for layer, e in prior]
        handle = lib.strata_expert_slots_new(
            device.handle, ffi.cast("struct strata_expert_policy *", self.policy.address), n_layer, n_expert,
            capacity, self.slot_bytes, ffi.new("strata_host_layer_experts *[]", list(layers)), upload_stream,
            compute_stream, -1.0 if uploads_per_step is None else uploads_per_step, link_rate or 0.0,
            MIN_UPLOADS_PER_STEP, ffi.new("int[]", keys), len(keys))
        if handle == ffi.NULL:
            device.check(1)
        self.handle = ffi.gc(handle, lib.strata_expert_slots_free)
        # every expert's slot address by layer * n_expert + expert, 0 where it is not held: a view of the C table
        self.table = np.frombuffer(ffi.buffer(lib.strata_expert_slots_table(handle), 8 * n_layer * n_expert),
                                   np.uint64)
        self._out = np.empty((4, n_expert), np.int32)  # a step's hits, misses, uploads, evictions
        self._lengths = np.empty(4, np.int32)
        self._out_ptr = ffi.new("int *[]", [ffi.from_buffer("int[]", row) for row in self._out])
        self._lengths_ptr = ffi.from_buffer("int[]", self._lengths)

    @property
    def counts(self) -> ExpertCounts:
        counts = self.device.ffi.new("long long[3]")
        self.device.lib.strata_expert_slots_counts(self.handle, counts)
        return ExpertCounts(counts[0] + self._held_hits, counts[1], counts[2], self._preloaded)

    def begin_step(self) -> None:
        """Start a forward pass: it may read the experts whose uploads the last one queued (the compute stream
        waits for them before the first such read), and start as many uploads as the link moves in the time the
        last one's misses took."""
        budget = self.device.ffi.new("double *")
        self.device.check(self.device.lib.strata_expert_slots_begin_step(self.handle, budget))
        self.policy.uploads_per_step = None if budget[0] < 0 else budget[0]

    def misses_took(self, seconds: float) -> None:
        """A layer's misses kept the CPU busy for `seconds` of this step (the uploads it queued overlap them)."""
        self.device.lib.strata_expert_slots_took(self.handle, seconds)

    def step(self, layer: int, experts: Sequence[int] | np.ndarray) -> StepOutcome:
        """The layer needs `experts` (distinct): count them, and queue the uploads the policy starts."""
        needed = np.asarray(experts, np.int32)
        self.device.check(self.device.lib.strata_expert_slots_step(
            self.handle, layer, self.device.ffi.from_buffer("int[]", needed), len(needed), self._out_ptr,
            self._lengths_ptr))
        hits, misses, uploads, evictions = (row[:n].tolist() for row, n in zip(self._out, self._lengths, strict=True))
        return StepOutcome(tuple(hits), tuple(misses), tuple(uploads),
                           tuple(divmod(key, self.n_expert) for key in evictions))

    def count_held(self, experts: int) -> None:
        """A step of a cache that holds every expert: `experts` distinct experts over its layer-steps, each a hit
        (the policy is not stepped: nothing can be evicted or uploaded)."""
        self._held_hits += experts

    def slots_of(self, layer: int, experts: Sequence[int]) -> np.ndarray:
        """The slot addresses of held experts of a layer (uint64: a `void *[]` for the device's calls)."""
        return self.table[layer * self.n_expert + np.asarray(experts, np.int64)]

    def matrices(self, layer: int, expert: int) -> tuple[Any, Any, Any]:
        """The device pointers of a held expert's gate, up and down matrices."""
        base = self.device.ffi.cast("char *", int(self.table[layer * self.n_expert + expert]))
        gate, up, _ = self.expert_bytes[layer]
        return base, base + gate, base + gate + up
