"""Random mmproj files (projector type `lfm2`) whose projection matches a text model's width.

The weights are random but well behaved: every linear layer is scaled by 1/sqrt(fan_in), so activations stay of
order one through the ViT and the projector, and attention is neither uniform nor one-hot.
"""

from __future__ import annotations

import dataclasses
import os

import gguf
import numpy as np

from strata.vision.mmproj import MM_DOWN_BID, MM_UP_BID, PROJECTOR_TYPE, VARIANT_KEY, VisionHParams, tensor_name

_T = gguf.MODEL_TENSOR

# CLIP's normalisation; any per-channel values would do, distinct ones make the tests see channel mix-ups.
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclasses.dataclass(frozen=True)
class VisionShape:
    """The sizes of a generated encoder; the projector's hidden width is the text model's width."""

    image_size: int
    patch_size: int
    n_embd: int
    n_ff: int
    n_head: int
    n_layer: int
    eps: float = 1e-6


SIZES = {
    "tiny": VisionShape(image_size=32, patch_size=8, n_embd=32, n_ff=64, n_head=2, n_layer=2),  # for fast tests
    "small": VisionShape(image_size=256, patch_size=16, n_embd=384, n_ff=1536, n_head=6, n_layer=6),  # tens of MB
}


def text_model_width(path: str | os.PathLike[str]) -> int:
    """The embedding width of a text model GGUF (`{arch}.embedding_length`): the projection an mmproj needs.

    Raises:
        ValueError: the file has no architecture or no embedding length.
    """
    return text_model_shape(path)[1]


def text_model_shape(path: str | os.PathLike[str]) -> tuple[str, int]:
    """The architecture and embedding width of a text model GGUF: which encoder fits it, and its projection.

    Raises:
        ValueError: the file has no architecture or no embedding length.
    """
    reader = gguf.GGUFReader(os.fspath(path))
    arch = reader.fields.get(gguf.Keys.General.ARCHITECTURE)
    if arch is None:
        raise ValueError(f"'{os.fspath(path)}' has no {gguf.Keys.General.ARCHITECTURE}")
    width = reader.fields.get(gguf.Keys.LLM.EMBEDDING_LENGTH.format(arch=arch.contents()))
    if width is None:
        raise ValueError(f"'{os.fspath(path)}' has no embedding length for architecture {arch.contents()!r}")
    return str(arch.contents()), int(width.contents())


def write_random_mmproj(
    path: str | os.PathLike[str],
    n_embd_text: int,
    size: str | VisionShape = "tiny",
    seed: int = 0,
    dtype: str = "f16",
    input_norm: bool = True,
    budget: tuple[int, int] | None = None,
    variant: str = "strata",
) -> VisionHParams:
    """Write an mmproj GGUF with random weights.

    Args:
        path: the file to write.
        n_embd_text: the text model's embedding width: the projector's output (clip.vision.projection_dim).
        size: "tiny", "small", or a VisionShape.
        seed: the random generator's seed; the same arguments write the same bytes.
        dtype: "f16" or "f32", the type of the weight matrices (vectors and position embeddings are F32).
        input_norm: whether the projector starts with a LayerNorm (mm.input_norm).
        budget: (min_tokens, max_tokens), written as the file's picture budget in pixels; None: no budget.
        variant: "strata" (this project's encoder, marked in the file) or "lfm2-vl" (run as LFM2-VL is; see
            `strata.vision.mmproj.VARIANTS`).

    Returns:
        The hyper-parameters written.
    """
    shape = SIZES[size] if isinstance(size, str) else size
    if dtype not in ("f16", "f32"):
        raise ValueError(f"dtype must be 'f16' or 'f32', not {dtype!r}")
    hp = VisionHParams(
        image_size=shape.image_size,
        patch_size=shape.patch_size,
        n_embd=shape.n_embd,
        n_ff=shape.n_ff,
        n_head=shape.n_head,
        n_layer=shape.n_layer,
        eps=_f32(shape.eps),
        n_proj=n_embd_text,
        merge=2,
        image_mean=_f32_triple(IMAGE_MEAN),
        image_std=_f32_triple(IMAGE_STD),
        min_pixels=budget[0] * (shape.patch_size * 2) ** 2 if budget else None,
        max_pixels=budget[1] * (shape.patch_size * 2) ** 2 if budget else None,
        variant=variant,
    )
    tensors = _random_tensors(hp, np.random.default_rng(seed), np.float16 if dtype == "f16" else np.float32, input_norm)
    writer = gguf.GGUFWriter(os.fspath(path), "clip")
    add_vision_metadata(writer, hp, f"strata random vision encoder ({size if isinstance(size, str) else 'custom'})")
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hp


def _f32_triple(values: tuple[float, float, float]) -> tuple[float, float, float]:
    return _f32(values[0]), _f32(values[1]), _f32(values[2])


