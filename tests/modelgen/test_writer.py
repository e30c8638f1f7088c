"""Generated GGUF files read back with `gguf.GGUFReader`: layout, metadata, types and weights."""

import math
import pathlib

import numpy as np
import pytest
from gguf import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES, GGUFReader, quants

from strata.modelgen import hparams_for, permute_llama_qk, unpermute_llama_qk, write_random_model
from strata.modelgen.hparams import HParams

ARCH_ENUM = {"qwen3moe": MODEL_ARCH.QWEN3MOE, "qwen3": MODEL_ARCH.QWEN3, "llama": MODEL_ARCH.LLAMA}
BYTES_VOCAB = 256 + 26 + 3  # byte tokens, Qwen3's added tokens, three whitespace merges
F32_KINDS = ("_norm", "ffn_gate_inp")  # norms and the router stay F32 in every dtype


def expected_shapes(arch: str, hp: HParams, n_vocab: int) -> dict[str, tuple[int, ...]]:
    """GGUF shapes (fastest-varying dimension first) of every tensor, as llama.cpp loads them (names without the
    `.weight` suffix)."""
    e, q, kv, d = hp.n_embd, hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim, hp.head_dim
    out = {"token_embd": (e, n_vocab), "output_norm": (e,), "output": (e, n_vocab)}
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        out |= {b + "attn_norm": (e,), b + "attn_q": (e, q), b + "attn_k": (e, kv), b + "attn_v": (e, kv),
                b + "attn_output": (q, e), b + "ffn_norm": (e,)}
        if arch != "llama":
            out |= {b + "attn_q_norm": (d,), b + "attn_k_norm": (d,)}
        if arch == "qwen3moe":
            x, f = hp.n_expert, hp.n_ff_exp
            out |= {b + "ffn_gate_inp": (e, x), b + "ffn_gate_exps": (e, f, x), b + "ffn_up_exps": (e, f, x),
                    b + "ffn_down_exps": (f, e, x)}
        else:
            out |= {b + "ffn_gate": (e, hp.n_ff), b + "ffn_up": (e, hp.n_ff), b + "ffn_down": (hp.n_ff, e)}
    return out


def field(reader: GGUFReader, key: str) -> object:
    return reader.fields[key].contents()


def base_name(name: str) -> str:
    assert name.endswith(".weight"), name
    return name.removesuffix(".weight")


def tensors(reader: GGUFReader) -> dict[str, np.ndarray]:
    """Every tensor (by name without `.weight`) dequantised to float32 in numpy layout (rows last)."""
    return {base_name(t.name): quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
            for t in reader.tensors}


def types(reader: GGUFReader) -> dict[str, str]:
    return {base_name(t.name): t.tensor_type.name for t in reader.tensors}


@pytest.fixture(scope="module")
def f32_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    out = tmp_path_factory.mktemp("f32")
    return {arch: write_random_model(out / f"{arch}.gguf", arch=arch, dtype="f32") for arch in ARCH_ENUM}


@pytest.mark.parametrize("arch", list(ARCH_ENUM))
def test_layout_matches_llama_cpp(arch: str, tmp_path: pathlib.Path) -> None:
    path = write_random_model(tmp_path / "m.gguf", arch=arch, dtype="f16")
    reader = GGUFReader(path)
    hp = hparams_for(arch, "tiny")
    shapes = {base_name(t.name): tuple(int(n) for n in t.shape) for t in reader.tensors}
    assert shapes == expected_shapes(arch, hp, BYTES_VOCAB)
    allowed = {TENSOR_NAMES[t] for t in MODEL_TENSORS[ARCH_ENUM[arch]]}
    for name in shapes:
        generic = name if not name.startswith("blk.") else "blk.{bid}." + name.split(".", 2)[2]
        assert generic in allowed
    for name, qtype in types(reader).items():
        assert qtype == ("F32" if name.endswith(F32_KINDS) else "F16"), name


