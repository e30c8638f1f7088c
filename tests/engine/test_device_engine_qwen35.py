"""The device backend on a Qwen3.5 MoE model (`qwen35moe`: Gated DeltaNet layers between gated attention ones,
partial multi-axis RoPE, a gated shared expert) on the host device, against the CPU engine.

As for qwen3moe (test_device_engine.py): with F32 and F16 weights the logits are within the KV cache type's
tolerance of the CPU engine's and the greedy tokens are the same; the recurrent state after the calls is the CPU
engine's within the same tolerance; hits and misses give the same bits. Then the recurrent state's rules, the CPU
engine's: saved and loaded it resumes a sequence bit for bit, a cut leaves it invalid until a load, a whole
prefix copied takes it along; and a picture's rows, placed by their grid, with the positions' RoPE components
exported and imported beside the KV rows.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_rewrite import rewrite
from test_device_engine import (
    KV_TOLERANCE,
    SHAPE,
    CountingLibrary,
    check_a_resident_step_reads_its_routing_back_once,
    check_hits_and_misses_give_the_same_bits,
    run,
)

from strata.engine_cffi import BatchItem, Engine, EngineError, PictureRows
from strata.engine_cffi.device import Device, DeviceError
from strata.engine_cffi.device_engine import DeviceEngine
from strata.modelgen import write_random_model


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Four layers (Gated DeltaNet, attention, Gated DeltaNet, attention: each kind's layers have their places in
    the KV cache and the state), 4 experts of which 2 a token, and an MTP block."""
    out = tmp_path_factory.mktemp("device-qwen35")
    return {dtype: write_random_model(out / f"{dtype}.gguf", arch="qwen35moe", size="tiny", dtype=dtype,
                                      vocab="bytes", seed=3, full_attention_interval=2)
            for dtype in ("f32", "f16", "q4_k")}


def on_device(path: Path, kv: str = "f32", **options) -> DeviceEngine:
    return DeviceEngine.open(path, Device("host"), kv=kv, **SHAPE, **options)


def states(engine: Engine) -> np.ndarray:
    return np.stack([np.frombuffer(engine.save_state(s), np.float32) for s in range(engine.n_seq)])


@pytest.mark.parametrize("dtype,kv", [("f32", "f32"), ("f16", "f16"), ("f32", "int8")])
def test_prompt_chunks_and_decode_of_several_sequences_match_the_cpu_engine(models, dtype, kv):
    with Engine.load(models[dtype], kv=kv, mapped_weights=True, **SHAPE) as cpu:
        want, want_states = run(cpu), states(cpu)
    with on_device(models[dtype], kv, capacity=6) as dev:
        got, got_states = run(dev), states(dev)
        counts = dev.expert_counts()
        assert [dev.seq_n_past(s) for s in range(3)] == [23, 5, 4]
        assert (dev.n_layer, dev.n_kv_layer, dev.has_mtp, dev.mtp) == (4, 2, True, False)  # the MTP block not run
    assert counts["hits"] > 0 and counts["misses"] > 0 and counts["uploads"] > 0
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert np.max(np.abs(g - w)) <= KV_TOLERANCE[kv] * np.max(np.abs(w))
        np.testing.assert_array_equal(g.argmax(axis=-1), w.argmax(axis=-1))
    assert np.max(np.abs(got_states - want_states)) <= KV_TOLERANCE[kv] * np.max(np.abs(want_states))


def test_a_long_prompt_run_beside_short_ones_matches_the_cpu_engine(models):
    """Chunks of 64 whose runs take both forms of the delta rule: a prompt's runs of more than 16 tokens by the
    chunked form (delta_rule_chunked, across its 64-token chunks) beside other sequences' short runs and decode
    steps by the token loop, as the CPU engine chooses (strata_deltanet_chunked); the logits and the recurrent
    state within the f32 cache's tolerance of the CPU engine's."""
    shape = SHAPE | dict(n_ctx=160, n_batch=64)
    calls = [[BatchItem(0, list(range(40, 140)), logits="all"), BatchItem(1, [5, 6, 7])],
             [BatchItem(0, [9]), BatchItem(1, list(range(20, 60)), logits="all"), BatchItem(2, [70, 71])]]
    with Engine.load(models["f32"], kv="f32", mapped_weights=True, **shape) as cpu:
        want, want_states = run(cpu, calls), states(cpu)
    with DeviceEngine.open(models["f32"], Device("host"), kv="f32", **shape) as dev:
        got, got_states = run(dev, calls), states(dev)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert np.max(np.abs(g - w)) <= KV_TOLERANCE["f32"] * np.max(np.abs(w))
        np.testing.assert_array_equal(g.argmax(axis=-1), w.argmax(axis=-1))
    assert np.max(np.abs(got_states - want_states)) <= KV_TOLERANCE["f32"] * np.max(np.abs(want_states))


