"""Qwen3-VL's vision tower from an mmproj file of projector type `qwen3vl_merger`, as llama.cpp's converter writes it.

A ViT with 2-D rotary positions and learned position embeddings resized bilinearly (corners aligned), a fused QKV
projection, then a 2x2 patch merger (`v.post_ln` on each patch, `mm.0`, GELU, `mm.2`) and the "deepstack" mergers
of the layers `clip.vision.is_deepstack_layers` marks (`v.deepstack.L.*`: LayerNorm over the merged token, fc1,
GELU, fc2). As in llama.cpp, a token's row is the main merger's output followed by each deepstack merger's, in
layer order: `projection_dim * (1 + deepstack layers)` wide. docs/VISION.md lists the keys and tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import gguf
import numpy as np

from strata.vision import encoder as vit
from strata.vision.mmproj import (
    Linear,
    Matrix,
    MmprojError,
    Norm,
    VisionHParams,
    _Tensors,
    fingerprint,
    read_hparams,
    tensor_name,
)

PROJECTOR_TYPE = "qwen3vl_merger"
ROPE_THETA = 10000.0  # the tower's rotary base (Qwen3-VL's vision config; llama.cpp fixes it too)
_T = gguf.MODEL_TENSOR
_F32 = int(gguf.GGMLQuantizationType.F32)


@dataclasses.dataclass(frozen=True)
class Block:
    ln1: Norm
    qkv: Linear  # (3 n, n): q, k, v rows one after the other
    o: Linear
    ln2: Norm
    up: Linear
    down: Linear


@dataclasses.dataclass(frozen=True)
class Merger:
    norm: Norm  # over one patch (n) for the main merger, over the merged token (4 n) for a deepstack one
    fc1: Linear
    fc2: Linear


@dataclasses.dataclass(frozen=True)
class Qwen3VLMmproj:
    """A loaded `qwen3vl_merger` file; its matrices point into the reader's mapping (the patch weight excepted)."""

    path: str
    hparams: VisionHParams
    patch: Linear  # (n, 3 p p): the two temporal kernels summed, since a picture is its own second frame
    pos: np.ndarray  # float32 (pos_side**2, n)
    blocks: tuple[Block, ...]
    merger: Merger
    deepstack: dict[int, Merger]  # layer -> its merger, applied to that layer's output
    fingerprint: str
    reader: gguf.GGUFReader = dataclasses.field(repr=False, compare=False)

    @classmethod
    def build(cls, path: str, reader: gguf.GGUFReader) -> Qwen3VLMmproj:
        hp = read_hparams(reader)
        if hp.projector != PROJECTOR_TYPE:
            raise MmprojError(f"projector type {hp.projector!r} is not a {PROJECTOR_TYPE!r} file")
        check_hparams(hp)
        tensors = {t.name: t for t in reader.tensors}
        get = _Tensors(tensors, hp)
        n, p = hp.n_embd, hp.patch_size
        kernels = [tensor_name(_T.V_ENC_EMBD_PATCH), tensor_name(_T.V_ENC_EMBD_PATCH) + ".1"]
        patch = sum(get.floats(name, (n, 3, p, p)) for name in kernels)
        patch_w = np.ascontiguousarray(patch, dtype=np.float32).reshape(n, 3 * p * p)
        merged = hp.merge**2 * n

        def merger(norm_kind: _T, fc1: tuple[_T, int | None], fc2: tuple[_T, int | None], norm_width: int,
                   bid: int | None = None) -> Merger:
            up = get.linear(fc1[0], fc1[1], None, merged)
            down = get.linear(fc2[0], fc2[1], hp.n_proj, up.weight.n_rows)
            return Merger(get.norm(norm_kind, norm_width, bid), up, down)

        blocks = tuple(Block(
            ln1=get.norm(_T.V_ENC_INPUT_NORM, n, i), qkv=get.linear(_T.V_ENC_ATTN_QKV, i, 3 * n, n),
            o=get.linear(_T.V_ENC_ATTN_O, i, n, n), ln2=get.norm(_T.V_ENC_POST_ATTN_NORM, n, i),
            up=get.linear(_T.V_ENC_FFN_UP, i, hp.n_ff, n), down=get.linear(_T.V_ENC_FFN_DOWN, i, n, hp.n_ff),
        ) for i in range(hp.n_layer))
        return cls(
            path=path, hparams=hp,
            patch=Linear(Matrix(_F32, n, 3 * p * p, patch_w.view(np.uint8).reshape(-1)),
                         get.vector(tensor_name(_T.V_ENC_EMBD_PATCH, "bias"), n)),
            pos=get.floats(tensor_name(_T.V_ENC_EMBD_POS), (hp.pos_side**2, n)),
            blocks=blocks,
            merger=merger(_T.V_POST_NORM, (_T.V_MMPROJ, 0), (_T.V_MMPROJ, 2), n),
            deepstack={layer: merger(_T.V_DS_NORM, (_T.V_DS_FC1, layer), (_T.V_DS_FC2, layer), merged, layer)
                       for layer in hp.deepstack},
            fingerprint=fingerprint(hp, reader), reader=reader,
        )


