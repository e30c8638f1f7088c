"""mmproj GGUF files: llama.cpp's `clip.*` metadata and `v.*` / `mm.*` tensors, projector type `lfm2`.

The model is a SigLIP-style ViT (patch embedding, learned position embeddings, pre-LN blocks, post-layernorm)
followed by a 2x2 patch merge and an MLP projector (optional LayerNorm `mm.input_norm`, `mm.1`, GELU, `mm.2`).
Weights stay in the memory-mapped file: a matrix is handed to the C kernels as a pointer into the mapping.
docs/VISION.md lists every key and tensor.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable
from typing import Any, TypeVar

import gguf
import numpy as np

PROJECTOR_TYPE = "lfm2"
# How an `lfm2` file is run. "lfm2-vl" (a file without the key, as llama.cpp's converter writes LFM2-VL): as the
# checkpoint does, positions resized bilinearly with antialiasing, LFM2-VL's picture budget and grid rounding, erf
# GELU in the projector. "strata": this project's own encoder (the demo model was trained so), positions resized
# bicubically, tanh GELU throughout; our writers mark such files with the key.
VARIANT_KEY = "strata.vision.variant"
# The projectors strata-vision runs, and the variant a file of each type without the key is.
PROJECTORS = {PROJECTOR_TYPE: "lfm2-vl", "qwen3vl_merger": "qwen3-vl"}
VARIANTS = ("lfm2-vl", "strata", "qwen3-vl")
_T = gguf.MODEL_TENSOR
_K = gguf.Keys.ClipVision
_M = TypeVar("_M")
_FLOAT_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)


def tensor_name(kind: gguf.MODEL_TENSOR, suffix: str = "weight", bid: int | None = None) -> str:
    """The file's name for a tensor, e.g. `v.blk.3.attn_q.bias` for (V_ENC_ATTN_Q, "bias", 3)."""
    return f"{gguf.TENSOR_NAMES[kind].format(bid=bid)}.{suffix}"


# The projector's two linear layers are `mm.1` and `mm.2`, as in llama.cpp's lfm2 layout.
MM_UP_BID = 1
MM_DOWN_BID = 2


class MmprojError(Exception):
    """An mmproj file that cannot be read or is not a model this encoder runs; the message names the file."""


@dataclasses.dataclass(frozen=True)
class VisionHParams:
    """The encoder's hyper-parameters, from the `clip.vision.*` keys."""

    image_size: int  # the native picture side in pixels: position embeddings form a square grid of it
    patch_size: int
    n_embd: int
    n_ff: int
    n_head: int
    n_layer: int
    eps: float  # every LayerNorm's epsilon
    n_proj: int  # the projector's output width (the text model's embedding width)
    merge: int  # patches merged per side (2: a 2x2 pixel-unshuffle)
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    projector: str = PROJECTOR_TYPE
    # The picture budget the model was trained with (`clip.vision.image_min_pixels` / `image_max_pixels`), if the
    # file gives one: the encoder's default token budget.
    min_pixels: int | None = None
    max_pixels: int | None = None
    variant: str = "lfm2-vl"  # see VARIANTS
    deepstack: tuple[int, ...] = ()  # qwen3vl_merger: the layers whose outputs have their own merger

    @property
    def unit(self) -> int:
        """Pixels per merged token along a side."""
        return self.patch_size * self.merge

    @property
    def pos_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


@dataclasses.dataclass(frozen=True)
class Matrix:
    """A weight matrix (n_rows, n_cols) of GGML type `type`, its bytes still in the file's mapping."""

    type: int
    n_rows: int
    n_cols: int
    data: np.ndarray  # the mapped bytes, C-contiguous


@dataclasses.dataclass(frozen=True)
class Linear:
    weight: Matrix  # (n_out, n_in)
    bias: np.ndarray  # float32 (n_out,)


@dataclasses.dataclass(frozen=True)
class Norm:
    weight: np.ndarray  # float32 (n,)
    bias: np.ndarray  # float32 (n,)


@dataclasses.dataclass(frozen=True)
class Block:
    ln1: Norm
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    ln2: Norm
    up: Linear  # (n_ff, n_embd)
    down: Linear  # (n_embd, n_ff)


@dataclasses.dataclass(frozen=True)
class Mmproj:
    """A loaded mmproj file. Keep it alive while its matrices are in use: they point into its mapping."""

    path: str
    hparams: VisionHParams
    patch: Linear  # (n_embd, 3 * patch_size**2), columns in (channel, row, column) order
    pos: np.ndarray  # float32 (pos_side**2, n_embd), row-major over the square grid
    blocks: tuple[Block, ...]
    post_ln: Norm
    input_norm: Norm | None  # over the merged width merge**2 * n_embd
    mm_up: Linear  # (n_hidden, merge**2 * n_embd)
    mm_down: Linear  # (n_proj, n_hidden)
    fingerprint: str  # "sha256:<hex>" of the hyper-parameters and every tensor's name, type, shape and bytes
    reader: gguf.GGUFReader = dataclasses.field(repr=False, compare=False)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Mmproj:
        """Map and check an mmproj file.

        Raises:
            MmprojError: the file is missing, not GGUF, not a vision projector of type lfm2, or a tensor is
                missing or misshapen; the message names the file.
        """
        return open_mmproj(path, build_lfm2)