def test_each_form_of_the_delta_rule_is_launched_only_over_a_chunk_that_has_its_runs(models):
    """A decode step's runs are all the recurrent form's and a long prompt's all the chunked form's: the other
    form's launch is over no runs (n_seq 0, which the device does not launch); a chunk with both has both."""
    def runs(dev: DeviceEngine) -> dict[str, list[int]]:
        ffi, out = dev.device.ffi, {"delta_rule": [], "delta_rule_chunked": []}
        for launches in dev._layers_launches:
            for name, args in launches._items:
                if ffi.string(name).decode() in out:
                    out[ffi.string(name).decode()].append(args.n_seq)
        return out

    with DeviceEngine.open(models["f32"], Device("host"), kv="f32", capacity=6, **(SHAPE | {"n_batch": 32})) as dev:
        n_rec = sum(dev._recurrent)
        dev.eval_batch([BatchItem(0, list(range(40, 70)))])  # one run of 30 tokens: the chunked form
        assert runs(dev) == {"delta_rule": [0] * n_rec, "delta_rule_chunked": [1] * n_rec}
        dev.eval_batch([BatchItem(0, [70]), BatchItem(1, list(range(5, 35)))])  # a decode token beside a prompt
        assert runs(dev) == {"delta_rule": [2] * n_rec, "delta_rule_chunked": [2] * n_rec}
        dev.eval_batch([BatchItem(0, [71]), BatchItem(1, [35])])  # decode
        assert runs(dev) == {"delta_rule": [2] * n_rec, "delta_rule_chunked": [0] * n_rec}


def test_hits_and_misses_give_the_same_bits(models):
    check_hits_and_misses_give_the_same_bits(on_device, models["q4_k"], layers=4)


def test_a_resident_step_reads_its_routing_back_once(models, tmp_path):
    path = tmp_path / "f32.gguf"
    path.symlink_to(models["f32"])
    check_a_resident_step_reads_its_routing_back_once(on_device, path)


def test_a_saved_state_resumes_its_sequence_and_a_cut_one_is_refused(models):
    prompt = list(range(100, 120))
    with on_device(models["f32"]) as dev:
        dev.eval(prompt)
        saved, n = dev.save_state(0), dev.n_past
        assert len(saved) == dev.state_bytes > 0
        want = dev.eval([7, 8], all_logits=True)
        dev.keep(n)  # a state cannot be cut back
        with pytest.raises(EngineError, match="sequence 0's recurrent state was cut back"):
            dev.eval([7])
        with pytest.raises(EngineError, match="nothing to save"):
            dev.save_state(0)
        dev.load_state(0, saved)
        np.testing.assert_array_equal(dev.eval([7, 8], all_logits=True), want)
        with pytest.raises(EngineError, match="a state of 3 bytes"):
            dev.load_state(0, b"abc")
        # a whole prefix copied takes the state along; a shorter one leaves it invalid; keep(0) clears it
        dev.copy_prefix(0, 1, dev.n_past)
        np.testing.assert_array_equal(dev.eval([9], seq=1), dev.eval([9]))
        dev.copy_prefix(0, 2, 5)
        with pytest.raises(EngineError, match="sequence 2's recurrent state was cut back"):
            dev.eval([9], seq=2)
        dev.keep(0, seq=2)
        fresh = dev.eval(prompt[:3], seq=2)
        # rows imported come without a state: invalid until one is loaded
        dev.keep(0, seq=1)
        dev.import_kv(1, 0, dev.export_kv(2, 0, 3))
        with pytest.raises(EngineError, match="sequence 1's recurrent state was cut back"):
            dev.eval([9], seq=1)
        dev.load_state(1, dev.save_state(2))
        np.testing.assert_array_equal(dev.eval([9], seq=1), dev.eval([9], seq=2))
    with Engine.load(models["f32"], kv="f32", mapped_weights=True, **SHAPE) as cpu:  # the same layout and values
        cpu.eval(prompt)
        cpu_state = np.frombuffer(cpu.save_state(0), np.float32)
        assert np.max(np.abs(np.frombuffer(saved, np.float32) - cpu_state)) <= 1e-5 * np.max(np.abs(cpu_state))
        cleared = cpu.eval(prompt[:3], seq=2)  # from an empty sequence's state
        assert np.max(np.abs(fresh - cleared)) <= 1e-5 * np.max(np.abs(cleared))