def _f32(value: float) -> float:
    """`value` as the file stores it (float32), so the returned hyper-parameters equal what a reader gets."""
    return float(np.float32(value))


def add_vision_metadata(writer: gguf.GGUFWriter, hp: VisionHParams, name: str) -> None:
    """The `clip.*` keys of an mmproj with hyper-parameters `hp` (llama.cpp's names, our `lfm2` projector)."""
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_name(name)
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type(PROJECTOR_TYPE)
    writer.add_vision_image_size(hp.image_size)
    writer.add_vision_patch_size(hp.patch_size)
    writer.add_vision_embedding_length(hp.n_embd)
    writer.add_vision_feed_forward_length(hp.n_ff)
    writer.add_vision_projection_dim(hp.n_proj)
    writer.add_vision_block_count(hp.n_layer)
    writer.add_vision_head_count(hp.n_head)
    writer.add_vision_attention_layernorm_eps(hp.eps)
    writer.add_vision_image_mean(list(hp.image_mean))
    writer.add_vision_image_std(list(hp.image_std))
    writer.add_vision_projector_scale_factor(hp.merge)
    writer.add_vision_use_gelu(True)
    if hp.min_pixels is not None:
        writer.add_vision_min_pixels(hp.min_pixels)
    if hp.max_pixels is not None:
        writer.add_vision_max_pixels(hp.max_pixels)
    if hp.variant != "lfm2-vl":  # a file without the key is run as LFM2-VL
        writer.add_string(VARIANT_KEY, hp.variant)


class TensorDraws:
    """Random encoder tensors by file name, drawn from `rng` in call order: matrices in `wtype`, the rest float32."""

    def __init__(self, rng: np.random.Generator, wtype: type):
        self.rng, self.wtype = rng, wtype

    def normal(self, shape: tuple[int, ...], std: float, dtype: type = np.float32) -> np.ndarray:
        return (self.rng.standard_normal(shape) * std).astype(dtype)

    def linear(self, kind: gguf.MODEL_TENSOR, bid: int | None, n_out: int, n_in: int, gain: float = 1.0) -> dict:
        return {
            tensor_name(kind, "weight", bid): self.normal((n_out, n_in), gain / np.sqrt(n_in), self.wtype),
            tensor_name(kind, "bias", bid): self.normal((n_out,), 0.02),
        }

    def norm(self, kind: gguf.MODEL_TENSOR, n: int, bid: int | None = None) -> dict:
        return {
            tensor_name(kind, "weight", bid): 1.0 + self.normal((n,), 0.1),
            tensor_name(kind, "bias", bid): self.normal((n,), 0.05),
        }


def _random_tensors(hp: VisionHParams, rng: np.random.Generator, wtype: type,
                    input_norm: bool) -> dict[str, np.ndarray]:
    draw = TensorDraws(rng, wtype)
    n, p, merged = hp.n_embd, hp.patch_size, hp.merge**2 * hp.n_embd
    # Residual branches are scaled down so the residual stream grows slowly with depth.
    branch_gain = 1.0 / np.sqrt(2 * hp.n_layer)
    tensors = {
        tensor_name(_T.V_ENC_EMBD_PATCH): draw.normal((n, 3, p, p), 1.0 / np.sqrt(3 * p * p), wtype),
        tensor_name(_T.V_ENC_EMBD_PATCH, "bias"): draw.normal((n,), 0.02),
        tensor_name(_T.V_ENC_EMBD_POS): draw.normal((hp.pos_side**2, n), 0.5),
    }
    for bid in range(hp.n_layer):
        tensors |= draw.norm(_T.V_ENC_INPUT_NORM, n, bid)
        for kind in (_T.V_ENC_ATTN_Q, _T.V_ENC_ATTN_K, _T.V_ENC_ATTN_V):
            tensors |= draw.linear(kind, bid, n, n)
        tensors |= draw.linear(_T.V_ENC_ATTN_O, bid, n, n, branch_gain)
        tensors |= draw.norm(_T.V_ENC_POST_ATTN_NORM, n, bid)
        tensors |= draw.linear(_T.V_ENC_FFN_UP, bid, hp.n_ff, n)
        tensors |= draw.linear(_T.V_ENC_FFN_DOWN, bid, n, hp.n_ff, branch_gain)
    tensors |= draw.norm(_T.V_POST_NORM, n)
    if input_norm:
        tensors |= draw.norm(_T.V_MM_INP_NORM, merged)
    tensors |= draw.linear(_T.V_MMPROJ, MM_UP_BID, hp.n_proj, merged)
    tensors |= draw.linear(_T.V_MMPROJ, MM_DOWN_BID, hp.n_proj, hp.n_proj)
    return tensors
