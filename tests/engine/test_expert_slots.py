"""The expert cache's slots (engine_cffi/expert_slots.py) on the host device: a routing trace replayed through them
counts what the simulator's `replay` counts, and every expert the policy holds is in device memory, its own bytes in
its slot, through evictions and reused slots."""

from __future__ import annotations

import numpy as np

from strata.engine_cffi.device import Device
from strata.engine_cffi.expert_slots import ExpertSlots
from strata.experts.simulate import AdaptiveLrfuCache, replay
from strata.experts.trace import LayerStep, RoutingTrace, TraceInfo

N_LAYER, N_EXPERT, K = 3, 10, 2
SIZES = [(48, 48, 32), (16, 16, 16), (64, 32, 32)]  # per layer: a model may mix types from layer to layer


def expert_bytes(layer: int, expert: int, which: int) -> np.ndarray:
    """Bytes no other (layer, expert, matrix) has."""
    return np.full(SIZES[layer][which], layer * 64 + expert * 4 + which, np.uint8)


def skewed_trace(n_steps: int, seed: int = 0) -> RoutingTrace:
    """Each step's tokens pick their experts from a distribution that favours a few and drifts halfway."""
    rng = np.random.default_rng(seed)
    records = []
    for step in range(n_steps):
        p = np.roll(np.geomspace(1, 0.05, N_EXPERT), 3 * (step >= n_steps // 2))
        for layer in range(N_LAYER):
            ids = np.stack([rng.choice(N_EXPERT, K, replace=False, p=p / p.sum()) for _ in range(rng.integers(1, 4))])
            records.append(LayerStep(step, layer, ids.astype(np.int32)))
    return RoutingTrace(TraceInfo("synthetic", "qwen3moe", N_LAYER, N_EXPERT, K), records)


def test_slots_count_as_the_simulator_and_hold_each_experts_bytes():
    trace = skewed_trace(60)
    with Device("host") as dev:
        slots = ExpertSlots(dev, N_LAYER, N_EXPERT, 7, SIZES, expert_bytes, dev.stream(), uploads_per_step=2.0)
        for records in trace.steps():
            slots.begin_step()
            for record in records:
                slots.step(record.layer, record.used().tolist())
            dev.sync(1)
            for layer, held in enumerate(slots.policy.held):
                for e in held:
                    for which, ptr in enumerate(slots.matrices(layer, e)):
                        got = dev.to_host(ptr, (SIZES[layer][which],), np.uint8)
                        np.testing.assert_array_equal(got, expert_bytes(layer, e, which))
        assert dev.used == 7 * max(map(sum, SIZES))  # evicted experts' slots were reused, never more than capacity
    stats = replay(trace, AdaptiveLrfuCache(N_LAYER, N_EXPERT, 7, uploads_per_step=2.0))
    assert (slots.counts.hits, slots.counts.misses, slots.counts.uploads) == (stats.hits, stats.misses, stats.uploads)
    assert stats.hits > 0 and stats.evictions > 0
