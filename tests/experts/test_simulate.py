"""The expert cache's policies on small hand-made traces whose answers are worked out by hand, and the bounds every
policy keeps: its capacity, the upload budget, the experts a step computes with."""

from __future__ import annotations

import numpy as np
import pytest

from strata.experts.simulate import (
    AdaptiveLrfuCache,
    ExpertCache,
    LfuCache,
    LrfuCache,
    LruCache,
    StaticCache,
    StepCounts,
    most_frequent,
    replay,
)
from strata.experts.trace import LayerStep, RoutingTrace, TraceInfo


def trace_of(steps: list[list[list[int]]], n_expert: int = 8) -> RoutingTrace:
    """A trace whose step s needs steps[s][layer] in each layer (one token choosing them all)."""
    n_layer = len(steps[0])
    records = [LayerStep(s, il, np.array([experts], np.int32)) for s, layers in enumerate(steps)
               for il, experts in enumerate(layers)]
    return RoutingTrace(TraceInfo("hand-made", "qwen3moe", n_layer, n_expert, len(steps[0][0])), records)


def one_layer(*experts: int) -> RoutingTrace:
    return trace_of([[[e]] for e in experts])


def test_lru_evicts_the_least_recently_used() -> None:
    cache = LruCache(1, 8, capacity=2)
    outcomes = []
    for e in (0, 1, 0, 2, 1):
        cache.begin_step()
        outcomes.append(cache.step(0, [e]))
    assert [(o.hits, o.misses, o.uploads, o.evictions) for o in outcomes] == [
        ((), (0,), (0,), ()), ((), (1,), (1,), ()), ((0,), (), (), ()),
        ((), (2,), (2,), ((0, 1),)),  # 0 was used at step 2, 1 at step 1
        ((), (1,), (1,), ((0, 0),)),  # 2 was used at step 3, 0 at step 2
    ]


def test_lfu_evicts_the_least_frequently_used() -> None:
    stats = replay(one_layer(0, 0, 1, 2, 1), LfuCache(1, 8, capacity=2))
    # step 3 evicts 1 (used once) not 0 (twice); step 4 evicts 2 (once) for 1 (now twice)
    assert (stats.hits, stats.misses, stats.uploads, stats.evictions) == (1, 4, 4, 2)


def test_lrfu_keeps_a_frequent_expert_from_a_one_off_choice() -> None:
    trace = one_layer(0, 0, 0, 1, 0)
    frequency_minded = replay(trace, LrfuCache(1, 8, capacity=1, half_life=1000.0))
    assert (frequency_minded.hits, frequency_minded.uploads) == (3, 1)  # 1 never outscores 0
    assert replay(trace, LruCache(1, 8, capacity=1)).hits == 2  # LRU swaps 0 out for 1, then back
    # with a short half-life three uses two steps ago weigh less than one now: 1 is admitted
    recency_minded = replay(trace, LrfuCache(1, 8, capacity=1, half_life=0.5))
    assert (recency_minded.hits, recency_minded.uploads) == (2, 3)


def test_lrfu_scores_decay_with_the_half_life() -> None:
    cache = LrfuCache(1, 8, capacity=1, half_life=2.0)
    for used in ([0], [0], [], [], [1]):  # 0 twice long ago: 2^-2 + 2^-1.5 ~ 0.60 against 1 for 1
        cache.begin_step()
        cache.step(0, used)
    assert cache.held[0] == {1}


def test_uploads_are_released_evenly_over_the_layers() -> None:
    # 4 layers, 2 uploads a step: layers 0..3 may have started 0, 1, 1, 2 uploads by their end
    cache = LruCache(4, 8, capacity=32, uploads_per_step=2)
    cache.begin_step()
    assert [len(cache.step(il, [0, 1, 2]).uploads) for il in range(4)] == [0, 1, 0, 1]
    # what a layer leaves is there for the ones after it in the same step (layer 1 needs nothing here)
    cache.begin_step()
    assert [len(cache.step(il, [] if il == 1 else [5, 6, 7]).uploads) for il in range(4)] == [0, 0, 1, 1]


def test_a_budget_under_one_upload_a_step_accrues() -> None:
    cache = LruCache(2, 64, capacity=64, uploads_per_step=0.4)
    uploads = []
    for s in range(10):
        cache.begin_step()
        uploads.append(sum(len(cache.step(il, [2 * s, 2 * s + 1]).uploads) for il in range(2)))
    assert uploads == [0, 0, 1, 0, 1, 0, 0, 1, 0, 1]  # 0.4, 0.8, 1.2 -> 0.2, 0.6, 1.0 -> 0, ...


def test_a_miss_past_the_budget_stays_on_the_cpu() -> None:
    cache = LrfuCache(1, 8, capacity=8, uploads_per_step=1)
    cache.begin_step()
    out = cache.step(0, [3, 4, 5])
    assert (out.misses, len(out.uploads)) == ((3, 4, 5), 1)
    assert len(cache.held[0]) == 1


