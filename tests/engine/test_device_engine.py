"""The device backend's forward pass (engine_cffi/device_engine.py) on the host device, against the CPU engine.

On the host device the products are the CPU engine's own, so the backend differs from the engine only where the
host device's other kernels (C ports of the reference kernels: norms, RoPE, attention and SwiGLU in double) round
differently. With F32 and F16 weights, whose products take f32 activations, that is logits within `KV_TOLERANCE`
of their largest magnitude and the same greedy tokens. Quantised weights quantise the activations too, which turns
a last-bit difference into a quantisation step now and then (backend_check prints how far that goes); they are
tested where the bits must be equal: hits (experts computed on the device from the cache's slots) and misses
(computed by the CPU from the mapped file) give the same bits, so every split of the experts gives the same
logits. And the expert cache counts what the simulator counts on the routing the backend recorded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from strata.engine_cffi import BatchItem, Engine, EngineAborted, EngineError
from strata.engine_cffi.device import Device
from strata.engine_cffi.device_engine import DeviceEngine, open_device
from strata.engine_cffi.expert_slots import UPLOADS_PER_STEP
from strata.experts.simulate import AdaptiveLrfuCache, replay
from strata.experts.trace import RoutingTrace, TraceInfo, read_trace
from strata.modelgen import write_random_model

# A k or v value one rounding apart before the cache may land on the other side of the cache type's rounding: f32
# keeps the last bits' difference; f16 moves by one step of 2^-11; int8 by one of its row's 127 steps.
KV_TOLERANCE = {"f32": 1e-5, "f16": 1e-4, "int8": 1e-2}
SHAPE = dict(n_ctx=64, threads=2, n_batch=8, n_seq=3)
# a 20-token prompt in chunks of 8 beside another sequence's 3 tokens, then decode steps of every sequence
CALLS = [[BatchItem(0, list(range(40, 60)), logits="all"), BatchItem(1, [5, 6, 7])],
         [BatchItem(0, [9]), BatchItem(1, [11]), BatchItem(2, [70, 71], logits="all")],
         [BatchItem(0, [90]), BatchItem(1, [12]), BatchItem(2, [13])],
         [BatchItem(2, [14]), BatchItem(0, [91])]]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("device-models")
    return {dtype: write_random_model(out / f"{dtype}.gguf", arch="qwen3moe", size="tiny", dtype=dtype,
                                      vocab="bytes", seed=3)
            for dtype in ("f32", "f16", "q8_0", "q4_k")}


def run(engine: Engine, calls: list[list[BatchItem]] = CALLS) -> list[np.ndarray]:
    return [rows.copy() for call in calls for rows in engine.eval_batch(call)]


def on_device(path: Path, kv: str = "f32", **options) -> DeviceEngine:
    return DeviceEngine.open(path, Device("host"), kv=kv, **SHAPE, **options)


@pytest.mark.parametrize("dtype,kv", [("f32", "f32"), ("f16", "f16"), ("f32", "int8")])
def test_prompt_chunks_and_decode_of_several_sequences_match_the_cpu_engine(models, dtype, kv):
    with Engine.load(models[dtype], kv=kv, mapped_weights=True, **SHAPE) as cpu:
        want = run(cpu)
    with on_device(models[dtype], kv, capacity=6) as dev:
        got = run(dev)
        counts = dev.expert_counts()
        assert [dev.seq_n_past(s) for s in range(3)] == [23, 5, 4]
    assert counts["hits"] > 0 and counts["misses"] > 0 and counts["uploads"] > 0  # both sides of the split ran
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert np.max(np.abs(g - w)) <= KV_TOLERANCE[kv] * np.max(np.abs(w))
        np.testing.assert_array_equal(g.argmax(axis=-1), w.argmax(axis=-1))


def check_hits_and_misses_give_the_same_bits(open_on_device: Any, path: Path, layers: int) -> None:
    """All misses, a mixed split, and every one of the model's 16 experts (over `layers` layers) held from the
    start, layer by layer and resident (the whole step queued at once, the experts grouped and computed on the
    device), give the same logits. The budgets are as given, not paced by how long the misses took: the counts do
    not depend on timing. Held from the start, every expert of a layer-step is a hit, with no upload."""
    results, counts = [], []
    for capacity, uploads, resident in ((0, None, None), (5, 2.0, None), (16, None, False), (16, None, None)):
        with open_on_device(path, capacity=capacity, uploads_per_step=uploads, paced=False, resident=resident) as dev:
            assert dev.resident == (capacity == 16 and resident is None)
            results.append(run(dev))
            counts.append(dev.expert_counts())
    assert counts[0]["hits"] == 0 and counts[1]["hits"] > 0 and counts[1]["misses"] > 0
    assert counts[2] == counts[3] and counts[3]["hits"] > 0, f"every expert of the {layers} layers held"
    assert (counts[3]["misses"], counts[3]["uploads"], counts[3]["preloaded"]) == (0, 0, 16)
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            np.testing.assert_array_equal(a, b)


def check_a_resident_step_reads_its_routing_back_once(open_on_device: Any, path: Path) -> None:
    """A resident step records the routing the layer-by-layer path records, bit for bit, and counts the same hits;
    it queues its whole pass in one list up to the output (a few where memsets split it) with no synchronisation
    before the step's end, where the layer-by-layer path reads each layer's routing back."""
    traces, calls, syncs = {}, {}, {}
    for resident in (False, True):
        trace = path.with_suffix(f".{resident}.trace")
        with open_on_device(path, record_routing=trace, resident=resident) as dev:
            run(dev, CALLS[:2])
            device = dev.device
            device.check(device.lib.strata_dev_journal(device.handle, 4096))
            counting = device.lib = CountingLibrary(device.lib)
            run(dev, CALLS[2:])
            journal = np.empty((4096, 3), np.int32)
            n = device.lib.strata_dev_journal_take(device.handle, device.ffi.from_buffer("int[]", journal), 4096)
            assert n >= 0
            syncs[resident] = int(np.count_nonzero(journal[:n, 0] == 3))  # the stream synchronisations, in C too
            calls[resident], n_layer, memsets = counting.calls, dev.n_layer, dev.hybrid * dev.n_kv_layer
        traces[resident] = read_trace(trace)
    a, b = traces[False], traces[True]
    assert a.n_steps == b.n_steps == 6 and len(a.records) == len(b.records) == 6 * n_layer
    for x, y in zip(a.records, b.records, strict=True):
        assert (x.step, x.layer) == (y.step, y.layer)
        np.testing.assert_array_equal(x.experts, y.experts)
    steps = len(CALLS[2:])  # one chunk each
    assert syncs[False] >= steps * n_layer  # a read-back a layer, inside the pass's one call
    assert calls[False]["strata_dev_run_pass"] == steps
    assert syncs[True] == steps  # the step's end: logits and routing with it
    assert calls[True]["strata_dev_launch_list"] == steps * (2 + memsets)  # the pass (split by memsets), output
    assert "strata_dev_run_pass" not in calls[True]


def test_a_resident_step_reads_its_routing_back_once(models, tmp_path):
    path = tmp_path / "q8_0.gguf"
    path.symlink_to(models["q8_0"])
    check_a_resident_step_reads_its_routing_back_once(on_device, path)


def test_resident_needs_every_expert_held(models):
    with pytest.raises(EngineError, match="resident: the expert cache holds 15 of the model's 16 routed experts"):
        on_device(models["q8_0"], capacity=15, resident=True)


def test_hits_and_misses_give_the_same_bits(models):
    check_hits_and_misses_give_the_same_bits(on_device, models["q4_k"], layers=2)


def test_the_backend_and_the_simulator_count_the_same_hits(models, tmp_path):
    """A routing trace the backend recorded, replayed through the policy's class: the same hits, misses and
    uploads as the backend counted; and the CPU engine records the same routing."""
    with on_device(models["q8_0"], capacity=5, record_routing=tmp_path / "device.trace", paced=False) as dev:
        run(dev)
        counts = dev.expert_counts()
        n_layer, n_expert = dev.n_layer, dev.n_expert
    with Engine.load(models["q8_0"], kv="f32", mapped_weights=True, record_routing=tmp_path / "cpu.trace",
                     **SHAPE) as cpu:
        run(cpu)
    trace = read_trace(tmp_path / "device.trace")
    cpu_trace = read_trace(tmp_path / "cpu.trace")
    assert trace.n_steps == 6 and len(trace.records) == len(cpu_trace.records)
    for a, b in zip(trace.records, cpu_trace.records, strict=True):
        assert (a.step, a.layer) == (b.step, b.layer)
        np.testing.assert_array_equal(a.experts, b.experts)
    stats = replay(trace, AdaptiveLrfuCache(n_layer, n_expert, 5, uploads_per_step=UPLOADS_PER_STEP))
    assert (stats.hits, stats.misses, stats.uploads) == (counts["hits"], counts["misses"], counts["uploads"])
    assert stats.hits > 0


def test_keep_and_copy_prefix_reuse_the_device_rows(models):
    prompt = list(range(100, 112))
    with Engine.load(models["f32"], kv="f16", mapped_weights=True, **SHAPE) as cpu:
        cpu.eval(prompt)
        cpu.copy_prefix(0, 2, 7)
        cpu.keep(9, seq=0)
        want = run(cpu, [[BatchItem(0, [5]), BatchItem(2, [6, 7])]])
    with on_device(models["f32"], "f16") as dev:
        dev.eval(prompt)
        dev.copy_prefix(0, 2, 7)
        dev.keep(9, seq=0)
        assert (dev.seq_n_past(0), dev.seq_n_past(2)) == (9, 7)
        got = run(dev, [[BatchItem(0, [5]), BatchItem(2, [6, 7])]])
        with pytest.raises(EngineError, match="keep 11 of sequence 0"):
            dev.keep(11, seq=0)
    for g, w in zip(got, want, strict=True):
        assert np.max(np.abs(g - w)) <= KV_TOLERANCE["f16"] * np.max(np.abs(w))


def test_an_abort_drops_its_sequence_and_the_others_go_on(models):
    with on_device(models["f32"]) as dev:
        dev.abort(1)
        with pytest.raises(EngineAborted) as info:
            dev.eval_batch([BatchItem(0, [1, 2]), BatchItem(1, [3])])
        assert info.value.dropped == {1} and info.value.results[1] is None
        assert (dev.seq_n_past(0), dev.seq_n_past(1)) == (2, 0)
        dev.eval_batch([BatchItem(1, [3])])  # the flag was consumed
        assert dev.seq_n_past(1) == 1


def test_what_the_budget_leaves_is_the_expert_cache(models):
    with on_device(models["f32"]) as dev:
        every = dev.n_layer * dev.n_expert
        assert dev.expert_counts()["capacity"] == every and dev.resident  # the host's memory: every expert
        slot = dev.slots.slot_bytes
        dense = dev.device.used - every * slot  # the dense part and the slots' table, which any budget keeps
    with DeviceEngine.open(models["f32"], open_device("host", dense + 3 * slot + 7), **SHAPE) as dev:
        assert dev.expert_counts()["capacity"] == 3
    with pytest.raises(EngineError, match="the host device: allocating"):
        DeviceEngine.open(models["f32"], open_device("host", dense // 2), **SHAPE)


def test_other_architectures_are_refused(tmp_path):
    path = write_random_model(tmp_path / "dense.gguf", arch="qwen3", size="tiny", dtype="f32", vocab="bytes")
    with pytest.raises(EngineError, match="the host device runs qwen3moe, qwen35moe models, not qwen3"):
        DeviceEngine.open(path, Device("host"), **SHAPE)


@pytest.mark.parametrize("kv", ["f16", "int8"])
def test_exported_rows_continue_a_sequence_elsewhere(models, kv):
    """export_kv in the CPU engine's layout, imported into another sequence of another engine on the device: the
    next token's logits are the original's bits."""
    prompt = list(range(30, 49))
    with on_device(models["q8_0"], kv) as dev, on_device(models["q8_0"], kv) as other:
        dev.eval(prompt)
        data = dev.export_kv(0, 0, 12)
        assert data.nbytes == 12 * dev.kv_position_bytes
        other.import_kv(2, 0, data)
        other.import_kv(2, 12, dev.export_kv(0, 12, 7))
        assert other.seq_n_past(2) == 19
        want = dev.eval([7])
        np.testing.assert_array_equal(other.eval([7], seq=2), want)
        with pytest.raises(EngineError, match="continues at 20"):
            other.import_kv(2, 3, data)
        with pytest.raises(EngineError, match="sequence 0 holds 20"):
            dev.export_kv(0, 10, 11)
    with Engine.load(models["q8_0"], kv=kv, mapped_weights=True, **SHAPE) as cpu:
        assert cpu.kv_position_bytes == dev.kv_position_bytes and cpu.kv_identity + ":host" == dev.kv_identity


def test_a_prior_recorded_on_another_shape_is_refused(models):
    other = RoutingTrace(TraceInfo("other", "qwen3moe", 2, 64, 2), [])
    with pytest.raises(EngineError, match="recorded on a qwen3moe model of 2 layers of 64 experts"):
        on_device(models["f32"], prior=other)


class CountingLibrary:
    """The device's library with each function's calls counted."""

    def __init__(self, lib) -> None:
        self._lib, self.calls = lib, {}

    def __getattr__(self, name: str):
        function = getattr(self._lib, name)

        def counted(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return function(*args)
        return counted


def test_a_step_queues_its_trunk_in_one_call(models):
    """No launch one by one in a step: the trunk's layers in one call (per layer its list up to the top-k, its
    experts: the read-back, the grouping, the policy's step, the hits, the misses and their rows; its mix); then
    the output's list."""
    with on_device(models["q8_0"], capacity=5, paced=False) as dev:
        run(dev, CALLS[:2])
        before = dev.expert_counts()
        counting = dev.device.lib = CountingLibrary(dev.device.lib)
        dev.eval_batch([BatchItem(0, [92]), BatchItem(1, [13]), BatchItem(2, [15])])
        after = dev.expert_counts()
    calls, layers = counting.calls, dev.n_layer
    assert after["hits"] > before["hits"] and after["misses"] > before["misses"]  # the step had both
    assert calls["strata_dev_run_pass"] == 1 and calls["strata_dev_launch_list"] == 1  # the trunk, the output
    one_by_one = {"strata_dev_launch", "strata_dev_moe_layer", "strata_host_group_slots", "strata_expert_slots_step",
                  "strata_dev_launch_experts", "strata_host_layer_misses", "strata_dev_upload_rows"}
    assert not one_by_one & set(calls)  # each of these is the pass's
    assert layers > 1