@pytest.mark.parametrize("arch", list(ARCH_ENUM))
def test_metadata(arch: str, tmp_path: pathlib.Path) -> None:
    path = write_random_model(tmp_path / "m.gguf", arch=arch, n_layer=3, rope_base=12345.0)
    r = GGUFReader(path)
    assert field(r, "general.architecture") == arch
    expected = {"block_count": 3, "context_length": 4096, "embedding_length": 256, "attention.head_count": 4,
                "attention.head_count_kv": 2, "attention.key_length": 64, "attention.value_length": 64,
                "rope.freq_base": 12345.0}
    expected |= {"feed_forward_length": 768, "expert_count": 8, "expert_used_count": 2,
                 "expert_feed_forward_length": 256} if arch == "qwen3moe" else {"feed_forward_length": 512}
    for key, value in expected.items():
        assert field(r, f"{arch}.{key}") == value, key
    eps = field(r, f"{arch}.attention.layer_norm_rms_epsilon")
    assert eps == pytest.approx(1e-5 if arch == "llama" else 1e-6)
    tokens = field(r, "tokenizer.ggml.tokens")
    assert field(r, "tokenizer.ggml.model") == "gpt2"
    assert field(r, "tokenizer.ggml.pre") == "qwen2"
    assert len(tokens) == len(field(r, "tokenizer.ggml.token_type")) == BYTES_VOCAB
    assert tokens[field(r, "tokenizer.ggml.eos_token_id")] == "<|im_end|>"
    assert tokens[field(r, "tokenizer.ggml.bos_token_id")] == "<|endoftext|>"
    assert field(r, "tokenizer.ggml.merges") == ["Ġ Ġ", "Ċ Ċ", "ĠĠ ĠĠ"]
    assert "<|im_start|>" in field(r, "tokenizer.chat_template")


def test_same_seed_same_file_other_seed_other_weights(tmp_path: pathlib.Path) -> None:
    a = write_random_model(tmp_path / "a.gguf", dtype="q4_k", seed=3)
    b = write_random_model(tmp_path / "b.gguf", dtype="q4_k", seed=3)
    c = write_random_model(tmp_path / "c.gguf", dtype="q4_k", seed=4)
    assert a.read_bytes() == b.read_bytes()
    ta, tc = tensors(GGUFReader(a)), tensors(GGUFReader(c))
    assert not np.array_equal(ta["blk.0.attn_q"], tc["blk.0.attn_q"])


@pytest.mark.parametrize("arch", list(ARCH_ENUM))
def test_weight_statistics(arch: str, f32_models: dict[str, pathlib.Path]) -> None:
    w = tensors(GGUFReader(f32_models[arch]))
    for name, x in w.items():
        if name.endswith("_norm"):
            assert abs(x.mean() - 1) < 0.05 and 0.05 < x.std() < 0.15, name
        elif name not in ("token_embd", "output", "blk.0.ffn_gate_inp", "blk.1.ffn_gate_inp"):
            assert x.std() == pytest.approx(1 / math.sqrt(x.shape[-1]), rel=0.1), name
    assert w["token_embd"].std() == pytest.approx(1.0, rel=0.05)


def test_router_gives_clear_routing_margins(f32_models: dict[str, pathlib.Path]) -> None:
    hp = hparams_for("qwen3moe", "tiny")
    router = tensors(GGUFReader(f32_models["qwen3moe"]))["blk.0.ffn_gate_inp"]  # (n_expert, n_embd)
    x = np.random.default_rng(1).standard_normal((4000, hp.n_embd)).astype(np.float32)  # unit RMS, like ffn_norm's
    logits = x @ router.T
    assert logits.std() == pytest.approx(2.0, rel=0.2)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs = np.sort(probs / probs.sum(axis=1, keepdims=True), axis=1)[:, ::-1]
    margin = probs[:, hp.n_expert_used - 1] - probs[:, hp.n_expert_used]  # k-th minus (k+1)-th probability
    assert np.median(margin) > 0.05


@pytest.mark.parametrize("dtype,tolerance", [("f16", 1e-3), ("bf16", 8e-3), ("q8_0", 0.01), ("q4_0", 0.15),
                                             ("q4_k", 0.10)])
@pytest.mark.parametrize("arch", ["qwen3moe", "llama"])
def test_dtypes_encode_the_f32_weights(arch: str, dtype: str, tolerance: float, tmp_path: pathlib.Path,
                                       f32_models: dict[str, pathlib.Path]) -> None:
    """The same seed draws the same weights; each dtype stores them within its format's relative RMS error."""
    reference = tensors(GGUFReader(f32_models[arch]))
    reader = GGUFReader(write_random_model(tmp_path / "m.gguf", arch=arch, dtype=dtype))
    for name, x in tensors(reader).items():
        rel = np.sqrt(((x - reference[name]) ** 2).mean() / (reference[name] ** 2).mean())
        assert rel < tolerance, name
    assert {qtype for name, qtype in types(reader).items() if name.endswith(F32_KINDS)} == {"F32"}