@pytest.mark.parametrize("room", [True, False])
def test_a_checkpoint_restores_the_state_before_a_step(models, monkeypatch, room):
    """A speculative step's rollback on the device backend: a checkpoint (a copy into the sequence's spare on the
    device; where the device has no room for the spares, its bytes through the host), the step, a keep back and the
    restore give the state as it was, and the same logits after; refused where it does not hold, as the CPU
    engine's."""
    prompt = list(range(100, 120))
    with on_device(models["f32"]) as dev:
        if not room:
            def no_room(seq: int) -> None:
                raise DeviceError("no room for the spares")
            monkeypatch.setattr(dev._state, "checkpoint", no_room)
        dev.eval(prompt)
        saved, n = dev.save_state(0), dev.n_past
        want = dev.eval([7, 8], all_logits=True)
        dev.keep(n)
        dev.load_state(0, saved)
        for _ in range(2):
            dev.checkpoint_state(0)
            dev.eval([5, 6, 7, 8], all_logits=True)  # a token and its draft
            dev.keep(n)
            dev.restore_state(0)
            assert dev.save_state(0) == saved
        np.testing.assert_array_equal(dev.eval([7, 8], all_logits=True), want)
        with pytest.raises(EngineError, match="no checkpoint of its state there"):
            dev.restore_state(0)  # taken back already
        dev.checkpoint_state(0)
        dev.keep(0)  # a clear ends it
        with pytest.raises(EngineError, match="no checkpoint of its state there"):
            dev.restore_state(0)
        assert (dev._state.spare is not None) == room


def test_the_recurrent_states_are_the_devices_only(models):
    """Each slot's recurrent state lives on the device (tens of MiB a slot in a large hybrid): the CPU engine's
    context under the backend holds one sequence, whose state the backend never reads."""
    from strata.engine_cffi import lib

    with on_device(models["f32"]) as dev:
        assert dev.n_seq == SHAPE["n_seq"] > 1 and lib.strata_n_seq(dev._ctx) == 1
        assert dev.state_bytes > 0 and lib.strata_state_bytes(dev._ctx) == dev.state_bytes
        for seq in range(dev.n_seq):  # every slot evaluates and keeps its own state
            dev.eval_batch([BatchItem(seq, [seq + 1, 7, 9])])
        assert len({dev.save_state(seq) for seq in range(dev.n_seq)}) == dev.n_seq


def test_a_picture_is_placed_by_its_grid_and_its_positions_travel_with_the_rows(models):
    """A picture's 12 rows (a grid 4 wide) in a prompt: multi-axis RoPE positions from the grid, text after it
    from the picture's largest component, as on the CPU engine. Exported (KV rows and RoPE components) with the
    state and imported into another engine's sequence on the device, the next token's logits are the original's
    bits; imported into the CPU engine (the same layouts), within the tolerance of the device's."""
    rows = np.random.default_rng(5).standard_normal((12, 256)).astype(np.float32)
    ids = list(range(60, 80))
    items = [BatchItem(0, ids, embeds=[(3, PictureRows(rows, 4))], logits="all")]
    with Engine.load(models["f32"], kv="f32", mapped_weights=True, **SHAPE) as cpu:
        want = cpu.eval_batch(items)[0].copy()
        with on_device(models["f32"]) as dev, on_device(models["f32"]) as other:
            got = dev.eval_batch(items)[0].copy()
            rows_out, state = dev.export_kv(0, 0, dev.n_past), dev.save_state(0)
            other.import_kv(2, 0, rows_out)
            other.load_state(2, state)
            cpu.import_kv(1, 0, rows_out)
            cpu.load_state(1, state)
            after = dev.eval([5])
            np.testing.assert_array_equal(other.eval([5], seq=2), after)
        on_cpu = cpu.eval([5], seq=1)
    assert np.max(np.abs(got - want)) <= KV_TOLERANCE["f32"] * np.max(np.abs(want))
    assert np.max(np.abs(after - on_cpu)) <= KV_TOLERANCE["f32"] * np.max(np.abs(on_cpu))


