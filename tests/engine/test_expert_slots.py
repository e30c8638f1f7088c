"""The expert cache's slots (engine_cffi/expert_slots.py) on the host device: a routing trace replayed through them
counts what the simulator's `replay` counts, and every expert the policy holds is in device memory, its own bytes in
its slot, through evictions and reused slots."""

from __future__ import annotations

import numpy as np
import pytest

from strata.engine_cffi.device import Device, DeviceError, interface
from strata.engine_cffi.expert_slots import MIN_UPLOADS_PER_STEP, ExpertSlots
from strata.experts.simulate import AdaptiveLrfuCache, most_frequent, replay
from strata.experts.trace import LayerStep, RoutingTrace, TraceInfo

N_LAYER, N_EXPERT, K = 3, 10, 2
SIZES = [(48, 48, 32), (16, 16, 16), (64, 32, 32)]  # per layer: a model may mix types from layer to layer


def expert_bytes(layer: int, expert: int, which: int) -> np.ndarray:
    """Bytes no other (layer, expert, matrix) has."""
    return np.full(SIZES[layer][which], layer * 64 + expert * 4 + which, np.uint8)


# each layer's matrices as a file holds them, every expert's one after another, and where they lie for the device
HOST = [[np.concatenate([expert_bytes(layer, e, which) for e in range(N_EXPERT)]) for which in range(3)]
        for layer in range(N_LAYER)]
_ffi = interface()[0]
LAYERS = [_ffi.new("strata_host_layer_experts *", dict(
    gate=_ffi.from_buffer(gate), up=_ffi.from_buffer(up), down=_ffi.from_buffer(down), gate_bytes=SIZES[layer][0],
    up_bytes=SIZES[layer][1], down_bytes=SIZES[layer][2])) for layer, (gate, up, down) in enumerate(HOST)]


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
        slots = ExpertSlots(dev, N_LAYER, N_EXPERT, 7, SIZES, LAYERS, dev.stream(), uploads_per_step=2.0)
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
                # the table a layer's hits are launched from: each held expert's slot, 0 for the others
                addresses = [int(dev.ffi.cast("uintptr_t", slots.matrices(layer, e)[0])) for e in sorted(held)]
                assert slots.slots_of(layer, sorted(held)).tolist() == addresses
                assert not slots.slots_of(layer, sorted(set(range(N_EXPERT)) - held)).any()
        assert dev.used == 7 * max(map(sum, SIZES))  # evicted experts' slots were reused, never more than capacity
    stats = replay(trace, AdaptiveLrfuCache(N_LAYER, N_EXPERT, 7, uploads_per_step=2.0))
    assert (slots.counts.hits, slots.counts.misses, slots.counts.uploads) == (stats.hits, stats.misses, stats.uploads)
    assert stats.hits > 0 and stats.evictions > 0


JOURNAL = {1: "record", 2: "wait", 3: "sync"}


def journal(dev: Device) -> list[tuple]:
    """The device's ordering calls since the last look (its journal): ("record", stream, event), ("wait", stream,
    event), ("sync", stream)."""
    out = np.empty((1024, 3), np.int32)
    n = dev.lib.strata_dev_journal_take(dev.handle, dev.ffi.from_buffer("int[]", out), len(out))
    assert n >= 0, "the journal lost entries"
    return [(JOURNAL[what], stream, event)[:2 if what == 3 else 3] for what, stream, event in out[:n].tolist()]


def test_a_hit_waits_on_the_device_for_its_upload_and_the_host_never_waits():
    """An upload is read a step later at the earliest: the compute stream waits on one event, re-recorded each
    step, just before the first hit of an expert whose upload it marks; the host never waits for the link, and a
    step that reads no such expert makes the compute stream wait for nothing."""
    trace = skewed_trace(60, seed=3)
    with Device("host") as dev:
        dev.check(dev.lib.strata_dev_journal(dev.handle, 1024))
        upload_stream = dev.stream()
        slots = ExpertSlots(dev, N_LAYER, N_EXPERT, 7, SIZES, LAYERS, upload_stream, uploads_per_step=2.0,
                            prior=most_frequent(trace, 3))
        log = [("uploaded", key) for key in most_frequent(trace, 3)]
        for records in trace.steps():
            slots.begin_step()
            log += journal(dev)
            for record in records:
                outcome = slots.step(record.layer, record.used().tolist())
                log += journal(dev)
                log += [("hit", (record.layer, e)) for e in outcome.hits]
                log += [("uploaded", (record.layer, e)) for e in outcome.uploads]
                log.append(("layer-step",))
    assert ("sync", upload_stream) not in log
    events = {entry[2] for entry in log if entry[0] in ("record", "wait")}
    assert len(events) == 1  # one event for every step
    queued, marked, waits, useful = set(), set(), 0, 0
    for entry in log:
        if entry[0] == "uploaded":
            queued.add(entry[1])
        elif entry[0] == "record":
            assert entry[1] == upload_stream
            marked |= queued
            queued = set()
        elif entry[0] == "wait":
            assert entry[1] == 0 and marked
            waits, marked = waits + 1, set()
        elif entry[0] == "hit":
            assert entry[1] not in queued and entry[1] not in marked  # never read before its upload is waited for
    for i, entry in enumerate(log):  # each wait is for a hit of the same layer-step
        if entry[0] == "wait":
            rest = log[i + 1:]
            useful += any(e[0] == "hit" for e in rest[:rest.index(("layer-step",))])
    assert waits == useful > 0
    assert waits < sum(entry[0] == "record" for entry in log)  # some steps read no arriving expert