def test_an_expert_the_step_computes_with_is_not_evicted() -> None:
    cache = LruCache(1, 8, capacity=1)
    cache.begin_step()
    cache.step(0, [0])
    cache.begin_step()
    out = cache.step(0, [0, 1])  # the only victim would be 0, which this step uses on the GPU
    assert (out.hits, out.misses, out.uploads, out.evictions) == ((0,), (1,), (), ())


def test_a_global_budget_evicts_across_layers_and_a_per_layer_one_does_not() -> None:
    shared, split = LruCache(2, 8, capacity=2), LruCache(2, 8, capacity=1, per_layer=True)
    for cache in (shared, split):
        cache.begin_step()
        cache.step(0, [0])
        cache.step(1, [0])
        cache.begin_step()
        cache.step(0, [1, 2])
    assert shared.held == [{1, 2}, set()]  # layer 0's 1 and 2 took both places: each layer's 0 was older
    assert split.held == [{1}, {0}]  # layer 0's one place went to 1; 2 had no victim left but 1, in use


@pytest.mark.parametrize("policy", [LruCache, LfuCache, LrfuCache, AdaptiveLrfuCache])
@pytest.mark.parametrize("per_layer", [False, True])
def test_every_policy_keeps_its_capacity_and_upload_budget(policy: type[ExpertCache], per_layer: bool) -> None:
    rng = np.random.default_rng(0)
    popular = rng.permutation(16)[:6]
    steps = [[sorted(set(rng.choice(popular, 2).tolist()) | set(rng.integers(0, 16, 2).tolist()))
              for _ in range(3)] for _ in range(200)]
    cache = policy(3, 16, 4 if per_layer else 10, per_layer=per_layer, uploads_per_step=3)
    most = 0
    for layers in steps:
        cache.begin_step()
        uploaded = 0
        for il, experts in enumerate(layers):
            out = cache.step(il, experts)
            uploaded += len(out.uploads)
            assert set(out.hits) | set(out.misses) == set(experts)
            assert not set(out.hits) & set(out.misses)
            assert all(e in cache.held[il] for e in out.uploads)
            assert not {(il, e) for e in experts} & set(out.evictions)
        sizes = [len(h) for h in cache.held]
        assert max(sizes) <= 4 if per_layer else sum(sizes) <= 10
        assert uploaded <= 3
        most = max(most, uploaded)
    assert most == 3  # the budget was reached, not merely never tested


@pytest.mark.parametrize("policy", [LruCache, LfuCache, LrfuCache, AdaptiveLrfuCache])
def test_the_victim_is_the_first_held_key_of_the_least_priority(policy: type[ExpertCache]) -> None:
    """The victim search over arrays finds what min() over each held key's priority tuple and then the key itself
    finds, ties included (LRU's experts last used in the same step: the lower layer, then the lower expert)."""
    rng = np.random.default_rng(1)
    cache = policy(4, 16, 24, uploads_per_step=None)
    checked = 0
    for _ in range(60):
        cache.begin_step()
        for il in range(4):
            experts = sorted(set(rng.integers(0, 16, 3).tolist()))
            keys = [(layer, e) for layer in range(4) for e in cache.held[layer]
                    if not (layer == il and e in experts)]
            if keys:
                columns = cache._priorities()
                want = min(keys, key=lambda k: (*(column[k] for column in columns), k))
                assert cache._victim(il, experts) == want
                checked += 1
            cache.step(il, experts)
    assert checked > 100


def stable_then_one_offs(n_steps: int) -> RoutingTrace:
    """One layer: expert 0 every fourth step, between them a new expert each time (1, 2, 3, ...)."""
    return one_layer(*[0 if s % 4 == 0 else s for s in range(n_steps)])


