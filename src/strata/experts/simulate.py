"""Which experts a GPU's memory keeps: the replacement policies of the expert cache, and a replay of routing
traces (`strata.experts.trace`) against them.

A cache holds up to `capacity` experts, counted over every layer (one budget of VRAM) or per layer. Each engine
step, layer by layer, the policy is told the distinct experts the step needs in that layer (`step`): those it
holds are hits (computed on the GPU), the others misses (computed on the CPU from RAM, in parallel); it may then
upload some misses for later steps, evicting others. Uploads run on their own stream during the step, so a step
may only start as many as the link moves in a step's time: `uploads_per_step`, released evenly over the layers
(what a layer leaves is there for the ones after it in the same step). A miss past that budget stays on the CPU.
A fractional budget accrues from step to step: a step starts at most ceil(uploads_per_step) uploads, and n steps
at most uploads_per_step * n.

The policies: `LruCache` and `LfuCache` (the classic baselines), `StaticCache` (a fixed placement, e.g. the most
frequent experts of another trace), `LrfuCache` (each expert's uses decay by half every `half_life` steps, the sum
scoring recency and frequency at once, and a miss is admitted only when its score beats the score of the expert
it would evict, so a one-off choice cannot push out an expert in steady use), and ours, `AdaptiveLrfuCache`: LRFU
with the half-life of the shadow LRFU cache that has hit most lately, by a clear lead, optionally starting from a
prior placement that a static shadow keeps in the running. The CUDA backend makes `AdaptiveLrfuCache`'s decisions
in C (`strata.engine_cffi.expert_policy`, held to this class step by step by its tests); `replay` measures them
here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from strata.experts.trace import RoutingTrace

Key = tuple[int, int]  # (layer, expert)


@dataclass(frozen=True)
class StepOutcome:
    """What one layer's step did: experts computed on the GPU (hits) and on the CPU (misses), the misses uploaded
    for later steps, and the (layer, expert) pairs evicted to make room for them."""

    hits: tuple[int, ...]
    misses: tuple[int, ...]
    uploads: tuple[int, ...]
    evictions: tuple[Key, ...]


class ExpertCache:
    """The experts a cache of `capacity` holds and the bookkeeping every policy shares; a subclass says which
    expert to evict (`_priorities`: the lowest goes first, ties to the lower layer, then the lower expert) and which
    misses to admit.

    Args:
        n_layer, n_expert: the model's MoE layers and experts per layer.
        capacity: experts held: over all layers, or in each layer when `per_layer`.
        uploads_per_step: uploads a step may start, over all its layers (None: no bound); a fraction accrues.
    """

    def __init__(self, n_layer: int, n_expert: int, capacity: int, per_layer: bool = False,
                 uploads_per_step: float | None = None) -> None:
        if n_layer < 1 or n_expert < 1:
            raise ValueError(f"a cache needs layers and experts, got {n_layer} x {n_expert}")
        if capacity < 0 or (uploads_per_step is not None and uploads_per_step < 0):
            raise ValueError(f"capacity {capacity} and uploads_per_step {uploads_per_step} must not be negative")
        self.n_layer, self.n_expert, self.capacity, self.per_layer = n_layer, n_expert, capacity, per_layer
        self.uploads_per_step = uploads_per_step
        self.held: list[set[int]] = [set() for _ in range(n_layer)]
        self._held = np.zeros((n_layer, n_expert), bool)  # `held` as a mask, which `_victim` reads
        self.now = -1  # the current step
        self._uploaded = 0  # by the current step so far
        self._credit = 0.0  # uploads the step may start in all, once every layer's share is released

    def begin_step(self) -> None:
        """Start the next step (before its first layer's `step`)."""
        self.now += 1
        if self.uploads_per_step is not None:  # what the last step left and this one's share, short of one more
            budget = self.uploads_per_step  # upload than ceil(budget): no step starts more than that
            self._credit = min(self._credit - self._uploaded + budget, max(budget, 1.0) + 1.0 - 1e-6)
        self._uploaded = 0

    def size(self) -> int:
        return sum(len(h) for h in self.held)

    def step(self, layer: int, experts: Iterable[int]) -> StepOutcome:
        """The step needs `experts` in `layer`: count hits and misses, then upload what the policy and the budget
        allow."""
        needed = sorted(set(experts))
        held = self.held[layer]
        hits = tuple([e for e in needed if e in held])
        misses = tuple([e for e in needed if e not in held])
        self._touch_all(layer, needed)
        if not misses:  # nothing to upload (a decode step's common case: kept short, as the backend runs it)
            return StepOutcome(hits, misses, (), ())
        uploads: list[int] = []
        evictions: list[Key] = []
        for e in self._candidates(layer, misses):
            if len(uploads) >= self._allowance(layer):
                break
            if self._full(layer):
                victim = self._victim(layer, protect=needed)
                if victim is None or not self._admit((layer, e), victim):
                    continue
                self._release(*victim)
                evictions.append(victim)
            self._hold(layer, e)
            uploads.append(e)
        self._uploaded += len(uploads)
        return StepOutcome(hits, misses, tuple(uploads), tuple(evictions))

    def _allowance(self, layer: int) -> float:
        """Uploads this layer may still start: the step's budget released evenly up to this layer, less what the
        step has uploaded."""
        if self.uploads_per_step is None:
            return math.inf
        unreleased = self.uploads_per_step * (self.n_layer - layer - 1) / self.n_layer
        return math.floor(self._credit - unreleased + 1e-9) - self._uploaded

    def _full(self, layer: int) -> bool:
        return (len(self.held[layer]) if self.per_layer else self.size()) >= self.capacity

    def _hold(self, layer: int, expert: int) -> None:
        self.held[layer].add(expert)
        self._held[layer, expert] = True

    def _release(self, layer: int, expert: int) -> None:
        self.held[layer].discard(expert)
        self._held[layer, expert] = False

    def _victim(self, layer: int, protect: Sequence[int]) -> Key | None:
        """The held expert to evict: the lowest priority, ties to the lower layer, then the lower expert; not one
        of `protect` in `layer` (the step computes with those); None when there is none."""
        rows = slice(layer, layer + 1) if self.per_layer else slice(None)
        candidates = self._held[rows].copy()
        candidates[layer - (rows.start or 0), list(protect)] = False
        if not candidates.any():
            return None
        for column in self._priorities():
            values = column[rows]
            candidates &= values == values[candidates].min()
        at = int(np.argmax(candidates))  # the first in row-major order
        return (rows.start or 0) + at // self.n_expert, at % self.n_expert

    def _touch(self, layer: int, expert: int) -> None:
        """The step uses the expert (held or not)."""

    def _touch_all(self, layer: int, experts: Sequence[int]) -> None:
        """The step uses these experts of `layer`, each once."""
        for e in experts:
            self._touch(layer, e)

    def _candidates(self, layer: int, misses: Sequence[int]) -> Sequence[int]:
        """The misses in the order they are considered for upload."""
        return misses

    def _admit(self, key: Key, victim: Key) -> bool:
        """Whether the miss `key` may take the place of `victim`."""
        return True

    def _priorities(self) -> tuple[np.ndarray, ...]:
        """The eviction priority of every (layer, expert): arrays of shape (n_layer, n_expert), columns of a tuple
        compared in order, the lowest first."""
        raise NotImplementedError


class LruCache(ExpertCache):
    """Evicts the expert whose last use is oldest; uploads every miss the budget allows."""

    def __init__(self, n_layer: int, n_expert: int, capacity: int, per_layer: bool = False,
                 uploads_per_step: float | None = None) -> None:
        super().__init__(n_layer, n_expert, capacity, per_layer, uploads_per_step)
        self._last = np.full((n_layer, n_expert), -1, np.int64)

    def _touch(self, layer: int, expert: int) -> None:
        self._last[layer, expert] = self.now

    def _priorities(self) -> tuple[np.ndarray, ...]:
        return (self._last,)


class LfuCache(ExpertCache):
    """Evicts the expert used in the fewest steps so far (the older last use on a tie); counts every use, held
    or not, and uploads every miss the budget allows."""

    def __init__(self, n_layer: int, n_expert: int, capacity: int, per_layer: bool = False,
                 uploads_per_step: float | None = None) -> None:
        super().__init__(n_layer, n_expert, capacity, per_layer, uploads_per_step)
        self._count = np.zeros((n_layer, n_expert), np.int64)
        self._last = np.full((n_layer, n_expert), -1, np.int64)

    def _touch(self, layer: int, expert: int) -> None:
        self._count[layer, expert] += 1
        self._last[layer, expert] = self.now

    def _priorities(self) -> tuple[np.ndarray, ...]:
        return (self._count, self._last)


class StaticCache(ExpertCache):
    """Holds a fixed placement and uploads nothing."""

    def __init__(self, n_layer: int, n_expert: int, placement: Iterable[Key]) -> None:
        keys = sorted(set(placement))
        super().__init__(n_layer, n_expert, len(keys), uploads_per_step=0)
        for layer, e in keys:
            self._hold(layer, e)

    def _priorities(self) -> tuple[np.ndarray, ...]:
        return (np.zeros((self.n_layer, self.n_expert)),)


class LrfuCache(ExpertCache):
    """Recency and frequency in one score per (layer, expert), with admission by score.

    Each use adds 1 to the expert's score, and the score halves every `half_life` steps. It is kept as log2 of
    the score at the last use plus that step / half_life, which orders experts as their scores do now without
    touching the others at each step. Misses are considered best-scored first, and one is admitted only if it
    outscores the expert it would evict: the upload budget is not spent on one-off choices.
    """

    def __init__(self, n_layer: int, n_expert: int, capacity: int, per_layer: bool = False,
                 uploads_per_step: float | None = None, half_life: float = 16.0) -> None:
        if not half_life > 0:
            raise ValueError(f"half_life must be positive, got {half_life}")
        super().__init__(n_layer, n_expert, capacity, per_layer, uploads_per_step)
        self.half_life = half_life
        self.scores = np.full((n_layer, n_expert), -math.inf)  # log2(score) + step / half_life

    def _touch(self, layer: int, expert: int) -> None:
        self._touch_all(layer, (expert,))

    def _touch_all(self, layer: int, experts: Sequence[int]) -> None:
        # in Python floats (the same libm pow and log2 numpy's scalars call), a layer's row at a time: the policy
        # runs once per layer-step of the GPU backend, where numpy's per-scalar cost showed
        now, row = self.now / self.half_life, self.scores[layer]
        for e in experts:
            row[e] = now + math.log2(1.0 + 2.0 ** (row.item(e) - now))

    def _candidates(self, layer: int, misses: Sequence[int]) -> Sequence[int]:
        return sorted(misses, key=lambda e: -self.scores[layer, e])

    def _admit(self, key: Key, victim: Key) -> bool:
        return bool(self.scores[key] > self.scores[victim])

    def _priorities(self) -> tuple[np.ndarray, ...]:
        return (self.scores,)


class AdaptiveLrfuCache(ExpertCache):
    """Ours: LRFU whose half-life follows the routing. A shadow LRFU cache per half-life in `half_lives` (expert
    ids only: no memory behind them) runs on the same steps under the same budgets; the cache evicts and admits by
    the scores of the shadow it follows. A model whose hot experts stay hot takes a long half-life (frequency: a
    placement learned as it runs); one whose routing moves with the text takes a short one (recency).

    Each shadow's hits are counted, decaying by half every `window` steps, and the cache follows another shadow
    only when its count beats the followed one's by `switch_z` standard deviations (hits as Poisson counts,
    sqrt(a + b)): near-equal shadows trade places on noise, and each change of scores costs uploads and hits.

    prior: a placement learned beforehand, e.g. `most_frequent` of a routing trace recorded on the same workload
    (at most `capacity` experts). The cache starts holding it (uploaded at load) and following it; a static shadow
    of it competes with the LRFU shadows, and while the cache follows it, its members come first, then the longest
    half-life's scores. Where routing has a lasting hot set the prior is the best placement there is and the cache
    keeps it; where routing moves, an LRFU shadow outscores it within a few steps.
    """

    HALF_LIVES = (0.5, 2.0, 8.0, 32.0, 128.0, 1024.0)

    def __init__(self, n_layer: int, n_expert: int, capacity: int, per_layer: bool = False,
                 uploads_per_step: float | None = None, half_lives: Sequence[float] = HALF_LIVES,
                 window: float = 256.0, prior: Iterable[Key] = (), switch_z: float = 0.5) -> None:
        if not half_lives or not window > 0:
            raise ValueError(f"need half-lives and a positive window, got {half_lives} and {window}")
        super().__init__(n_layer, n_expert, capacity, per_layer, uploads_per_step)
        self.shadows = [LrfuCache(n_layer, n_expert, capacity, per_layer, uploads_per_step, h) for h in half_lives]
        self._longest = max(self.shadows, key=lambda shadow: shadow.half_life)
        self.prior = StaticCache(n_layer, n_expert, prior)
        self._has_prior = self.prior.size() > 0  # a static placement: it never changes
        if max(len(h) for h in self.prior.held) > capacity if per_layer else self.prior.size() > capacity:
            raise ValueError(f"a prior of {self.prior.size()} experts does not fit a capacity of {capacity}")
        self._in_prior = np.zeros((n_layer, n_expert))  # 1.0 for the prior's experts
        for layer, held in enumerate(self.prior.held):
            for e in sorted(held):
                self._in_prior[layer, e] = 1.0
                self._hold(layer, e)
        self.switch_z = switch_z
        self.merit = np.zeros(len(half_lives) + 1)  # each shadow's hits, decayed; the prior's last
        self._keep = 2.0 ** (-1.0 / window)
        self.chosen = len(half_lives) if self.prior.size() else len(half_lives) // 2  # the shadow followed

    @property
    def following_prior(self) -> bool:
        return self.chosen == len(self.shadows)

    @property
    def half_life(self) -> float:
        """The followed shadow's half-life; infinite while the cache follows its prior."""
        return math.inf if self.following_prior else self.shadows[self.chosen].half_life

    def begin_step(self) -> None:
        super().begin_step()
        self.merit *= self._keep
        best, followed = self.merit[int(np.argmax(self.merit))], self.merit[self.chosen]
        if best - followed > self.switch_z * math.sqrt(best + followed):
            self.chosen = int(np.argmax(self.merit))
        for shadow in self.shadows:
            shadow.uploads_per_step = self.uploads_per_step  # a budget paced step by step applies to them too
            shadow.begin_step()
        self.prior.begin_step()

    def step(self, layer: int, experts: Iterable[int]) -> StepOutcome:
        needed = list(experts)
        for i, shadow in enumerate(self.shadows):  # they touch the experts: their scores are up to date
            self.merit[i] += len(shadow.step(layer, needed).hits)
        if self._has_prior:
            self.merit[-1] += len(self.prior.step(layer, needed).hits)
        return super().step(layer, needed)

    def _score(self, key: Key) -> tuple[float, float]:
        if self.following_prior:
            return (float(self._in_prior[key]), float(self._longest.scores[key]))
        return (float(self.shadows[self.chosen].scores[key]), 0.0)

    def _candidates(self, layer: int, misses: Sequence[int]) -> Sequence[int]:
        return sorted(misses, key=lambda e: self._score((layer, e)), reverse=True)

    def _admit(self, key: Key, victim: Key) -> bool:
        return self._score(key) > self._score(victim)

    def _priorities(self) -> tuple[np.ndarray, ...]:
        if self.following_prior:
            return (self._in_prior, self._longest.scores)
        return (self.shadows[self.chosen].scores,)


# --- replay


@dataclass(frozen=True)
class StepCounts:
    """One step of a replay: its tokens, each layer's (hits, misses), and the uploads it started."""

    step: int
    n_tok: int
    layers: tuple[tuple[int, int], ...]
    uploads: int


@dataclass
class ReplayStats:
    """A replay's counts over its measured steps."""

    hits: int = 0
    misses: int = 0
    uploads: int = 0
    evictions: int = 0
    steps: list[StepCounts] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.hits / max(self.hits + self.misses, 1)

    @property
    def most_uploads_in_a_step(self) -> int:
        return max((s.uploads for s in self.steps), default=0)


def replay(trace: RoutingTrace, cache: ExpertCache, measure_from: int = 0,
           pace: Callable[[StepCounts], float] | None = None) -> ReplayStats:
    """Run the trace's steps through `cache`, counting from step `measure_from` on (the steps before warm it).

    pace: each step's upload budget from its hits and misses against the cache as the step begins (uploads 0), as
    the backend budgets a layer's uploads by the time its misses keep the CPU busy; None: the cache's own budget.
    """
    stats = ReplayStats()
    for records in trace.steps():
        used = [record.used().tolist() for record in records]
        if pace is not None:
            cache.uploads_per_step = pace(StepCounts(records[0].step, len(records[0].experts), tuple(
                (len(held & set(u)), len(set(u) - held)) for u, held in
                zip(used, (cache.held[r.layer] for r in records), strict=True)), 0))
        cache.begin_step()
        outcomes = [cache.step(record.layer, u) for record, u in zip(records, used, strict=True)]
        if records[0].step < measure_from:
            continue
        layers = tuple((len(out.hits), len(out.misses)) for out in outcomes)
        uploads = sum(len(out.uploads) for out in outcomes)
        stats.hits += sum(h for h, _ in layers)
        stats.misses += sum(m for _, m in layers)
        stats.uploads += uploads
        stats.evictions += sum(len(out.evictions) for out in outcomes)
        stats.steps.append(StepCounts(records[0].step, len(records[0].experts), layers, uploads))
    return stats


def most_frequent(trace: RoutingTrace, capacity: int, steps: range | None = None,
                  per_layer: bool = False) -> list[Key]:
    """The `capacity` (layer, expert) pairs used in the most of the given steps (all by default): a static
    placement. Ties go to the lower layer, then the lower expert."""
    info = trace.info
    counts = np.zeros((info.n_layer, info.n_expert), np.int64)
    for record in trace.records:
        if steps is None or record.step in steps:
            counts[record.layer, record.used()] += 1
    if per_layer:
        return [(il, int(e)) for il in range(info.n_layer)
                for e in np.argsort(-counts[il], kind="stable")[:capacity]]
    order = np.argsort(-counts.ravel(), kind="stable")[:capacity]
    return [(int(i) // info.n_expert, int(i) % info.n_expert) for i in order]
