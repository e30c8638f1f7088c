"""Qwen3.5/3.6's picture encoder as llama.cpp's converter writes it (`convert_hf_to_gguf.py --mmproj` on a
`Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration`): projector type `qwen3vl_merger`, the
tower of Qwen3-VL without its deepstack mergers (`clip.vision.is_deepstack_layers` all false). `strata.vision.qwen3vl`
runs it. `write_random_qwen35_mmproj` also writes Qwen3-VL's tower, deepstack mergers included, when given their
layers.

Tensors: the patch embedding's two temporal kernels (`v.patch_embd.weight`, `.weight.1`) and bias, the learned
positions, per block LayerNorms `ln1` / `ln2`, the fused `attn_qkv`, `attn_out`, `ffn_up` / `ffn_down`, then the
merger: `v.post_ln` on each patch, `mm.0` over the 2x2-merged token, GELU, `mm.2` to the text model's width. In an
F16 file every matrix and the patch kernels are F16; positions, norms and biases stay F32, as the converter does.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import gguf
import numpy as np

from strata.modelgen.mmproj import TensorDraws, VisionShape
from strata.vision.mmproj import VisionHParams, tensor_name
from strata.vision.qwen3vl import PROJECTOR_TYPE

_T = gguf.MODEL_TENSOR
PATCH_KERNEL_2 = tensor_name(_T.V_ENC_EMBD_PATCH) + ".1"  # the second temporal kernel
IMAGE_MEAN = IMAGE_STD = (0.5, 0.5, 0.5)  # Qwen's preprocessor's
MERGE = 2

SIZES = {
    "tiny": VisionShape(image_size=64, patch_size=16, n_embd=32, n_ff=64, n_head=2, n_layer=2),  # for fast tests
    "small": VisionShape(image_size=384, patch_size=16, n_embd=384, n_ff=1536, n_head=6, n_layer=6),  # tens of MB
}


def vision_hparams(shape: VisionShape, n_embd_text: int) -> VisionHParams:
    """The file's hyper-parameters for an encoder of `shape` feeding a text model of width `n_embd_text`."""
    return VisionHParams(
        image_size=shape.image_size, patch_size=shape.patch_size, n_embd=shape.n_embd, n_ff=shape.n_ff,
        n_head=shape.n_head, n_layer=shape.n_layer, eps=float(np.float32(shape.eps)), n_proj=n_embd_text,
        merge=MERGE, image_mean=IMAGE_MEAN, image_std=IMAGE_STD, projector=PROJECTOR_TYPE, variant="qwen3-vl")


def write_random_qwen35_mmproj(path: str | os.PathLike[str], n_embd_text: int, size: str | VisionShape = "tiny",
                               seed: int = 0, dtype: str = "f16", deepstack: tuple[int, ...] = ()) -> VisionHParams:
    """Write a Qwen3.5 encoder with random weights (every linear layer scaled by 1/sqrt(fan_in), residual branches
    by 1/sqrt(2 n_layer)); the same arguments write the same bytes. Returns the hyper-parameters written.

    With `deepstack` layers it is Qwen3-VL's tower instead: each of those layers' outputs has its own merger
    (`v.deepstack.L.*`: LayerNorm over the merged token, fc1, fc2), drawn after the rest."""
    hp = dataclasses.replace(vision_hparams(SIZES[size] if isinstance(size, str) else size, n_embd_text),
                             deepstack=deepstack)
    draw = TensorDraws(np.random.default_rng(seed), np.float32)
    n, p, merged = hp.n_embd, hp.patch_size, MERGE**2 * hp.n_embd
    branch_gain = 1.0 / np.sqrt(2 * hp.n_layer)
    kernel_std = 1.0 / np.sqrt(2 * 3 * p * p)  # a still picture is both frames: the kernels add up
    tensors = {
        tensor_name(_T.V_ENC_EMBD_PATCH): draw.normal((n, 3, p, p), kernel_std),
        PATCH_KERNEL_2: draw.normal((n, 3, p, p), kernel_std),
        tensor_name(_T.V_ENC_EMBD_PATCH, "bias"): draw.normal((n,), 0.02),
        tensor_name(_T.V_ENC_EMBD_POS): draw.normal((hp.pos_side**2, n), 0.5),
    }
    for bid in range(hp.n_layer):
        tensors |= draw.norm(_T.V_ENC_INPUT_NORM, n, bid)
        tensors |= draw.linear(_T.V_ENC_ATTN_QKV, bid, 3 * n, n)
        tensors |= draw.linear(_T.V_ENC_ATTN_O, bid, n, n, branch_gain)
        tensors |= draw.norm(_T.V_ENC_POST_ATTN_NORM, n, bid)
        tensors |= draw.linear(_T.V_ENC_FFN_UP, bid, hp.n_ff, n)
        tensors |= draw.linear(_T.V_ENC_FFN_DOWN, bid, n, hp.n_ff, branch_gain)
    tensors |= draw.norm(_T.V_POST_NORM, n)
    tensors |= draw.linear(_T.V_MMPROJ, 0, merged, merged)
    tensors |= draw.linear(_T.V_MMPROJ, 2, hp.n_proj, merged)
    for layer in deepstack:
        tensors |= draw.norm(_T.V_DS_NORM, merged, layer)
        tensors |= draw.linear(_T.V_DS_FC1, layer, merged, merged)
        tensors |= draw.linear(_T.V_DS_FC2, layer, hp.n_proj, merged)
    name = f"strata random Qwen3.5 vision encoder ({size if isinstance(size, str) else 'custom'})"
    write_qwen35_mmproj(path, hp, tensors, dtype, name)
    return hp