def test_q4_k_mixture(tmp_path: pathlib.Path) -> None:
    """llama.cpp's Q4_K_M: output and attn_v/ffn_down of the first and last eighth of layers (and every third
    between) in Q6_K, other matrices Q4_K."""
    reader = GGUFReader(write_random_model(tmp_path / "m.gguf", arch="qwen3", dtype="q4_k", n_layer=8))
    kinds = types(reader)
    assert kinds["output"] == "Q6_K"
    assert kinds["token_embd"] == kinds["blk.3.attn_q"] == kinds["blk.3.ffn_up"] == "Q4_K"
    six = [i for i in range(8) if kinds[f"blk.{i}.attn_v"] == "Q6_K"]
    assert six == [0, 3, 6, 7]
    assert all(kinds[f"blk.{i}.ffn_down"] == kinds[f"blk.{i}.attn_v"] for i in range(8))


def test_partial_blocks_fall_back(tmp_path: pathlib.Path) -> None:
    # n_embd 320: rows of 320 don't fill a 256-block (-> Q8_0); attn_output rows (4 * 64 = 256) still do.
    kinds = types(GGUFReader(write_random_model(tmp_path / "k.gguf", arch="qwen3", dtype="q4_k", n_embd=320)))
    assert kinds["blk.0.attn_q"] == kinds["blk.0.ffn_up"] == "Q8_0"
    assert kinds["blk.0.attn_output"] == "Q4_K"
    # n_embd 200: rows of 200 don't fill a 32-block (Q8_0 -> F16); attn_output rows (4 * 40 = 160) do.
    path = write_random_model(tmp_path / "q.gguf", arch="qwen3", dtype="q8_0", n_embd=200, head_dim=40)
    kinds = types(GGUFReader(path))
    assert kinds["blk.0.attn_q"] == "F16" and kinds["blk.0.attn_output"] == "Q8_0"


def rope(x: np.ndarray, pos: int, base: float, interleaved: bool) -> np.ndarray:
    """Rotary embedding of one head's vector: pairs (i, i + d/2) (NEOX) or (2i, 2i + 1) (GPT-J / llama.cpp)."""
    d = x.shape[-1]
    theta = pos * base ** (-np.arange(d // 2) * 2 / d)
    cos, sin = np.cos(theta), np.sin(theta)
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., : d // 2], x[..., d // 2:])
    ra, rb = a * cos - b * sin, a * sin + b * cos
    if interleaved:
        return np.stack([ra, rb], axis=-1).reshape(x.shape)
    return np.concatenate([ra, rb], axis=-1)


def test_llama_permutation_turns_neox_rope_into_interleaved() -> None:
    n_head, head_dim, n_embd = 4, 16, 32
    rng = np.random.default_rng(0)
    w_hf = rng.standard_normal((n_head * head_dim, n_embd))
    x = rng.standard_normal(n_embd)
    w_gguf = permute_llama_qk(w_hf, n_head)
    assert np.array_equal(unpermute_llama_qk(w_gguf, n_head), w_hf)
    q_hf = rope((w_hf @ x).reshape(n_head, head_dim), 7, 10000.0, interleaved=False)
    q_gguf = rope((w_gguf @ x).reshape(n_head, head_dim), 7, 10000.0, interleaved=True)
    # Same rotated vector, rows in the permuted order: attention scores are unchanged.
    np.testing.assert_allclose(unpermute_llama_qk(q_gguf.reshape(-1, 1), n_head).ravel(), q_hf.ravel(), atol=1e-12)


def test_llama_file_stores_permuted_q_k(f32_models: dict[str, pathlib.Path]) -> None:
    """Tiny llama and qwen3 have the same shapes and draw token_embd, attn_norm, attn_q, attn_k in the same order
    from the same seed: llama's file holds qwen3's (unpermuted, NEOX) Q and K rows permuted."""
    hp = hparams_for("llama", "tiny")
    llama = tensors(GGUFReader(f32_models["llama"]))
    qwen3 = tensors(GGUFReader(f32_models["qwen3"]))
    assert np.array_equal(llama["blk.0.attn_q"], permute_llama_qk(qwen3["blk.0.attn_q"], hp.n_head))
    assert np.array_equal(llama["blk.0.attn_k"], permute_llama_qk(qwen3["blk.0.attn_k"], hp.n_head_kv))
    assert not np.array_equal(llama["blk.0.attn_q"], qwen3["blk.0.attn_q"])


def test_unknown_names_are_rejected(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="unknown hyper-parameters"):
        write_random_model(tmp_path / "m.gguf", n_layers=2)
    with pytest.raises(ValueError, match="unknown dtype"):
        write_random_model(tmp_path / "m.gguf", dtype="q2_k")
    with pytest.raises(ValueError, match="unknown vocabulary"):
        write_random_model(tmp_path / "m.gguf", vocab="gpt2")
