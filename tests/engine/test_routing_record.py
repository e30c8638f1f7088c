"""The engine's routing record (`Engine.load(record_routing=...)`, `strata_record_routing`): each MoE layer's
choices, per token of each step, against the router of a Hugging Face transformers model holding the same weights
(`hf_reference`), and the trace file's framing."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch
from hf_reference import forward_with_routing, load_hf_model

from strata.engine_cffi import BatchItem, Engine, EngineError
from strata.experts.trace import MAGIC, TraceError, read_trace
from strata.modelgen import write_random_model

N_PROMPT, N_BATCH, N_DECODE = 40, 16, 4  # three prompt chunks (16, 16, 8 tokens), then four decode steps
NEAR_TIE = 1e-5  # f32 weights: a k-th / (k+1)-th probability gap below this may order differently in the engine


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_random_model(tmp_path_factory.mktemp("routing") / "m.gguf", arch="qwen3moe", size="tiny",
                              dtype="f32", seed=3)


def recorded_choices(path: pathlib.Path, trace_path: pathlib.Path, tokens: list[int]) -> np.ndarray:
    """Run a chunked prompt then one decode call per token with the record on; check the steps' shape and return
    the choices as (n_layer, n_tokens, k)."""
    with Engine.load(path, n_ctx=128, threads=2, kv="f32", n_batch=N_BATCH, record_routing=trace_path) as engine:
        engine.eval(tokens[:N_PROMPT])
        for token in tokens[N_PROMPT:]:
            engine.eval([token])
    trace = read_trace(trace_path)
    n_layer = trace.info.n_layer
    chunks = [16, 16, 8] + [1] * N_DECODE
    assert [(r.step, r.layer, len(r.experts)) for r in trace.records] == [
        (step, layer, n) for step, n in enumerate(chunks) for layer in range(n_layer)]
    return np.stack([np.concatenate([r.experts for r in trace.records if r.layer == il]) for il in range(n_layer)])


def test_recorded_choices_are_the_reference_routers_top_k(moe_model: pathlib.Path, tmp_path: pathlib.Path) -> None:
    reference = load_hf_model(moe_model)
    k = reference.config.num_experts_per_tok
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, reference.config.vocab_size, N_PROMPT + N_DECODE)]
    _, probs = forward_with_routing(reference, tokens)
    ranked = [p.sort(-1, descending=True) for p in probs]  # per layer: values, indices (n_tokens, n_expert)
    expected = torch.stack([r.indices[:, :k] for r in ranked]).numpy()  # (n_layer, n_tokens, k), most probable first
    gaps = torch.stack([(r.values[:, :k] - r.values[:, 1 : k + 1]).min(-1).values for r in ranked]).min(0).values
    ties = np.flatnonzero(gaps.numpy() < NEAR_TIE)  # after a flipped choice the hidden states part ways
    held = int(ties[0]) if len(ties) else len(tokens)
    got = recorded_choices(moe_model, tmp_path / "trace.bin", tokens)
    assert held == len(tokens), f"a near-tie at position {held}: pick another seed"
    np.testing.assert_array_equal(got, expected)


def test_a_batch_records_its_tokens_in_call_order(moe_model: pathlib.Path, tmp_path: pathlib.Path) -> None:
    # the same tokens routed alone and beside another sequence's: the same choices, at their places in the call
    first, second = [5, 9, 77, 3], [200, 14]
    with Engine.load(moe_model, n_ctx=64, threads=1, kv="f32", n_seq=2, record_routing=tmp_path / "a.bin") as e:
        e.eval(first, seq=0)
        e.eval(second, seq=1)
    with Engine.load(moe_model, n_ctx=64, threads=1, kv="f32", n_seq=2, record_routing=tmp_path / "b.bin") as e:
        e.eval_batch([BatchItem(0, first), BatchItem(1, second)])
    alone, together = read_trace(tmp_path / "a.bin"), read_trace(tmp_path / "b.bin")
    assert alone.n_steps == 2 and together.n_steps == 1
    for il in range(together.info.n_layer):
        want = np.concatenate([r.experts for r in alone.records if r.layer == il])
        (got,) = [r.experts for r in together.records if r.layer == il]
        np.testing.assert_array_equal(got, want)


def test_recording_leaves_the_logits_alone(moe_model: pathlib.Path, tmp_path: pathlib.Path) -> None:
    tokens = list(range(1, 30))
    with Engine.load(moe_model, n_ctx=64, threads=2, n_batch=8) as engine:
        plain = engine.eval(tokens, all_logits=True)
    with Engine.load(moe_model, n_ctx=64, threads=2, n_batch=8, record_routing=tmp_path / "t.bin") as engine:
        recorded = engine.eval(tokens, all_logits=True)
    np.testing.assert_array_equal(recorded, plain)


def test_the_trace_names_the_model(moe_model: pathlib.Path, tmp_path: pathlib.Path) -> None:
    with Engine.load(moe_model, n_ctx=64, threads=1, record_routing=tmp_path / "t.bin") as engine:
        engine.eval([1, 2, 3])
        n_layer = int(engine.metadata["qwen3moe.block_count"])
        k = int(engine.metadata["qwen3moe.expert_used_count"])
    info = read_trace(tmp_path / "t.bin").info
    assert (info.arch, info.n_layer, info.n_expert_used) == ("qwen3moe", n_layer, k)
    assert info.model


def test_a_dense_model_has_nothing_to_record(tmp_path: pathlib.Path) -> None:
    path = write_random_model(tmp_path / "d.gguf", arch="qwen3", size="tiny", dtype="f32")
    with pytest.raises(EngineError, match="record_routing: the qwen3 model has no experts"):
        Engine.load(path, n_ctx=64, threads=1, record_routing=tmp_path / "t.bin")


def test_an_unwritable_trace_is_an_engine_error(moe_model: pathlib.Path, tmp_path: pathlib.Path) -> None:
    with pytest.raises(EngineError, match="record_routing: cannot write"):
        Engine.load(moe_model, n_ctx=64, threads=1, record_routing=tmp_path / "missing" / "t.bin")


def test_a_trace_cut_short_ends_at_its_last_whole_record(moe_model: pathlib.Path, tmp_path: pathlib.Path) -> None:
    path = tmp_path / "t.bin"
    with Engine.load(moe_model, n_ctx=64, threads=1, record_routing=path) as engine:
        engine.eval([1, 2, 3])
        engine.eval([4])
    whole = read_trace(path)
    path.write_bytes(path.read_bytes()[:-4])
    cut = read_trace(path)
    assert len(cut.records) == len(whole.records) - 1
    assert all(np.array_equal(a.experts, b.experts) for a, b in zip(cut.records, whole.records, strict=False))


def test_a_file_that_is_not_a_trace(tmp_path: pathlib.Path) -> None:
    (tmp_path / "x.bin").write_bytes(b"GGUF" + bytes(20))
    with pytest.raises(TraceError, match="not a routing trace"):
        read_trace(tmp_path / "x.bin")
    (tmp_path / "y.bin").write_bytes(MAGIC + (2).to_bytes(4, "little") + b"{}")
    with pytest.raises(TraceError, match="bad trace header"):
        read_trace(tmp_path / "y.bin")