def open_mmproj(path: str | os.PathLike[str], build: Callable[[str, gguf.GGUFReader], _M]) -> _M:
    """`build(path, reader)` on the mapped file; every error is an MmprojError naming the file."""
    path = os.fspath(path)
    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise MmprojError(f"cannot load mmproj '{path}': {exc}") from None
    try:
        return build(path, reader)
    except MmprojError as exc:
        raise MmprojError(f"cannot load mmproj '{path}': {exc}") from None


def build_lfm2(path: str, reader: gguf.GGUFReader) -> Mmproj:
    hp = read_hparams(reader)
    if hp.projector != PROJECTOR_TYPE:
        raise MmprojError(f"projector type {hp.projector!r} is not an {PROJECTOR_TYPE!r} file")
    tensors = {t.name: t for t in reader.tensors}
    get = _Tensors(tensors, hp)
    merged = hp.merge**2 * hp.n_embd
    patch_w = get.matrix(tensor_name(_T.V_ENC_EMBD_PATCH), (hp.n_embd, 3, hp.patch_size, hp.patch_size))
    if patch_w.type not in _FLOAT_TYPES:
        raise MmprojError(f"{tensor_name(_T.V_ENC_EMBD_PATCH)} must be F32, F16 or BF16")
    mm_up = get.linear(_T.V_MMPROJ, MM_UP_BID, None, merged)
    has_norm = tensor_name(_T.V_MM_INP_NORM) in tensors
    return Mmproj(
        path=path,
        hparams=hp,
        patch=Linear(patch_w, get.vector(tensor_name(_T.V_ENC_EMBD_PATCH, "bias"), hp.n_embd)),
        pos=get.floats(tensor_name(_T.V_ENC_EMBD_POS), (hp.pos_side**2, hp.n_embd)),
        blocks=tuple(_block(get, hp, i) for i in range(hp.n_layer)),
        post_ln=get.norm(_T.V_POST_NORM, hp.n_embd),
        input_norm=get.norm(_T.V_MM_INP_NORM, merged) if has_norm else None,
        mm_up=mm_up,
        mm_down=get.linear(_T.V_MMPROJ, MM_DOWN_BID, hp.n_proj, mm_up.weight.n_rows),
        fingerprint=fingerprint(hp, reader),
        reader=reader,
    )


def _block(get: _Tensors, hp: VisionHParams, bid: int) -> Block:
    n, ff = hp.n_embd, hp.n_ff
    return Block(
        ln1=get.norm(_T.V_ENC_INPUT_NORM, n, bid),
        q=get.linear(_T.V_ENC_ATTN_Q, bid, n, n),
        k=get.linear(_T.V_ENC_ATTN_K, bid, n, n),
        v=get.linear(_T.V_ENC_ATTN_V, bid, n, n),
        o=get.linear(_T.V_ENC_ATTN_O, bid, n, n),
        ln2=get.norm(_T.V_ENC_POST_ATTN_NORM, n, bid),
        up=get.linear(_T.V_ENC_FFN_UP, bid, ff, n),
        down=get.linear(_T.V_ENC_FFN_DOWN, bid, n, ff),
    )