def drafting(engine: Engine) -> list[tuple[np.ndarray, np.ndarray]]:
    """The MTP block's drafts with their logits after: a prompt in chunks beside another sequence's (with a
    picture's rows); a verify step's rollback (keep and the saved state); decode; rows and state imported into a
    new sequence (whose last hidden state is not held: no drafts), then a token evaluated; a whole prefix
    copied."""
    picture = np.random.default_rng(5).standard_normal((6, 256)).astype(np.float32)
    out = []

    def draft(seqs: list[int], pos: list[int], tokens: list[int], n: int = 3) -> None:
        drafts, logits = engine.mtp_draft(seqs, pos, tokens, n, logits=True)
        assert logits is not None
        out.append((drafts, logits))

    engine.eval_batch([BatchItem(0, list(range(40, 60))),
                       BatchItem(1, list(range(5, 15)), embeds=[(2, PictureRows(picture, 3))])])
    draft([0, 1], [20, 10], [61, 8])
    saved = engine.save_state(0)
    engine.eval_batch([BatchItem(0, [61, 62, 63]), BatchItem(1, [8])])
    engine.keep(20, 0)  # the verify step's drafts refused
    engine.load_state(0, saved)
    draft([0, 1], [20, 11], [64, 9])
    engine.eval_batch([BatchItem(0, [64, 65])])
    draft([0], [22], [66], 4)
    engine.import_kv(2, 0, engine.export_kv(1, 0, 11))
    engine.load_state(2, engine.save_state(1))
    draft([2, 1], [11, 11], [9, 9])
    engine.eval_batch([BatchItem(2, [9])])
    draft([2, 1], [12, 11], [10, 9])
    engine.keep(0, 2)
    engine.copy_prefix(0, 2, 22)
    engine.eval_batch([BatchItem(2, [30, 31])])
    draft([2, 0], [24, 22], [32, 66], 2)
    return out


@pytest.mark.parametrize("kv", ["f32", "f16"])
def test_mtp_drafts_match_the_cpu_engines(models, kv):
    """The MTP block run on the device (its rows filled at each eval) drafts the CPU engine's tokens (its rows
    filled lazily), their logits within the KV cache type's tolerance; a sequence with no hidden state held
    drafts nothing on both. (The imported sequence's drafts after its eval are left out: the block's rows of the
    imported positions are not filled, on either engine.)"""
    with Engine.load(models["f32"], kv=kv, mapped_weights=True, mtp=True, **SHAPE) as cpu:
        want = drafting(cpu)
    with on_device(models["f32"], kv, capacity=6, mtp=True) as dev:
        assert dev.mtp
        got = drafting(dev)
        passes, pairs = dev.mtp_fills()
    # a pass a chunk (the first call's 30 tokens are 4 chunks of 8), a pair a token past position 0
    assert passes == 4 + 4 and pairs == 20 - 1 + 10 - 1 + 4 + 2 + 1 + 2
    assert_same_drafts(got, want, kv)
    assert (got[3][0][0] == -1).all() and (got[3][0][1] >= 0).all()  # the import's sequence, then its source
    assert all((drafts >= 0).all() for i, (drafts, _) in enumerate(got) if i != 3)