def bilinear_corner_weights(n_in: int, n_out: int) -> np.ndarray:
    """(n_out, n_in) matrix of 1-D bilinear resampling with the corner samples aligned (torch's
    `interpolate(mode="bilinear", align_corners=True)`), as Qwen3-VL resizes its position embeddings."""
    weights = np.zeros((n_out, n_in), dtype=np.float64)
    for i in range(n_out):
        src = i * (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0
        lo = min(int(np.floor(src)), n_in - 1)
        hi = min(lo + 1, n_in - 1)
        weights[i, lo] += 1.0 - (src - lo)
        weights[i, hi] += src - lo
    return weights


def position_embeddings(pos: np.ndarray, side: int, gy: int, gx: int) -> np.ndarray:
    """The (side x side) grid of position embeddings resized to (gy x gx) bilinearly with the corners aligned:
    float32 (gy * gx, n_embd)."""
    n_embd = pos.shape[1]
    grid = pos.reshape(side, side * n_embd).astype(np.float64)
    rows = (bilinear_corner_weights(side, gy) @ grid).reshape(gy, side, n_embd)
    return (bilinear_corner_weights(side, gx) @ rows).reshape(gy * gx, n_embd).astype(np.float32)


def rope_frequencies(head_dim: int) -> np.ndarray:
    """The 2-D RoPE's frequencies theta^(-4j / d), j < d/4, float64 (d/4,): each axis turns a quarter of a head's
    pairs by them."""
    return ROPE_THETA ** (-np.arange(0, head_dim // 2, 2, dtype=np.float64) / (head_dim // 2))


def rope_2d(x: np.ndarray, gy: int, gx: int, n_head: int) -> np.ndarray:
    """Qwen3-VL's 2-D RoPE on q or k (gy * gx patches in row-major order, n_head * head_dim): pairs (i, i + d/2)
    rotate by row * f[i] for the first quarter of the head and by column * f[i - d/4] for the second, with
    f = theta^(-4j / d), j < d/4."""
    n, width = x.shape
    d = width // n_head
    inv = rope_frequencies(d)
    rows, cols = np.divmod(np.arange(n), gx)
    angles = np.concatenate([rows[:, None] * inv, cols[:, None] * inv], axis=1)  # (n, d/2)
    cos, sin = np.cos(angles).astype(np.float32)[:, None], np.sin(angles).astype(np.float32)[:, None]
    h = x.reshape(n, n_head, d)
    first, second = h[..., : d // 2], h[..., d // 2 :]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1).reshape(n, width)


class Qwen3VLEncoder(vit.Encoder):
    """Runs a `qwen3vl_merger` file on the CPU; the interface of `Encoder` (encode, n_embd, hp, mmproj)."""

    mmproj: Qwen3VLMmproj  # type: ignore[assignment]

    def __init__(self, mmproj: Qwen3VLMmproj, threads: int):
        super().__init__(mmproj, threads)  # type: ignore[arg-type]

    @property
    def n_embd(self) -> int:
        return self.hp.n_proj * (1 + len(self.hp.deepstack))

    def _linears(self) -> list[Linear]:
        m = self.mmproj
        mergers = [m.merger, *m.deepstack.values()]
        return [m.patch, *(lin for b in m.blocks for lin in (b.qkv, b.o, b.up, b.down)),
                *(lin for g in mergers for lin in (g.fc1, g.fc2))]

    def encode(self, pixels: np.ndarray, cancelled: Callable[[], bool] = vit._never) -> np.ndarray:
        hp, m = self.hp, self.mmproj
        _, height, width = pixels.shape
        if height % hp.unit or width % hp.unit:
            raise ValueError(f"picture {width}x{height} is not a multiple of {hp.unit} pixels per side")
        gy, gx = height // hp.patch_size, width // hp.patch_size
        x = self._linear(vit.patchify(pixels, hp.patch_size), m.patch, cancelled)
        x += position_embeddings(m.pos, hp.pos_side, gy, gx)
        outputs: list[np.ndarray] = []
        with vit._BLAS.limit(limits=1, user_api="blas"):
            for layer, block in enumerate(m.blocks):
                if cancelled():
                    raise vit.EncodeCancelled
                x = self._qwen_block(x, block, gy, gx, cancelled)
                if layer in m.deepstack:
                    outputs.append(self._merge(vit.pixel_unshuffle(x.reshape(gy, gx, -1), hp.merge),
                                               m.deepstack[layer], cancelled))
        main = vit.layer_norm(x, m.merger.norm, hp.eps).reshape(gy, gx, hp.n_embd)
        merged = vit.pixel_unshuffle(main, hp.merge)
        main_out = self._linear(vit.gelu_erf(self._linear(merged, m.merger.fc1, cancelled)), m.merger.fc2, cancelled)
        return np.concatenate([main_out, *outputs], axis=1)

    def _merge(self, tokens: np.ndarray, merger: Merger, cancelled: Callable[[], bool]) -> np.ndarray:
        h = vit.layer_norm(tokens, merger.norm, self.hp.eps)
        return self._linear(vit.gelu_erf(self._linear(h, merger.fc1, cancelled)), merger.fc2, cancelled)

    def _qwen_block(self, x: np.ndarray, block: Block, gy: int, gx: int,
                    cancelled: Callable[[], bool]) -> np.ndarray:
        hp = self.hp
        qkv = self._linear(vit.layer_norm(x, block.ln1, hp.eps), block.qkv, cancelled)
        q, k, v = np.split(qkv, 3, axis=1)
        q, k = rope_2d(q, gy, gx, hp.n_head), rope_2d(k, gy, gx, hp.n_head)
        x += self._linear(vit.attention(q, k, np.ascontiguousarray(v), hp.n_head, self._pool, cancelled), block.o,
                          cancelled)
        h = vit.layer_norm(x, block.ln2, hp.eps)
        x += self._linear(vit.gelu(self._linear(h, block.up, cancelled)), block.down, cancelled)
        return x


def check_hparams(hp: VisionHParams) -> None:
    if hp.merge != 2:
        raise MmprojError(f"spatial_merge_size {hp.merge} is not supported (2)")
    if (hp.n_embd // hp.n_head) % 4:
        raise MmprojError("the head size must be a multiple of 4 (two rotary axes)")
    if any(not 0 <= layer < hp.n_layer for layer in hp.deepstack):
        raise MmprojError(f"deepstack layers {hp.deepstack} outside the {hp.n_layer} layers")
