"""`ExpertPolicy`: the expert cache's replacement policy in C (`expert_policy.c`), what the GPU backend steps at
each layer of each step. It makes the decisions of `strata.experts.simulate.AdaptiveLrfuCache` with one budget
over every layer (the class is its reference: the tests replay traces through both), at a small part of the
cost: the Python class runs seven caches' bookkeeping per layer-step and searches every held expert for each
eviction, some milliseconds a step of a large model's cache (`bench/expert_policy.py`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from strata.engine_cffi._engine import ffi, lib
from strata.experts.simulate import AdaptiveLrfuCache, Key, StepOutcome


class ExpertPolicy:
    """`AdaptiveLrfuCache(n_layer, n_expert, capacity, uploads_per_step=..., prior=...)` (capacity over every
    layer), in C. `uploads_per_step` is read at each `begin_step`, as the class reads it.

    Raises:
        ValueError: no layers or experts, a negative capacity, a bad half-life or window, or a prior larger than
            the capacity or outside the model.
    """

    def __init__(self, n_layer: int, n_expert: int, capacity: int, uploads_per_step: float | None = None,
                 half_lives: Sequence[float] = AdaptiveLrfuCache.HALF_LIVES, window: float = 256.0,
                 prior: Iterable[Key] = (), switch_z: float = 0.5) -> None:
        keys = sorted({layer * n_expert + e for layer, e in prior})
        if len(keys) > capacity:
            raise ValueError(f"a prior of {len(keys)} experts does not fit a capacity of {capacity}")
        policy = lib.strata_expert_policy_new(n_layer, n_expert, capacity, ffi.new("double[]", list(half_lives)),
                                              len(half_lives), window, switch_z, ffi.new("int[]", keys), len(keys))
        if policy == ffi.NULL:
            raise ValueError(f"no expert policy for {n_layer} x {n_expert} experts, capacity {capacity}, "
                             f"half-lives {list(half_lives)}, window {window}, a prior of {len(keys)}")
        self._policy = ffi.gc(policy, lib.strata_expert_policy_free)
        self.n_layer, self.n_expert, self.capacity = n_layer, n_expert, capacity
        self.uploads_per_step = uploads_per_step
        self._n_shadow = len(half_lives)
        self._out = np.empty((4, n_expert), np.int32)  # hits, misses, uploads, evictions
        self._counts = np.empty(4, np.int32)
        self._ptr = [ffi.from_buffer("int[]", row) for row in self._out]
        self._counts_ptr = ffi.from_buffer("int[]", self._counts)

    def begin_step(self) -> None:
        """Start the next step (before its first layer's `step`)."""
        budget = self.uploads_per_step
        lib.strata_expert_policy_begin_step(self._policy, -1.0 if budget is None else budget)

    def step(self, layer: int, experts: Sequence[int] | np.ndarray) -> StepOutcome:
        """The step needs `experts` in `layer`: hits and misses, and the uploads and evictions it starts.

        Raises:
            ValueError: a layer or an expert out of range.
        """
        needed = np.asarray(experts, np.int32)
        status = lib.strata_expert_policy_step(self._policy, layer, ffi.from_buffer("int[]", needed), len(needed),
                                               *self._ptr, self._counts_ptr)
        if status:
            raise ValueError(f"layer {layer} of {self.n_layer}, experts {needed.tolist()} of {self.n_expert}")
        hits, misses, uploads, evictions = (row[:n].tolist() for row, n in zip(self._out, self._counts, strict=True))
        return StepOutcome(tuple(hits), tuple(misses), tuple(uploads),
                           tuple(divmod(key, self.n_expert) for key in evictions))

    @property
    def address(self) -> int:
        """The C policy's address (for the expert slots, which step it)."""
        return int(ffi.cast("uintptr_t", self._policy))

    @property
    def following_prior(self) -> bool:
        return lib.strata_expert_policy_chosen(self._policy) == self._n_shadow

    @property
    def chosen(self) -> int:
        """The shadow followed (an index of the half-lives); their count while the prior is."""
        return int(lib.strata_expert_policy_chosen(self._policy))

    @property
    def held(self) -> list[set[int]]:
        """Each layer's experts held (built on each call: for checks, not for steps)."""
        keys = np.empty(self.n_layer * self.n_expert, np.int32)
        n = lib.strata_expert_policy_held(self._policy, ffi.from_buffer("int[]", keys))
        out: list[set[int]] = [set() for _ in range(self.n_layer)]
        for key in keys[:n].tolist():
            out[key // self.n_expert].add(key % self.n_expert)
        return out

    def size(self) -> int:
        return sum(len(h) for h in self.held)