def test_the_mtp_blocks_experts_held_beside_a_resident_trunk_draft_the_same_bits(models):
    """Where every routed expert of the trunk is held and the MTP block's fit too, they are held as well and the
    block's experts run on the device (no miss call): the drafts and their logits are the bits of the block's
    experts computed by the CPU beside the same resident trunk, and where they do not fit they stay the CPU's."""
    with on_device(models["f32"], "f32", mtp=True) as probe:  # no budget: everything held
        used, n_expert, slot = probe.device.used, probe.n_expert, probe.slots.slot_bytes
    results, held = {}, {}
    # no bound; then one the trunk's experts fit in and the block's not
    for room, budget in (("all", 0), ("trunk", used - n_expert * slot // 2)):
        with DeviceEngine.open(models["f32"], Device("host", budget=budget), kv="f32", mtp=True, resident=True,
                               **SHAPE) as dev:
            counting = dev.device.lib = CountingLibrary(dev.device.lib)
            results[room] = drafting(dev)
            held[room] = dev.expert_counts()["mtp"], counting.calls.get("strata_dev_moe_layer", 0)
    assert held["all"] == (n_expert, 0)
    assert held["trunk"][0] == 0 and held["trunk"][1] > 0  # the block's experts the CPU's, a call a pass
    for (drafts, logits), (want_drafts, want_logits) in zip(results["all"], results["trunk"], strict=True):
        np.testing.assert_array_equal(drafts, want_drafts)
        np.testing.assert_array_equal(logits, want_logits)


@pytest.mark.parametrize("window", [4, 16])
def test_mtp_drafts_with_a_window_match_the_cpu_engines(models, window):
    """With a window (`mtp_window`): no pass at an eval but the chunk with a picture's rows (its last `window`
    pairs), each draft filling the last `window` waiting pairs first and the block attending from its history's
    start, on both engines: the same drafts, their logits within the tolerance; the imported sequence's history
    starts after its rows on both."""
    with Engine.load(models["f32"], kv="f32", mapped_weights=True, mtp=True, mtp_window=window, **SHAPE) as cpu:
        want = drafting(cpu)
        cpu_fills = cpu.mtp_fills()
    with on_device(models["f32"], "f32", capacity=6, mtp=True, mtp_window=window) as dev:
        got = drafting(dev)
        assert dev.mtp_fills()[1] == cpu_fills[1]  # the same pairs filled (passes: the C engine's n_batch rows)
    for (got_drafts, got_logits), (want_drafts, want_logits) in zip(got, want, strict=True):
        np.testing.assert_array_equal(got_drafts, want_drafts)
        assert np.max(np.abs(got_logits - want_logits)) <= KV_TOLERANCE["f32"] * np.max(np.abs(want_logits))
    with on_device(models["f32"], "f32", capacity=6, mtp=True) as dev:
        whole = drafting(dev)
    assert not all(np.array_equal(a[1], b[1]) for a, b in zip(got, whole, strict=True))  # the window tells


def assert_same_drafts(got: list[tuple[np.ndarray, np.ndarray]], want: list[tuple[np.ndarray, np.ndarray]],
                       kv: str) -> None:
    """`drafting`'s drafts the same, their logits within the KV cache type's tolerance, but for the imported
    sequence's after its eval (the block's rows of the imported positions are not filled, on either engine)."""
    got[4], want[4] = (tuple(a[1:] for a in drafts) for drafts in (got[4], want[4]))
    for (got_drafts, got_logits), (want_drafts, want_logits) in zip(got, want, strict=True):
        np.testing.assert_array_equal(got_drafts, want_drafts)
        assert np.max(np.abs(got_logits - want_logits)) <= KV_TOLERANCE[kv] * np.max(np.abs(want_logits))


def test_the_mtp_blocks_own_token_table_is_looked_up(models, tmp_path):
    """A file whose MTP block has its own token table (`nextn.embed_tokens`; here the model's rows in reverse
    order): the device backend's drafts read it, as the CPU engine's do, and differ from those of the model's table."""
    reader = gguf.GGUFReader(models["f32"])
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    table = np.ascontiguousarray(np.asarray(embd.data, np.float32)[::-1])
    path = rewrite(reader, tmp_path / "own-table.gguf", add={"blk.4.nextn.embed_tokens.weight": table})
    with Engine.load(path, kv="f32", mapped_weights=True, mtp=True, **SHAPE) as cpu:
        want = drafting(cpu)
    with on_device(path, capacity=6, mtp=True) as dev:
        got = drafting(dev)
    with on_device(models["f32"], capacity=6, mtp=True) as dev:
        shared = drafting(dev)
    assert_same_drafts(got, want, "f32")
    assert not all(np.array_equal(a[1], b[1]) for a, b in zip(got, shared, strict=True))


def test_the_mtp_block_is_run_only_where_asked_and_the_file_has_one(models, tmp_path):
    with on_device(models["f32"]) as dev:
        assert dev.has_mtp and not dev.mtp and dev.mtp_fills() == (0, 0)
        dev.eval([1, 2, 3])
        with pytest.raises(EngineError, match="runs no MTP block"):
            dev.mtp_draft([0], [3], [4], 2)
    with on_device(models["f32"], mtp=None) as dev:
        assert dev.mtp
        dev.eval([1, 2, 3])
        with pytest.raises(EngineError, match="sequence 0 twice"):
            dev.mtp_draft([0, 0], [3, 3], [4, 4], 2)
        with pytest.raises(EngineError, match="exceed the context"):
            dev.mtp_draft([0], [3], [4], 64)
    plain = write_random_model(tmp_path / "plain.gguf", arch="qwen3moe", size="tiny", dtype="f32", seed=3)
    with pytest.raises(EngineError, match="has no MTP block"):
        on_device(plain, mtp=True)


def test_the_kv_budget_counts_the_mtp_blocks_rows(models):
    with on_device(models["f32"]) as dev:
        need = dev.kv_bytes + dev.n_seq * dev.state_bytes  # the trunk's rows and the recurrent state
    with on_device(models["f32"], kv_budget=need) as dev:
        assert not dev.mtp
    with pytest.raises(EngineError, match="over the KV budget"):
        on_device(models["f32"], kv_budget=need, mtp=True)
    with on_device(models["f32"], kv_budget=need * 3 // 2, mtp=True) as dev:
        assert dev.mtp and dev.kv_bytes > need - dev.n_seq * dev.state_bytes