def rotating(n_steps: int, period: int = 40) -> RoutingTrace:
    """One layer: steps alternate between two experts of a pair that changes every `period` steps."""
    return one_layer(*[2 * (s // period) + s % 2 for s in range(n_steps)])


def test_adaptive_lrfu_takes_a_long_half_life_where_hot_experts_stay_hot() -> None:
    # capacity 1: only frequency keeps 0 against the one-offs (with a half-life of 2 steps, 0's score falls under
    # a new expert's 1 a step after its use); LRU keeps none of it
    trace = stable_then_one_offs(400)
    cache = AdaptiveLrfuCache(1, 400, capacity=1)
    stats = replay(trace, cache, measure_from=200)
    assert cache.half_life >= 8 and stats.hits == 50
    assert replay(trace, LrfuCache(1, 400, capacity=1, half_life=2.0), measure_from=200).hits == 0
    assert replay(trace, LruCache(1, 400, capacity=1), measure_from=200).hits == 0


def test_adaptive_lrfu_takes_a_short_half_life_where_routing_moves() -> None:
    # capacity 2: the current pair fits; a long memory keeps the old pairs' experts and admits the new pair late
    trace = rotating(400)
    cache = AdaptiveLrfuCache(1, 64, capacity=2)
    stats = replay(trace, cache, measure_from=200)
    lru = replay(trace, LruCache(1, 64, capacity=2), measure_from=200)
    frequency = replay(trace, LrfuCache(1, 64, capacity=2, half_life=1024.0), measure_from=200)
    assert cache.half_life <= 8
    assert stats.hits >= lru.hits > frequency.hits


def test_adaptive_lrfu_starts_with_its_prior_and_keeps_it_where_it_is_best() -> None:
    # the prior holds 0 from the first step (loaded, not uploaded); no one-off outscores it, so nothing moves
    trace = stable_then_one_offs(400)
    cache = AdaptiveLrfuCache(1, 400, capacity=1, prior=[(0, 0)])
    assert cache.held == [{0}] and cache.following_prior and cache.half_life == float("inf")
    stats = replay(trace, cache)
    assert (stats.hits, stats.uploads) == (100, 0) and cache.following_prior
    assert replay(trace, AdaptiveLrfuCache(1, 400, capacity=1)).hits < 100  # without: it learns 0 by missing it


def test_adaptive_lrfu_leaves_a_prior_that_routing_has_left() -> None:
    # the prior is the first pair of experts; from step 40 on the pairs move and a short half-life takes over
    trace = rotating(400)
    cache = AdaptiveLrfuCache(1, 64, capacity=2, prior=[(0, 0), (0, 1)])
    stats = replay(trace, cache, measure_from=200)
    assert not cache.following_prior and cache.half_life <= 8
    assert stats.hits >= replay(trace, LruCache(1, 64, capacity=2), measure_from=200).hits


def test_a_switch_needs_a_shadow_clearly_ahead() -> None:
    # merits within switch_z standard deviations of the followed shadow's leave the choice alone
    cache = AdaptiveLrfuCache(1, 8, capacity=1, half_lives=(1.0, 2.0), switch_z=1.0)
    cache.chosen, cache.merit[:] = 0, [100.0, 110.0, 0.0]  # 10 < sqrt(210): noise
    cache.begin_step()
    assert cache.chosen == 0
    cache.merit[:] = [100.0, 130.0, 0.0]  # 30 > sqrt(230)
    cache.begin_step()
    assert cache.chosen == 1


def test_pace_sets_each_steps_budget_from_its_misses() -> None:
    seen = []

    def pace(counts: StepCounts) -> float:
        seen.append(counts)
        return sum(m for _, m in counts.layers)  # room to upload every miss

    stats = replay(one_layer(0, 1, 0, 1), LruCache(1, 8, capacity=2, uploads_per_step=0), pace=pace)
    assert [c.layers for c in seen] == [((0, 1),), ((0, 1),), ((1, 0),), ((1, 0),)]  # as each step began
    assert (stats.hits, stats.uploads) == (2, 2)


def test_static_placement_learned_on_one_half_measured_on_the_other() -> None:
    trace = one_layer(0, 0, 1, 0, 2, 2, 2, 1)
    first = most_frequent(trace, 1, range(4))
    oracle = most_frequent(trace, 1, range(4, 8))
    assert (first, oracle) == ([(0, 0)], [(0, 2)])
    assert replay(trace, StaticCache(1, 8, first), measure_from=4).hits == 0
    measured = replay(trace, StaticCache(1, 8, oracle), measure_from=4)
    assert (measured.hits, measured.misses, measured.uploads, len(measured.steps)) == (3, 1, 0, 4)


def test_most_frequent_per_layer_takes_each_layers_top() -> None:
    trace = trace_of([[[0], [3]], [[0], [4]], [[1], [4]]])
    assert most_frequent(trace, 1, per_layer=True) == [(0, 0), (1, 4)]
    assert most_frequent(trace, 2) == [(0, 0), (1, 4)]


def test_replay_counts_only_the_measured_steps() -> None:
    stats = replay(one_layer(0, 0, 0, 1), LruCache(1, 8, capacity=1), measure_from=2)
    assert (stats.hits, stats.misses, stats.uploads) == (1, 1, 1)
    assert stats.steps == [StepCounts(2, 1, ((1, 0),), 0), StepCounts(3, 1, ((0, 1),), 1)]
    assert stats.hit_rate == 0.5 and stats.most_uploads_in_a_step == 1


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="half_life must be positive"):
        LrfuCache(1, 8, 1, half_life=0)
    with pytest.raises(ValueError, match="capacity -1"):
        LruCache(1, 8, -1)
    with pytest.raises(ValueError, match="positive window"):
        AdaptiveLrfuCache(1, 8, 1, window=0)
    with pytest.raises(ValueError, match="a prior of 2 experts does not fit a capacity of 1"):
        AdaptiveLrfuCache(1, 8, 1, prior=[(0, 1), (0, 2)])
