"""The expert cache's policy in C (engine_cffi/expert_policy.c) makes the reference's decisions: every step of a
routing replayed through `ExpertPolicy` and `strata.experts.simulate.AdaptiveLrfuCache` has the same hits, misses,
uploads (in order) and evictions, the same shadow followed and the same experts held."""

from __future__ import annotations

import numpy as np
import pytest

from strata.engine_cffi.expert_policy import ExpertPolicy
from strata.experts.simulate import AdaptiveLrfuCache


def drifting_steps(n_layer: int, n_expert: int, steps: int, tokens: int, seed: int) -> list[list[list[int]]]:
    """Per step, per layer, the experts of up to `tokens` tokens (4 each, repeats between tokens, some layers
    none), from a skewed distribution whose favourites move every 30 steps."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(steps):
        p = np.roll(np.geomspace(1, 0.05, n_expert), 3 * (step // 30))
        out.append([rng.choice(n_expert, (int(rng.integers(0, tokens + 1)), min(4, n_expert)), p=p / p.sum())
                    .reshape(-1).tolist() for _ in range(n_layer)])
    return out


@pytest.mark.parametrize("n_layer,n_expert,capacity,budget,prior,window,tokens", [
    (4, 16, 10, 2.0, 0, 256.0, 3),  # the followed shadow changes; evictions every step
    (4, 16, 10, None, 5, 16.0, 3),  # no upload bound, a prior followed, then left
    (6, 32, 40, 0.5, 20, 8.0, 2),  # a fractional budget accrues over steps
    (3, 8, 24, 3.0, 8, 4.0, 5),  # every expert fits
    (2, 64, 50, 100.0, 10, 32.0, 8),  # many uploads a layer-step, prompt-sized steps
    (3, 128, 200, 12.0, 40, 64.0, 4),  # layers far longer than the lists of their least-priority experts
])
def test_every_step_decides_as_the_reference(n_layer, n_expert, capacity, budget, prior, window, tokens):
    rng = np.random.default_rng(n_layer * n_expert)
    keys = rng.choice(n_layer * n_expert, prior, replace=False).tolist()
    placement = [(k // n_expert, k % n_expert) for k in keys]
    ref = AdaptiveLrfuCache(n_layer, n_expert, capacity, uploads_per_step=budget, prior=placement, window=window)
    native = ExpertPolicy(n_layer, n_expert, capacity, uploads_per_step=budget, prior=placement, window=window)
    assert native.held == ref.held and native.following_prior == ref.following_prior
    chosen, evictions = {native.chosen}, 0
    for step, layers in enumerate(drifting_steps(n_layer, n_expert, 300, tokens, seed=n_expert)):
        if budget is not None and step % 7 == 0:  # a budget paced step by step, as the slots set it
            ref.uploads_per_step = native.uploads_per_step = budget * (0.5 + step % 3)
        ref.begin_step()
        native.begin_step()
        for layer, experts in enumerate(layers):
            want = ref.step(layer, experts)
            assert native.step(layer, experts) == want, (step, layer)
            evictions += len(want.evictions)
        assert native.chosen == ref.chosen
        chosen.add(native.chosen)
    assert native.held == ref.held and native.size() == ref.size() <= capacity
    assert len(chosen) > 1 or capacity >= n_layer * n_expert  # the cases switch shadows where anything evicts
    assert evictions > 0 or capacity >= n_layer * n_expert


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="does not fit"):
        ExpertPolicy(2, 4, 1, prior=[(0, 1), (1, 2)])
    with pytest.raises(ValueError, match="no expert policy"):
        ExpertPolicy(2, 4, 3, window=0.0)
    with pytest.raises(ValueError, match="no expert policy"):
        ExpertPolicy(2, 4, 3, prior=[(2, 0)])  # outside the model
    policy = ExpertPolicy(2, 4, 3)
    policy.begin_step()
    with pytest.raises(ValueError, match="layer 2 of 2"):
        policy.step(2, [0])
    with pytest.raises(ValueError, match="of 4"):
        policy.step(0, [4])
    assert policy.step(0, [1, 1, 0]).misses == (0, 1)  # repeats count once, in order