def test_uploads_are_paced_by_the_link_rate_it_measured(models):
    with on_device(models["q8_0"], capacity=5) as dev:
        run(dev)
        assert dev.slots.link_rate is not None and dev.slots.link_rate > 0
        assert dev.slots.policy.uploads_per_step != UPLOADS_PER_STEP  # the misses' time set it
    with on_device(models["q8_0"], capacity=5, paced=False) as dev:
        run(dev)
        assert dev.slots.link_rate is None and dev.slots.policy.uploads_per_step == UPLOADS_PER_STEP


def test_the_cpu_engines_context_holds_no_kv_cache_beside_the_devices(models):
    """The backend keeps its KV cache on the device: the CPU engine's context under it holds one sequence of one
    position, so a long context costs host memory once, not twice."""
    from strata.engine_cffi import lib

    with on_device(models["f16"], "f16") as dev:
        assert dev.n_ctx == SHAPE["n_ctx"] and dev.n_batch == SHAPE["n_batch"] and dev.n_seq == SHAPE["n_seq"]
        assert lib.strata_n_seq(dev._ctx) == 1 and lib.strata_kv_bytes(dev._ctx) == dev.kv_position_bytes
        assert dev.kv_bytes == dev.kv_position_bytes * dev.n_seq * dev.n_ctx
    with pytest.raises(EngineError, match="context of 100000 positions is larger than the model's"):
        DeviceEngine.open(models["f16"], Device("host"), n_ctx=100000)
