"""Generated `qwen35moe` / `qwen35` files read back with `gguf.GGUFReader`: the layer pattern, the tensor table,
metadata, types per dtype and the weights' draws. (tests/modelgen/test_qwen35_convert.py compares the files with
llama.cpp's converter's.)"""

from __future__ import annotations

import math
import pathlib

import numpy as np
import pytest
from gguf import TENSOR_NAMES, GGUFReader, quants

from strata.modelgen import hparams_for, write_random_model
from strata.modelgen.hparams import HYBRID_ARCHS, HParams
from strata.modelgen.writer import SSM_A_LOG_MEAN, SSM_A_LOG_SPREAD

ARCHS = HYBRID_ARCHS
BYTES_VOCAB = 256 + 26 + 3
# F32 in every dtype, as the converter and llama.cpp's quantizer keep them
F32_KINDS = ("norm", "ffn_gate_inp", "ffn_gate_inp_shexp", "ssm_a", "ssm_dt", "ssm_conv1d")


def expected_shapes(arch: str, hp: HParams, n_vocab: int) -> dict[str, tuple[int, ...]]:
    """GGUF shapes (fastest-varying dimension first) of every tensor, names without their suffix."""
    e, d, kv = hp.n_embd, hp.head_dim, hp.n_head_kv * hp.head_dim
    conv = 2 * hp.ssm_group_count * hp.ssm_state_size + hp.ssm_inner_size
    v_heads, inner = hp.ssm_time_step_rank, hp.ssm_inner_size
    out = {"token_embd": (e, n_vocab), "output_norm": (e,), "output": (e, n_vocab)}
    for i in range(hp.n_layer + hp.n_nextn):
        b = f"blk.{i}."
        out |= {b + "attn_norm": (e,), b + "post_attention_norm": (e,)}
        if i < hp.n_layer and (i + 1) % hp.full_attention_interval:
            out |= {b + "attn_qkv": (e, conv), b + "attn_gate": (e, inner), b + "ssm_alpha": (e, v_heads),
                    b + "ssm_beta": (e, v_heads), b + "ssm_a": (v_heads,), b + "ssm_dt": (v_heads,),
                    b + "ssm_conv1d": (hp.ssm_conv_kernel, conv), b + "ssm_norm": (inner // v_heads,),
                    b + "ssm_out": (inner, e)}
        else:
            q = hp.n_head * d
            out |= {b + "attn_q": (e, 2 * q), b + "attn_k": (e, kv), b + "attn_v": (e, kv), b + "attn_output": (q, e),
                    b + "attn_q_norm": (d,), b + "attn_k_norm": (d,)}
        if arch == "qwen35moe":
            x, f, s = hp.n_expert, hp.n_ff_exp, hp.n_ff_shexp
            out |= {b + "ffn_gate_inp": (e, x), b + "ffn_gate_exps": (e, f, x), b + "ffn_up_exps": (e, f, x),
                    b + "ffn_down_exps": (f, e, x), b + "ffn_gate_inp_shexp": (e, 1), b + "ffn_gate_shexp": (e, s),
                    b + "ffn_up_shexp": (e, s), b + "ffn_down_shexp": (s, e)}
        else:
            out |= {b + "ffn_gate": (e, hp.n_ff), b + "ffn_up": (e, hp.n_ff), b + "ffn_down": (hp.n_ff, e)}
        if i >= hp.n_layer:
            out |= {b + "nextn.eh_proj": (2 * e, e), b + "nextn.enorm": (e,), b + "nextn.hnorm": (e,),
                    b + "nextn.shared_head_norm": (e,)}
    return out


def base_name(name: str) -> str:
    return name.removesuffix(".weight").removesuffix(".bias")


def types(reader: GGUFReader) -> dict[str, str]:
    return {base_name(t.name): t.tensor_type.name for t in reader.tensors}


def tensors(reader: GGUFReader) -> dict[str, np.ndarray]:
    return {base_name(t.name): quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
            for t in reader.tensors}


@pytest.fixture(scope="module")
def f32_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    out = tmp_path_factory.mktemp("hybrid")
    return {arch: write_random_model(out / f"{arch}.gguf", arch=arch, dtype="f32") for arch in ARCHS}


def test_three_delta_net_layers_per_attention_layer() -> None:
    for arch in ARCHS:
        for size in ("tiny", "small", "medium"):
            pattern = hparams_for(arch, size).recurrent_layers()
            assert pattern == (True, True, True, False) * (len(pattern) // 4), (arch, size)
    assert hparams_for("qwen35", "tiny", n_layer=6, full_attention_interval=3).recurrent_layers() == (
        True, True, False, True, True, False)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("overrides", [{}, {"full_attention_interval": 2, "n_nextn": 0}])
def test_layout(arch: str, overrides: dict[str, int], tmp_path: pathlib.Path) -> None:
    path = write_random_model(tmp_path / "m.gguf", arch=arch, dtype="f16", **overrides)
    reader = GGUFReader(path)
    shapes = {base_name(t.name): tuple(int(n) for n in t.shape) for t in reader.tensors}
    assert shapes == expected_shapes(arch, hparams_for(arch, "tiny", **overrides), BYTES_VOCAB)
    suffixes = {base_name(t.name): t.name.removeprefix(base_name(t.name)) for t in reader.tensors}
    assert {name for name, suffix in suffixes.items() if suffix != ".weight"} == {
        name for name in shapes if name.endswith(("ssm_a", "ssm_dt"))}
    assert all(suffixes[name] == ".bias" for name in shapes if name.endswith("ssm_dt"))
    generic = {TENSOR_NAMES[t] for t in TENSOR_NAMES}
    for name in shapes:
        assert (name if not name.startswith("blk.") else "blk.{bid}." + name.split(".", 2)[2]) in generic, name
    for name, qtype in types(reader).items():
        assert qtype == ("F32" if name.endswith(F32_KINDS) else "F16"), name


@pytest.mark.parametrize("arch", ARCHS)
def test_metadata(arch: str, f32_models: dict[str, pathlib.Path]) -> None:
    fields = GGUFReader(f32_models[arch]).fields
    assert fields["general.architecture"].contents() == arch
    assert fields["general.type"].contents() == "model"
    expected: dict[str, object] = {
        "block_count": 5, "context_length": 4096, "embedding_length": 256, "attention.head_count": 4,
        "attention.head_count_kv": 2, "attention.key_length": 64, "attention.value_length": 64,
        "rope.freq_base": 1e7, "rope.dimension_count": 16, "rope.dimension_sections": [3, 3, 2, 0],
        "full_attention_interval": 4, "attention.recurrent_layers": [True, True, True, False, False],
        "nextn_predict_layers": 1, "ssm.conv_kernel": 4, "ssm.state_size": 64, "ssm.group_count": 2,
        "ssm.time_step_rank": 4, "ssm.inner_size": 256}
    expected |= ({"expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 256,
                  "expert_shared_feed_forward_length": 256} if arch == "qwen35moe" else {"feed_forward_length": 512})
    for key, value in expected.items():
        assert fields[f"{arch}.{key}"].contents() == value, key
    assert (f"{arch}.feed_forward_length" in fields) == (arch == "qwen35")
    assert f"{arch}.vocab_size" not in fields  # the converter writes none for these
    assert "tokenizer.ggml.eot_token_id" not in fields
    assert fields["tokenizer.ggml.add_eos_token"].contents() is False
    assert "<tool_call>\\n<function=" in fields["tokenizer.chat_template"].contents()  # Qwen3.5's XML tool calls


@pytest.mark.parametrize("arch", ARCHS)
def test_weight_draws(arch: str, f32_models: dict[str, pathlib.Path]) -> None:
    w = tensors(GGUFReader(f32_models[arch]))
    a = np.concatenate([x for name, x in w.items() if name.endswith("ssm_a")])
    assert (a < 0).all()  # every DeltaNet head decays
    log_a = np.log(-a)
    assert abs(log_a.mean() - SSM_A_LOG_MEAN) < 3 * SSM_A_LOG_SPREAD / math.sqrt(a.size)
    dt = np.concatenate([x for name, x in w.items() if name.endswith("ssm_dt")])
    assert abs(dt.mean() - 1) < 0.1
    conv = w["blk.0.ssm_conv1d"]  # (channels, kernel)
    assert conv.std() == pytest.approx(1 / math.sqrt(conv.shape[1]), rel=0.1)
    for name in ("blk.0.attn_qkv", "blk.3.attn_q", "blk.4.nextn.eh_proj"):
        assert w[name].std() == pytest.approx(1 / math.sqrt(w[name].shape[-1]), rel=0.1), name


def more_bits(layer: int, n_layer: int) -> bool:
    return layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2


def test_q4_k_mixture(tmp_path: pathlib.Path) -> None:
    """llama.cpp's Q4_K_M: Q6_K for attn_v and attn_qkv (counted together, one per layer) and ffn_down of the
    first and last eighth and every third layer between, over all 9 layers (the MTP one too)."""
    kinds = types(GGUFReader(write_random_model(tmp_path / "m.gguf", arch="qwen35moe", dtype="q4_k", n_layer=8)))
    six = [0, 3, 6, 7, 8]
    assert [i for i in range(9) if more_bits(i, 9)] == six
    for i in range(9):
        value = "attn_v" if (i + 1) % 4 == 0 or i == 8 else "attn_qkv"
        assert kinds[f"blk.{i}.{value}"] == ("Q6_K" if i in six else "Q4_K"), i
        for down in ("ffn_down_exps", "ffn_down_shexp"):
            assert kinds[f"blk.{i}.{down}"] == ("Q6_K" if i in six else "Q4_K"), (i, down)
    assert kinds["output"] == "Q6_K" and kinds["blk.0.ssm_out"] == kinds["blk.3.attn_q"] == "Q4_K"
    assert kinds["blk.0.ssm_conv1d"] == kinds["blk.0.ssm_a"] == "F32"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("n_layer", [4, 8])
def test_types_match_llama_cpp_quantizer(arch: str, n_layer: int, tmp_path: pathlib.Path) -> None:
    """Where llama-cpp-python is installed: llama.cpp's quantizer makes of our F32 file the types our dtypes
    write. Its files store the shared expert's gate (n_embd, 1) as (n_embd,), dropping the trailing 1 as ggml
    does; the converter keeps it, and so do we."""
    pytest.importorskip("llama_cpp")
    from llama_cpp_quantize import quantize

    source = write_random_model(tmp_path / "f32.gguf", arch=arch, dtype="f32", n_layer=n_layer)
    for preset, dtype in (("Q4_K_M", "q4_k"), ("Q8_0", "q8_0")):
        theirs = GGUFReader(quantize(source, tmp_path / f"{preset}.gguf", preset))
        ours = GGUFReader(write_random_model(tmp_path / f"{dtype}.gguf", arch=arch, dtype=dtype, n_layer=n_layer))
        assert types(ours) == types(theirs), preset
        shapes = {t.name: [n for n in t.shape.tolist() if n != 1] for t in ours.tensors}
        assert shapes == {t.name: t.shape.tolist() for t in theirs.tensors}


def test_inconsistent_hybrid_shapes_are_refused(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="ssm_time_step_rank 3"):
        write_random_model(tmp_path / "m.gguf", arch="qwen35", ssm_time_step_rank=3)
    with pytest.raises(ValueError, match="rope_sections"):
        write_random_model(tmp_path / "m.gguf", arch="qwen35", n_rot=32)
    with pytest.raises(ValueError, match="4 entries"):
        write_random_model(tmp_path / "m.gguf", arch="qwen35", rope_sections=(3, 3, 2))
    with pytest.raises(ValueError, match="needs ssm_conv_kernel"):
        write_random_model(tmp_path / "m.gguf", arch="qwen35", ssm_time_step_rank=0)
    with pytest.raises(ValueError, match="full_attention_interval 0"):
        write_random_model(tmp_path / "m.gguf", arch="qwen35", full_attention_interval=0)
    with pytest.raises(ValueError, match="n_ff_shexp"):
        write_random_model(tmp_path / "m.gguf", arch="qwen35moe", n_ff_shexp=0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("overrides", [{}, {"full_attention_interval": 2, "n_nextn": 0}])
def test_llama_cpp_runs_our_files(arch: str, overrides: dict[str, int], tmp_path: pathlib.Path) -> None:
    """Where llama-cpp-python is installed: llama.cpp loads our files (it refuses a missing, extra or misshapen
    tensor or key) and gives logits of the spread the writer aims at (std ~2, OUTPUT_GAIN)."""
    pytest.importorskip("llama_cpp")
    from llama_cpp_quantize import llama_cpp_logits

    path = write_random_model(tmp_path / "m.gguf", arch=arch, dtype="q8_0", **overrides)
    logits = llama_cpp_logits(path, list(range(40, 72)))
    assert logits.shape == (32, BYTES_VOCAB) and np.isfinite(logits).all()
    assert 1.0 < logits.std() < 4.0