def write_qwen35_mmproj(path: str | os.PathLike[str], hp: VisionHParams, tensors: Mapping[str, np.ndarray],
                        dtype: str = "f16", name: str = "strata") -> None:
    """Write the encoder `hp` with the given float32 tensors (by file name, numpy layout: the patch kernels
    (n_embd, 3, p, p), matrices (n_out, n_in)).

    Raises:
        ValueError: another dtype than "f16" or "f32", or tensors missing, extra or misshapen.
    """
    if dtype not in ("f16", "f32"):
        raise ValueError(f"dtype must be 'f16' or 'f32', not {dtype!r}")
    expected = _shapes(hp)
    given = {key: tuple(np.shape(value)) for key, value in tensors.items()}
    if given != expected:
        wrong = sorted(k for k in expected.keys() | given.keys() if given.get(k) != expected.get(k))
        details = ", ".join(f"{k} (expected {expected.get(k)}, given {given.get(k)})" for k in wrong[:5])
        raise ValueError(f"tensors do not match the Qwen3.5 encoder's: {details}")
    writer = gguf.GGUFWriter(os.fspath(path), "clip")
    _add_metadata(writer, hp, name, dtype)
    for key, value in tensors.items():
        half = dtype == "f16" and np.ndim(value) >= 2 and key != tensor_name(_T.V_ENC_EMBD_POS)
        writer.add_tensor(key, np.asarray(value, np.float16 if half else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _shapes(hp: VisionHParams) -> dict[str, tuple[int, ...]]:
    n, p, merged = hp.n_embd, hp.patch_size, MERGE**2 * hp.n_embd
    shapes = {tensor_name(_T.V_ENC_EMBD_PATCH): (n, 3, p, p), PATCH_KERNEL_2: (n, 3, p, p),
              tensor_name(_T.V_ENC_EMBD_PATCH, "bias"): (n,), tensor_name(_T.V_ENC_EMBD_POS): (hp.pos_side**2, n)}

    def linear(kind: gguf.MODEL_TENSOR, bid: int | None, n_out: int, n_in: int) -> None:
        shapes[tensor_name(kind, "weight", bid)] = (n_out, n_in)
        shapes[tensor_name(kind, "bias", bid)] = (n_out,)

    def norm(kind: gguf.MODEL_TENSOR, bid: int | None = None) -> None:
        shapes[tensor_name(kind, "weight", bid)] = shapes[tensor_name(kind, "bias", bid)] = (n,)

    for bid in range(hp.n_layer):
        norm(_T.V_ENC_INPUT_NORM, bid)
        linear(_T.V_ENC_ATTN_QKV, bid, 3 * n, n)
        linear(_T.V_ENC_ATTN_O, bid, n, n)
        norm(_T.V_ENC_POST_ATTN_NORM, bid)
        linear(_T.V_ENC_FFN_UP, bid, hp.n_ff, n)
        linear(_T.V_ENC_FFN_DOWN, bid, n, hp.n_ff)
    norm(_T.V_POST_NORM)
    linear(_T.V_MMPROJ, 0, merged, merged)
    linear(_T.V_MMPROJ, 2, hp.n_proj, merged)
    for layer in hp.deepstack:
        for suffix in ("weight", "bias"):
            shapes[tensor_name(_T.V_DS_NORM, suffix, layer)] = (merged,)
        linear(_T.V_DS_FC1, layer, merged, merged)
        linear(_T.V_DS_FC2, layer, hp.n_proj, merged)
    return shapes


def _add_metadata(writer: gguf.GGUFWriter, hp: VisionHParams, name: str, dtype: str) -> None:
    """The keys the converter writes for a Qwen3.5 encoder (its layer-norm epsilon is the text model's)."""
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32)
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(hp.n_proj)
    writer.add_vision_image_size(hp.image_size)
    writer.add_vision_patch_size(hp.patch_size)
    writer.add_vision_embedding_length(hp.n_embd)
    writer.add_vision_feed_forward_length(hp.n_ff)
    writer.add_vision_block_count(hp.n_layer)
    writer.add_vision_head_count(hp.n_head)
    writer.add_vision_image_mean(list(hp.image_mean))
    writer.add_vision_image_std(list(hp.image_std))
    writer.add_clip_projector_type(PROJECTOR_TYPE)
    writer.add_vision_use_gelu(True)
    writer.add_vision_spatial_merge_size(hp.merge)
    writer.add_vision_attention_layernorm_eps(hp.eps)
    writer.add_vision_is_deepstack_layers([layer in hp.deepstack for layer in range(hp.n_layer)])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
