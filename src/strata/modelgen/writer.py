"""GGUF files laid out exactly as llama.cpp's converters write them: `write_random_model` with random weights,
`write_model` with given ones.

Random weights are drawn from `numpy.random.default_rng(seed)` in file order, so a (arch, size, dtype, vocab, seed,
overrides) tuple always gives the same file. Matrices are normal with std 1/sqrt(fan_in), so every projection of a
unit-RMS activation has unit RMS; norm weights are 1 + N(0, 0.1^2); embeddings are N(0, 1).

Router (`ffn_gate_inp`) rows have std ROUTER_GAIN/sqrt(n_embd), so on the unit-RMS output of `ffn_norm` the
router logits have std ~ROUTER_GAIN. A relative error e in the router's input flips a routing choice at a rate
proportional to e whatever this scale (margins and errors scale together); the scale decides how far apart the
routing probabilities of the k-th and (k+1)-th expert lie. Gain 2 maximises that gap: for top-2 of 8 experts its
median is ~0.07 (0.045 at gain 1, 0.06 at gain 4, where the weights concentrate on the first expert).

The hybrids (`qwen35moe`, `qwen35`) store what llama.cpp's converter makes of a Qwen3.5 checkpoint: `ssm_a` is
-exp(A_log), drawn here as -exp(N(SSM_A_LOG_MEAN, SSM_A_LOG_SPREAD^2)) so every DeltaNet head decays; the `dt`
bias is 1 + N(0, 0.1^2) as Qwen initialises it; the causal convolution's taps have std 1/sqrt(kernel).
`strata.modelgen.hf_qwen35` maps a Hugging Face checkpoint's weights onto the same table.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import os
import pathlib
from collections.abc import Callable, Mapping

import numpy as np
from gguf import (
    GGML_QUANT_VERSION,
    MODEL_ARCH,
    MODEL_ARCH_NAMES,
    MODEL_TENSOR,
    TENSOR_NAMES,
    GGMLQuantizationType,
    GGUFType,
    GGUFWriter,
    LlamaFileType,
)

from strata.modelgen import quants
from strata.modelgen.hparams import DTYPES, HYBRID_ARCHS, HParams, hparams_for
from strata.modelgen.vocab import ENDOFTEXT, IM_END, Vocab, get_vocab

ROUTER_GAIN = 2.0
NORM_SPREAD = 0.1
OUTPUT_GAIN = 2.0  # logits of std ~2: a clear argmax for greedy tests, still far from saturating softmax
SSM_A_LOG_MEAN, SSM_A_LOG_SPREAD = -1.0, 0.5  # decay rates A around 0.37 per unit of softplus(dt)
RECURRENT_LAYERS_KEY = "{arch}.attention.recurrent_layers"  # llama.cpp's; newer than the gguf package's key table

_ARCH = {"qwen3moe": MODEL_ARCH.QWEN3MOE, "qwen3": MODEL_ARCH.QWEN3, "llama": MODEL_ARCH.LLAMA,
         "qwen35moe": MODEL_ARCH.QWEN35MOE, "qwen35": MODEL_ARCH.QWEN35}
Q = GGMLQuantizationType
_BASE_TYPE = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_k": Q.Q4_K}
_FILE_TYPE = {"f32": LlamaFileType.ALL_F32, "f16": LlamaFileType.MOSTLY_F16, "bf16": LlamaFileType.MOSTLY_BF16,
              "q8_0": LlamaFileType.MOSTLY_Q8_0, "q4_0": LlamaFileType.MOSTLY_Q4_0,
              "q4_k": LlamaFileType.MOSTLY_Q4_K_M}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor: gguf name, numpy shape (rows along the last axis), its draw mean + std * N(0, 1) (stored as
    -exp(draw) where `negative_exp`), its block type, and for llama's Q and K the head count whose rows get permuted
    (0: none)."""

    name: str
    shape: tuple[int, ...]
    std: float
    qtype: GGMLQuantizationType
    mean: float = 0.0
    permute_heads: int = 0
    negative_exp: bool = False