class _Tensors:
    """Looks tensors up by name and checks their shapes (given in numpy order, outermost first)."""

    def __init__(self, tensors: dict[str, Any], hp: VisionHParams):
        self._tensors = tensors
        self._hp = hp

    def _get(self, name: str, shape: tuple[int | None, ...]) -> Any:
        tensor = self._tensors.get(name)
        if tensor is None:
            raise MmprojError(f"tensor {name} is missing")
        numpy_shape = tuple(int(d) for d in reversed(tensor.shape))
        if len(numpy_shape) != len(shape) or any(
            want is not None and got != want for got, want in zip(numpy_shape, shape, strict=True)
        ):
            raise MmprojError(f"tensor {name} has shape {numpy_shape}, expected {shape}")
        return tensor

    def matrix(self, name: str, shape: tuple[int | None, ...]) -> Matrix:
        tensor = self._get(name, shape)
        numpy_shape = tuple(int(d) for d in reversed(tensor.shape))
        raw = tensor.data.view(np.uint8).reshape(-1)
        return Matrix(int(tensor.tensor_type), numpy_shape[0], int(np.prod(numpy_shape[1:])), raw)

    def floats(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        tensor = self._get(name, shape)
        if tensor.tensor_type == gguf.GGMLQuantizationType.F32:
            return np.asarray(tensor.data, dtype=np.float32).reshape(shape)
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        return np.asarray(values, dtype=np.float32).reshape(shape)

    def vector(self, name: str, n: int) -> np.ndarray:
        return self.floats(name, (n,))

    def norm(self, kind: gguf.MODEL_TENSOR, n: int, bid: int | None = None) -> Norm:
        return Norm(self.vector(tensor_name(kind, "weight", bid), n), self.vector(tensor_name(kind, "bias", bid), n))

    def linear(self, kind: gguf.MODEL_TENSOR, bid: int | None, n_out: int | None, n_in: int) -> Linear:
        weight = self.matrix(tensor_name(kind, "weight", bid), (n_out, n_in))
        return Linear(weight, self.vector(tensor_name(kind, "bias", bid), weight.n_rows))


# --- metadata


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise MmprojError(f"metadata key {key} is missing")
        return default
    return field.contents()


def read_hparams(reader: gguf.GGUFReader) -> VisionHParams:
    """The encoder's hyper-parameters from the file's metadata.

    Raises:
        MmprojError: a missing key, another projector type, or inconsistent sizes.
    """
    projector = _field(reader, gguf.Keys.ClipVision.PROJECTOR_TYPE, "") or _field(
        reader, gguf.Keys.Clip.PROJECTOR_TYPE, "(none)"
    )
    if projector not in PROJECTORS:
        raise MmprojError(f"projector type {projector!r} is not supported (this encoder runs "
                          f"{', '.join(map(repr, PROJECTORS))})")
    if not _field(reader, gguf.Keys.Clip.HAS_VISION_ENCODER, False):
        raise MmprojError("the file has no vision encoder (clip.has_vision_encoder)")
    hp = VisionHParams(
        image_size=int(_field(reader, _K.IMAGE_SIZE)),
        patch_size=int(_field(reader, _K.PATCH_SIZE)),
        n_embd=int(_field(reader, _K.EMBEDDING_LENGTH)),
        n_ff=int(_field(reader, _K.FEED_FORWARD_LENGTH)),
        n_head=int(_field(reader, _K.Attention.HEAD_COUNT)),
        n_layer=int(_field(reader, _K.BLOCK_COUNT)),
        eps=float(_field(reader, _K.Attention.LAYERNORM_EPS, 1e-6)),
        n_proj=int(_field(reader, _K.PROJECTION_DIM)),
        merge=int(_field(reader, _K.Projector.SCALE_FACTOR if projector == PROJECTOR_TYPE else _K.SPATIAL_MERGE_SIZE,
                         2)),
        image_mean=_triple(_field(reader, _K.IMAGE_MEAN), _K.IMAGE_MEAN),
        image_std=_triple(_field(reader, _K.IMAGE_STD), _K.IMAGE_STD),
        min_pixels=_optional_int(reader, _K.IMAGE_MIN_PIXELS),
        max_pixels=_optional_int(reader, _K.IMAGE_MAX_PIXELS),
        projector=projector,
        variant=str(_field(reader, VARIANT_KEY, PROJECTORS[projector])),
        deepstack=tuple(i for i, on in enumerate(_field(reader, _K.IS_DEEPSTACK_LAYERS, [])) if on),
    )
    _check(hp)
    return hp


def _optional_int(reader: gguf.GGUFReader, key: str) -> int | None:
    field = reader.fields.get(key)
    return None if field is None else int(field.contents())


def _triple(values: Any, key: str) -> tuple[float, float, float]:
    if not isinstance(values, list) or len(values) != 3:
        raise MmprojError(f"{key} must hold 3 numbers")
    return (float(values[0]), float(values[1]), float(values[2]))


def _check(hp: VisionHParams) -> None:
    sizes = (hp.image_size, hp.patch_size, hp.n_embd, hp.n_ff, hp.n_head, hp.n_layer, hp.n_proj, hp.merge)
    if min(sizes) <= 0:
        raise MmprojError(f"hyper-parameters must be positive: {hp}")
    if hp.image_size % hp.patch_size or hp.n_embd % hp.n_head:
        raise MmprojError("image_size must be a multiple of patch_size and embedding_length of head_count")
    if hp.variant not in VARIANTS or (hp.variant == "qwen3-vl") != (hp.projector != PROJECTOR_TYPE):
        raise MmprojError(f"{VARIANT_KEY} {hp.variant!r} is not a variant of projector type {hp.projector!r}")
    if min(hp.image_std) <= 0:
        raise MmprojError(f"image_std must be positive: {hp.image_std}")
    for name in ("min_pixels", "max_pixels"):
        if (getattr(hp, name) or 1) < 1:
            raise MmprojError(f"image_{name} must be positive: {getattr(hp, name)}")


def fingerprint(hp: VisionHParams, reader: gguf.GGUFReader) -> str:
    """A hash of everything the embeddings depend on: hyper-parameters, then each tensor's name, type, shape, bytes."""
    digest = hashlib.sha256()
    digest.update(json.dumps(dataclasses.asdict(hp), sort_keys=True).encode())
    for tensor in sorted(reader.tensors, key=lambda t: t.name):
        shape = ",".join(str(int(d)) for d in tensor.shape)
        digest.update(f"\0{tensor.name}\0{int(tensor.tensor_type)}\0{shape}\0".encode())
        digest.update(np.ascontiguousarray(tensor.data).view(np.uint8).reshape(-1).data)
    return "sha256:" + digest.hexdigest()