def test_paced_budget_follows_the_misses_time_as_the_simulators_pace():
    """Each step may start as many uploads as the link moves in the time the last step's misses took: the same
    budgets given to the simulator's `pace` count the same hits, misses and uploads."""
    trace, slot = skewed_trace(60, seed=1), max(map(sum, SIZES))
    link_rate = 2.0 * slot  # bytes a second: two uploads in a second of misses

    def miss_seconds(step: int) -> float:
        return (0.25, 1.0, 3.0, 0.0)[step % 4]

    budgets, took = [], []
    with Device("host") as dev:
        slots = ExpertSlots(dev, N_LAYER, N_EXPERT, 7, SIZES, LAYERS, dev.stream(), uploads_per_step=2.0,
                            link_rate=link_rate)
        for records in trace.steps():
            slots.begin_step()
            budgets.append(slots.policy.uploads_per_step)
            took.append(0.0)
            for record in records:
                outcome = slots.step(record.layer, record.used().tolist())
                if outcome.misses:
                    slots.misses_took(miss_seconds(record.step) / N_LAYER)
                    took[-1] += miss_seconds(record.step) / N_LAYER
    assert budgets[0] == 2.0 and took[0] > 0
    assert budgets[1:] == pytest.approx([max(MIN_UPLOADS_PER_STEP, 2.0 * t) for t in took[:-1]])
    assert min(budgets) == MIN_UPLOADS_PER_STEP and max(budgets) > 2.0
    paced = iter(budgets)
    stats = replay(trace, AdaptiveLrfuCache(N_LAYER, N_EXPERT, 7, uploads_per_step=2.0), pace=lambda _: next(paced))
    assert (slots.counts.hits, slots.counts.misses, slots.counts.uploads) == (stats.hits, stats.misses, stats.uploads)
    fixed = replay(trace, AdaptiveLrfuCache(N_LAYER, N_EXPERT, 7, uploads_per_step=2.0))
    assert stats.uploads != fixed.uploads  # the pace changed what was uploaded


def test_a_prior_is_held_from_the_start():
    trace = skewed_trace(40, seed=2)
    prior = most_frequent(trace, 5)
    with Device("host") as dev:
        slots = ExpertSlots(dev, N_LAYER, N_EXPERT, 7, SIZES, LAYERS, dev.stream(), prior=prior)
        dev.sync(1)
        assert slots.counts.preloaded == 5 and slots.counts.uploads == 0
        for layer, e in prior:
            for which, ptr in enumerate(slots.matrices(layer, e)):
                np.testing.assert_array_equal(dev.to_host(ptr, (SIZES[layer][which],), np.uint8),
                                              expert_bytes(layer, e, which))
        first = trace.records[:N_LAYER]
        slots.begin_step()
        hits = sum(len(slots.step(r.layer, r.used().tolist()).hits) for r in first)
    held = set(prior)
    assert hits == sum(len({(r.layer, int(e)) for e in r.used()} & held) for r in first) > 0


def test_a_step_outside_the_model_is_refused_with_its_layer_named():
    with Device("host") as dev:
        slots = ExpertSlots(dev, N_LAYER, N_EXPERT, 7, SIZES, LAYERS, dev.stream())
        slots.begin_step()
        with pytest.raises(DeviceError, match=f"layer {N_LAYER} of {N_LAYER}"):
            slots.step(N_LAYER, [0])
        with pytest.raises(DeviceError, match=f"1 experts of {N_EXPERT}"):
            slots.step(0, [N_EXPERT])
        assert slots.step(0, [1]).misses == (1,)  # still usable