# --- weight draws

CHUNK_ELEMENTS = 1 << 22  # weights drawn and encoded at a time: bounds the float32 temporaries to ~16 MB each


def draw_encoded(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    """The tensor of `spec` drawn from `rng` and encoded, as rows of bytes.

    Rows are drawn and encoded a chunk at a time; numpy's generator yields the same numbers in chunks as in one
    call, so the result does not depend on CHUNK_ELEMENTS.
    """
    if spec.permute_heads:
        return quants.encode(permute_llama_qk(_draw(rng, spec.shape, spec), spec.permute_heads), spec.qtype)
    row = spec.shape[-1]
    n_rows = math.prod(spec.shape[:-1])
    out = np.empty((n_rows, quants.byte_shape((row,), spec.qtype)[0]), np.uint8)
    step = max(1, CHUNK_ELEMENTS // row)
    for start in range(0, n_rows, step):
        n = min(step, n_rows - start)
        out[start:start + n] = quants.encode(_draw(rng, (n, row), spec), spec.qtype)
    return out


def _draw(rng: np.random.Generator, shape: tuple[int, ...], spec: TensorSpec) -> np.ndarray:
    out = rng.standard_normal(shape, dtype=np.float32)
    out *= np.float32(spec.std)
    out += np.float32(spec.mean)
    if spec.negative_exp:
        out = -np.exp(out)
    return out


def permute_llama_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF layout -> GGUF layout of a llama Q or K weight (rows = n_head * head_dim outputs).

    HF rotates the two halves of each head (NEOX style); llama.cpp's llama rotates adjacent pairs, so its converter
    interleaves each head's rows: GGUF row 2i is HF row i, GGUF row 2i + 1 is HF row i + head_dim / 2.
    """
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_llama_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of `permute_llama_qk`: GGUF layout -> HF layout."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --- tensor table


def _more_bits(layer: int, n_layer: int) -> bool:
    """Layers that llama.cpp's Q4_K_M gives Q6_K for attn_v and ffn_down: the first and last eighth, and every
    third one between."""
    return layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2


# llama.cpp's quantizer counts attn_v and attn_qkv (a DeltaNet layer's) as one kind, one per layer in our files.
_MORE_BITS = (MODEL_TENSOR.ATTN_V, MODEL_TENSOR.ATTN_QKV, MODEL_TENSOR.FFN_DOWN, MODEL_TENSOR.FFN_DOWN_EXP,
              MODEL_TENSOR.FFN_DOWN_SHEXP)


def _qtype(tensor: MODEL_TENSOR, row: int, dtype: str, layer: int, n_layer: int) -> GGMLQuantizationType:
    """Block type of a 2-D/3-D weight; `n_layer` counts the MTP layers too. llama.cpp's special case for models of
    exactly 8 experts (attn_k and attn_v Q8_0, attn_output Q5_K) is not modelled. Rows that don't fill a block fall
    back like llama.cpp does: K-quants to Q8_0, Q8_0/Q4_0 to F16."""
    qtype = _BASE_TYPE[dtype]
    if dtype == "q4_k":
        q6 = tensor == MODEL_TENSOR.OUTPUT or (tensor in _MORE_BITS and _more_bits(layer, n_layer))
        qtype = Q.Q6_K if q6 else Q.Q4_K
        if row % quants.QK_K:
            qtype = Q.Q8_0
    if qtype in (Q.Q8_0, Q.Q4_0) and row % 32:
        qtype = Q.F16
    return qtype


class _Specs:
    """Builds the TensorSpecs of one model: names with the suffix llama.cpp's converters add, draws and types."""

    def __init__(self, hp: HParams, dtype: str, n_layer_all: int):
        self.hp, self.dtype, self.n_layer_all = hp, dtype, n_layer_all

    @staticmethod
    def name(tensor: MODEL_TENSOR, layer: int, suffix: str = ".weight") -> str:
        return TENSOR_NAMES[tensor].format(bid=layer) + suffix

    def matrix(self, tensor: MODEL_TENSOR, shape: tuple[int, ...], layer: int = 0, gain: float = 1.0,
               permute_heads: int = 0) -> TensorSpec:
        """A weight of std gain / sqrt(fan_in)."""
        qtype = _qtype(tensor, shape[-1], self.dtype, layer, self.n_layer_all)
        return TensorSpec(self.name(tensor, layer), shape, gain / math.sqrt(shape[-1]), qtype,
                          permute_heads=permute_heads)

    def norm(self, tensor: MODEL_TENSOR, size: int, layer: int = 0) -> TensorSpec:
        return TensorSpec(self.name(tensor, layer), (size,), NORM_SPREAD, Q.F32, mean=1.0)

    def f32(self, tensor: MODEL_TENSOR, shape: tuple[int, ...], std: float, layer: int, suffix: str = ".weight",
            mean: float = 0.0, negative_exp: bool = False) -> TensorSpec:
        """A tensor that stays F32 in every dtype (routers, DeltaNet's per-head parameters and convolution)."""
        return TensorSpec(self.name(tensor, layer, suffix), shape, std, Q.F32, mean=mean, negative_exp=negative_exp)

    def moe_ffn(self, layer: int) -> list[TensorSpec]:
        hp, T = self.hp, MODEL_TENSOR
        return [
            self.f32(T.FFN_GATE_INP, (hp.n_expert, hp.n_embd), ROUTER_GAIN / math.sqrt(hp.n_embd), layer),
            self.matrix(T.FFN_GATE_EXP, (hp.n_expert, hp.n_ff_exp, hp.n_embd), layer),
            self.matrix(T.FFN_UP_EXP, (hp.n_expert, hp.n_ff_exp, hp.n_embd), layer),
            self.matrix(T.FFN_DOWN_EXP, (hp.n_expert, hp.n_embd, hp.n_ff_exp), layer),
        ]

    def dense_ffn(self, layer: int) -> list[TensorSpec]:
        hp, T = self.hp, MODEL_TENSOR
        return [
            self.matrix(T.FFN_GATE, (hp.n_ff, hp.n_embd), layer),
            self.matrix(T.FFN_UP, (hp.n_ff, hp.n_embd), layer),
            self.matrix(T.FFN_DOWN, (hp.n_embd, hp.n_ff), layer),
        ]


def tensor_specs(arch: str, hp: HParams, n_vocab: int, dtype: str) -> list[TensorSpec]:
    """Every tensor of the model in file order: token_embd, the blocks (the hybrids' MTP layers last), output_norm,
    output."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: one of {DTYPES}")
    make = _Specs(hp, dtype, hp.n_layer + hp.n_nextn)
    T = MODEL_TENSOR
    embd_type = _qtype(T.TOKEN_EMBD, hp.n_embd, dtype, 0, hp.n_layer)
    specs = [TensorSpec(make.name(T.TOKEN_EMBD, 0), (n_vocab, hp.n_embd), 1.0, embd_type)]  # N(0, 1) embeddings
    specs += _hybrid_blocks(make, arch) if arch in HYBRID_ARCHS else _transformer_blocks(make, arch)
    specs += [make.norm(T.OUTPUT_NORM, hp.n_embd), make.matrix(T.OUTPUT, (n_vocab, hp.n_embd), gain=OUTPUT_GAIN)]
    return specs


def _transformer_blocks(make: _Specs, arch: str) -> list[TensorSpec]:
    """qwen3moe, qwen3 and llama: attention and FFN in every layer."""
    hp, T = make.hp, MODEL_TENSOR
    q_dim, kv_dim = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
    llama = arch == "llama"
    specs = []
    for i in range(hp.n_layer):
        specs += [
            make.norm(T.ATTN_NORM, hp.n_embd, i),
            make.matrix(T.ATTN_Q, (q_dim, hp.n_embd), i, permute_heads=hp.n_head if llama else 0),
            make.matrix(T.ATTN_K, (kv_dim, hp.n_embd), i, permute_heads=hp.n_head_kv if llama else 0),
            make.matrix(T.ATTN_V, (kv_dim, hp.n_embd), i),
            make.matrix(T.ATTN_OUT, (hp.n_embd, q_dim), i),
        ]
        if not llama:
            specs += [make.norm(T.ATTN_Q_NORM, hp.head_dim, i), make.norm(T.ATTN_K_NORM, hp.head_dim, i)]
        specs.append(make.norm(T.FFN_NORM, hp.n_embd, i))
        specs += make.moe_ffn(i) if arch == "qwen3moe" else make.dense_ffn(i)
    return specs


def _hybrid_blocks(make: _Specs, arch: str) -> list[TensorSpec]:
    """qwen35moe and qwen35: each layer a Gated DeltaNet or a gated full-attention block, then the FFN (routed
    experts plus a gated shared expert, or dense); after the main layers the MTP layers (an attention layer with
    its input projection and norms), as llama.cpp's converter writes Qwen3.5."""
    hp, T = make.hp, MODEL_TENSOR
    specs: list[TensorSpec] = []
    for i, recurrent in enumerate(hp.recurrent_layers() + (False,) * hp.n_nextn):
        mtp = i >= hp.n_layer
        if mtp:
            specs.append(make.matrix(T.NEXTN_EH_PROJ, (hp.n_embd, 2 * hp.n_embd), i))
        specs.append(make.norm(T.ATTN_NORM, hp.n_embd, i))
        specs += _delta_net(make, i) if recurrent else _gated_attention(make, i)
        specs.append(make.norm(T.ATTN_POST_NORM, hp.n_embd, i))
        if arch == "qwen35moe":
            specs += make.moe_ffn(i) + [
                make.f32(T.FFN_GATE_INP_SHEXP, (1, hp.n_embd), 1 / math.sqrt(hp.n_embd), i),
                make.matrix(T.FFN_GATE_SHEXP, (hp.n_ff_shexp, hp.n_embd), i),
                make.matrix(T.FFN_UP_SHEXP, (hp.n_ff_shexp, hp.n_embd), i),
                make.matrix(T.FFN_DOWN_SHEXP, (hp.n_embd, hp.n_ff_shexp), i),
            ]
        else:
            specs += make.dense_ffn(i)
        if mtp:
            specs += [make.norm(T.NEXTN_ENORM, hp.n_embd, i), make.norm(T.NEXTN_HNORM, hp.n_embd, i),
                      make.norm(T.NEXTN_SHARED_HEAD_NORM, hp.n_embd, i)]
    return specs


def _gated_attention(make: _Specs, i: int) -> list[TensorSpec]:
    """Full attention whose Q projection also gives the sigmoid output gate: n_head * head_dim rows of each, per
    head query then gate."""
    hp, T = make.hp, MODEL_TENSOR
    q_dim, kv_dim = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
    return [
        make.matrix(T.ATTN_Q, (2 * q_dim, hp.n_embd), i),
        make.norm(T.ATTN_Q_NORM, hp.head_dim, i),
        make.matrix(T.ATTN_K, (kv_dim, hp.n_embd), i),
        make.norm(T.ATTN_K_NORM, hp.head_dim, i),
        make.matrix(T.ATTN_V, (kv_dim, hp.n_embd), i),
        make.matrix(T.ATTN_OUT, (hp.n_embd, q_dim), i),
    ]


def _delta_net(make: _Specs, i: int) -> list[TensorSpec]:
    """Gated DeltaNet: q, k (ssm_group_count heads of ssm_state_size) and v (ssm_time_step_rank heads) in one
    projection, the output gate z, per value head the decay input alpha and the write strength beta, the causal
    convolution over q, k and v, A (`ssm_a`), the dt bias, the gated RMS norm per value head, the output."""
    hp, T = make.hp, MODEL_TENSOR
    conv_dim = 2 * hp.ssm_group_count * hp.ssm_state_size + hp.ssm_inner_size
    n_v_heads = hp.ssm_time_step_rank
    return [
        make.f32(T.SSM_A, (n_v_heads,), SSM_A_LOG_SPREAD, i, suffix="", mean=SSM_A_LOG_MEAN, negative_exp=True),
        make.f32(T.SSM_CONV1D, (conv_dim, hp.ssm_conv_kernel), 1 / math.sqrt(hp.ssm_conv_kernel), i),
        make.f32(T.SSM_DT, (n_v_heads,), NORM_SPREAD, i, suffix=".bias", mean=1.0),
        make.matrix(T.SSM_ALPHA, (n_v_heads, hp.n_embd), i),
        make.matrix(T.SSM_BETA, (n_v_heads, hp.n_embd), i),
        make.matrix(T.ATTN_QKV, (conv_dim, hp.n_embd), i),
        make.matrix(T.ATTN_GATE, (hp.ssm_inner_size, hp.n_embd), i),
        make.norm(T.SSM_NORM, hp.ssm_inner_size // n_v_heads, i),
        make.matrix(T.SSM_OUT, (hp.n_embd, hp.ssm_inner_size), i),
    ]


def parameter_count(specs: list[TensorSpec]) -> int:
    return sum(math.prod(spec.shape) for spec in specs)


# --- metadata


def chat_template(family: str = "qwen3") -> str:
    """The chat template shipped with the package: Qwen3's, or Qwen3.5's for family "qwen35" (as Qwen publishes
    them)."""
    return importlib.resources.files("strata.modelgen").joinpath(f"{family}_chat_template.jinja").read_text("utf-8")


def _add_hparams(writer: GGUFWriter, arch: str, hp: HParams, n_vocab: int) -> None:
    if arch in HYBRID_ARCHS:
        _add_hybrid_hparams(writer, arch, hp)
        return
    writer.add_block_count(hp.n_layer)
    writer.add_context_length(hp.n_ctx_train)
    writer.add_embedding_length(hp.n_embd)
    writer.add_feed_forward_length(hp.n_ff)
    writer.add_head_count(hp.n_head)
    writer.add_head_count_kv(hp.n_head_kv)
    writer.add_key_length(hp.head_dim)
    writer.add_value_length(hp.head_dim)
    writer.add_rope_freq_base(hp.rope_base)
    writer.add_layer_norm_rms_eps(hp.rms_eps)
    writer.add_vocab_size(n_vocab)
    if arch == "llama":
        writer.add_rope_dimension_count(hp.head_dim)
    if arch == "qwen3moe":
        writer.add_expert_count(hp.n_expert)
        writer.add_expert_used_count(hp.n_expert_used)
        writer.add_expert_feed_forward_length(hp.n_ff_exp)


def _add_hybrid_hparams(writer: GGUFWriter, arch: str, hp: HParams) -> None:
    """The keys llama.cpp's converter writes for Qwen3.5: the MTP layers count in block_count; no vocab size; no
    dense FFN width for the MoE."""
    writer.add_block_count(hp.n_layer + hp.n_nextn)
    writer.add_context_length(hp.n_ctx_train)
    writer.add_embedding_length(hp.n_embd)
    if arch == "qwen35":
        writer.add_feed_forward_length(hp.n_ff)
    writer.add_head_count(hp.n_head)
    writer.add_head_count_kv(hp.n_head_kv)
    writer.add_rope_dimension_sections(list(hp.rope_sections))
    writer.add_rope_freq_base(hp.rope_base)
    writer.add_layer_norm_rms_eps(hp.rms_eps)
    writer.add_key_length(hp.head_dim)
    writer.add_value_length(hp.head_dim)
    if arch == "qwen35moe":
        writer.add_expert_count(hp.n_expert)
        writer.add_expert_used_count(hp.n_expert_used)
        writer.add_expert_feed_forward_length(hp.n_ff_exp)
        writer.add_expert_shared_feed_forward_length(hp.n_ff_shexp)
    if hp.n_nextn:
        writer.add_nextn_predict_layers(hp.n_nextn)
    writer.add_ssm_conv_kernel(hp.ssm_conv_kernel)
    writer.add_ssm_state_size(hp.ssm_state_size)
    writer.add_ssm_group_count(hp.ssm_group_count)
    writer.add_ssm_time_step_rank(hp.ssm_time_step_rank)
    writer.add_ssm_inner_size(hp.ssm_inner_size)
    recurrent = hp.recurrent_layers() + (False,) * hp.n_nextn
    writer.add_array(RECURRENT_LAYERS_KEY.format(arch=arch), list(recurrent))
    writer.add_full_attention_interval(hp.full_attention_interval)
    writer.add_rope_dimension_count(hp.rope_dims)


def add_vocab(writer: GGUFWriter, vocab: Vocab, family: str = "qwen3") -> None:
    """The `tokenizer.*` keys of `vocab` and the chat template of `family` ("qwen3", or "qwen35": the keys
    llama.cpp's converter writes from Qwen3.5's tokenizer files, without an eot key, llama.cpp finding <|im_end|>
    by its text, and with add_eos_token false)."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(list(vocab.tokens))
    writer.add_token_types(list(vocab.token_types))
    writer.add_token_merges(list(vocab.merges))
    # As Qwen3's own GGUFs: <|endoftext|> doubles as bos and pad but is not prepended; <|im_end|> ends a chat
    # turn (eos and eot). Readers treat <|endoftext|> as end of generation too, as llama.cpp does by name.
    endoftext, im_end = vocab.token_id(ENDOFTEXT), vocab.token_id(IM_END)
    writer.add_bos_token_id(endoftext)
    writer.add_pad_token_id(endoftext)
    writer.add_eos_token_id(im_end)
    if family == "qwen3":
        writer.add_eot_token_id(im_end)
    writer.add_add_bos_token(False)
    if family == "qwen35":
        writer.add_add_eos_token(False)
    writer.add_chat_template(chat_template(family))


# --- writing


def write_random_model(path: str | pathlib.Path, arch: str = "qwen3moe", size: str = "tiny", dtype: str = "f32",
                       vocab: str = "bytes", seed: int = 0, **overrides: float) -> pathlib.Path:
    """Write a GGUF model with random weights and return its path.

    Args:
        path: output file (overwritten).
        arch: "qwen3moe", "qwen3", "llama", "qwen35moe" or "qwen35".
        size: "tiny", "small" or "medium" (see `strata.modelgen.hparams`).
        dtype: "f32", "f16", "bf16", "q8_0", "q4_0" or "q4_k" (Q4_K_M-like mixture of Q4_K and Q6_K). Norms and
            the router stay F32 in every case.
        vocab: "bytes" (256 byte tokens, Qwen3's 26 added tokens, 3 whitespace merges) or "qwen" (Qwen's
            151936-entry vocabulary).
        seed: seed of `numpy.random.default_rng`.
        overrides: hyper-parameters replacing the table's (`n_layer`, `n_embd`, `n_expert`,
            `full_attention_interval`, `n_nextn`, ...).

    Raises:
        ValueError: unknown arch, size, dtype, vocab or hyper-parameter.
    """
    _check_arch(arch)
    hp = hparams_for(arch, size, **overrides)
    voc = get_vocab(vocab)
    rng = np.random.default_rng(seed)
    return _write(pathlib.Path(path), arch, hp, voc, dtype, f"strata-{arch}-{size}-random",
                  lambda spec: draw_encoded(spec, rng))


def write_model(path: str | os.PathLike[str], arch: str, hp: HParams, vocab: Vocab, weights: Mapping[str, np.ndarray],
                dtype: str = "f32", name: str = "strata", family: str | None = None) -> pathlib.Path:
    """Write a GGUF model with the given weights and return its path.

    Args:
        path: output file (overwritten).
        arch: "qwen3moe", "qwen3", "llama", "qwen35moe" or "qwen35".
        hp: its hyper-parameters.
        vocab: its vocabulary.
        weights: every tensor of `tensor_specs` by its GGUF name (`blk.0.attn_q.weight`, ...), float32 in numpy
            order and Hugging Face layout (llama's Q and K rows get permuted here); for the hybrids, the values the
            file stores (`hf_qwen35.gguf_weights_from_hf` makes them of a checkpoint's).
        dtype: as for `write_random_model`.
        name: `general.name`.
        family: the chat template's and tokenizer keys' family, "qwen3" or "qwen35" (default: the arch's, as
            `write_random_model` writes).

    Raises:
        ValueError: unknown arch or dtype, or weights missing, extra or of the wrong shape.
    """
    _check_arch(arch)
    specs = tensor_specs(arch, hp, vocab.n_vocab, dtype)
    expected = {spec.name: spec.shape for spec in specs}
    given = {key: tuple(np.shape(value)) for key, value in weights.items()}
    if given != expected:
        wrong = sorted(k for k in expected.keys() | given.keys() if given.get(k) != expected.get(k))
        details = ", ".join(f"{k} (expected {expected.get(k)}, given {given.get(k)})" for k in wrong[:5])
        raise ValueError(f"weights do not match the {arch} tensor table: {details}")
    return _write(pathlib.Path(path), arch, hp, vocab, dtype, name,
                  lambda spec: encode_given(np.asarray(weights[spec.name], np.float32), spec), family)


def encode_given(w: np.ndarray, spec: TensorSpec) -> np.ndarray:
    """A given float32 tensor encoded as `spec` says, as rows of bytes."""
    if spec.permute_heads:
        w = permute_llama_qk(w, spec.permute_heads)
    return quants.encode(w, spec.qtype)


def _check_arch(arch: str) -> None:
    if arch not in _ARCH:
        raise ValueError(f"unknown arch {arch!r}: one of {tuple(_ARCH)}")


def _write(path: pathlib.Path, arch: str, hp: HParams, voc: Vocab, dtype: str, name: str,
           encoded: Callable[[TensorSpec], np.ndarray], family: str | None = None) -> pathlib.Path:
    """Write the file, asking `encoded` for each tensor's bytes in file order."""
    specs = tensor_specs(arch, hp, voc.n_vocab, dtype)
    writer = GGUFWriter(path, MODEL_ARCH_NAMES[_ARCH[arch]])
    hybrid = arch in HYBRID_ARCHS
    if hybrid:  # as the converter writes every file
        writer.add_type(GGUFType.MODEL)
    writer.add_name(name)
    writer.add_file_type(_FILE_TYPE[dtype])
    if hybrid or dtype not in ("f32", "f16", "bf16"):
        writer.add_quantization_version(GGML_QUANT_VERSION)
    _add_hparams(writer, arch, hp, voc.n_vocab)
    add_vocab(writer, voc, family or ("qwen35" if hybrid else "qwen3"))
    # Tensor infos first, data streamed after: only one tensor is ever in memory.
    for spec in specs:
        shape = quants.byte_shape(spec.shape, spec.qtype)
        writer.add_tensor_info(spec.name, shape, np.dtype(np.uint8), math.prod(shape), raw_dtype=spec.qtype)
    try:
        writer.write_header_to_file(path)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for spec in specs:
            writer.write_tensor_data(encoded(spec))
    finally:
        writer.close()
    return path
