"""The image encoder's forward pass: ViT, 2x2 patch merge, MLP projector.

Every weight product runs on the engine's C kernels (`strata_matmul`), reading the matrices in place in the
mapped mmproj file. LayerNorm, GELU and attention are numpy; attention is split into tiles that run on the
encoder's own threads, with numpy's BLAS held to one thread (threadpoolctl) so the two do not multiply.
A cancellation check runs before each layer, each slice of a weight product and each attention tile.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor

import gguf
import numpy as np
from threadpoolctl import ThreadpoolController

from strata.engine_cffi._engine import ffi, lib
from strata.vision.mmproj import Block, Linear, Mmproj, MmprojError, Norm

_BLAS = ThreadpoolController()
# Rows of one slice of a weight product: the cancellation check runs between slices, so a CANCEL stops an encode
# within one slice (tens of milliseconds), not only at the next layer boundary.
SLICE_ROWS = 512


def _never() -> bool:
    return False


class EncodeCancelled(Exception):
    """The cancellation check said stop; raised at a layer boundary."""


class Encoder:
    """Runs one mmproj file's encoder on the CPU.

    Args:
        mmproj: the loaded file; it must stay open as long as the encoder is used.
        threads: threads for the C kernels' products and for the attention tiles.

    Raises:
        MmprojError: a weight type the C kernels do not read.
    """

    def __init__(self, mmproj: Mmproj, threads: int):
        if threads < 1:
            raise ValueError("threads must be at least 1")
        self.mmproj = mmproj
        self.hp = mmproj.hparams
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="attention")
        for linear in self._linears():
            if not lib.strata_type_supported(linear.weight.type):
                name = gguf.GGMLQuantizationType(linear.weight.type).name
                raise MmprojError(f"'{mmproj.path}': weight type {name} is not supported by the kernels")

    @property
    def n_embd(self) -> int:
        """The width of the embeddings this encoder produces (the text model's width)."""
        return self.hp.n_proj

    def encode(self, pixels: np.ndarray, cancelled: Callable[[], bool] = _never) -> np.ndarray:
        """Embeddings (n_tokens, n_embd) of normalised pixels (3, H, W), rows in row-major merged-grid order.

        H and W must be multiples of patch_size * merge.

        Raises:
            EncodeCancelled: `cancelled()` returned true. It is called from this thread and the attention
                threads before each layer, each slice of a weight product and each attention tile.
        """
        return self.project(self.vit(pixels, cancelled), cancelled)

    def vit(self, pixels: np.ndarray, cancelled: Callable[[], bool] = _never) -> np.ndarray:
        """The ViT's output after its post-layernorm: float32 (gy, gx, n_embd) over the patch grid."""
        hp = self.hp
        _, height, width = pixels.shape
        unit = hp.patch_size * hp.merge
        if height % unit or width % unit:
            raise ValueError(f"picture {width}x{height} is not a multiple of {unit} pixels per side")
        gy, gx = height // hp.patch_size, width // hp.patch_size
        # patch embedding (a convolution with stride = kernel, as a product) plus positions resized to the grid
        x = self._linear(patchify(pixels, hp.patch_size), self.mmproj.patch, cancelled)
        x += position_embeddings(self.mmproj.pos, hp.pos_side, gy, gx, antialiased=hp.variant == "lfm2-vl")
        with _BLAS.limit(limits=1, user_api="blas"):
            for block in self.mmproj.blocks:
                if cancelled():
                    raise EncodeCancelled
                x = self._block(x, block, cancelled)
        return layer_norm(x, self.mmproj.post_ln, hp.eps).reshape(gy, gx, hp.n_embd)

    def project(self, features: np.ndarray, cancelled: Callable[[], bool] = _never) -> np.ndarray:
        """Merge each 2x2 patch square and project: (gy, gx, n_embd) -> (gy/2 * gx/2, n_proj)."""
        x = pixel_unshuffle(features, self.hp.merge)
        lfm2_vl = self.hp.variant == "lfm2-vl"
        if self.mmproj.input_norm is not None:  # LFM2-VL's is a default nn.LayerNorm: eps 1e-5
            x = layer_norm(x, self.mmproj.input_norm, 1e-5 if lfm2_vl else self.hp.eps)
        x = self._linear(x, self.mmproj.mm_up, cancelled)
        x = gelu_erf(x) if lfm2_vl else gelu(x)
        return self._linear(x, self.mmproj.mm_down, cancelled)

    def _block(self, x: np.ndarray, block: Block, cancelled: Callable[[], bool]) -> np.ndarray:
        eps = self.hp.eps
        # attention branch: x += o(attention(q, k, v of ln1(x)))
        h = layer_norm(x, block.ln1, eps)
        q, k, v = (self._linear(h, lin, cancelled) for lin in (block.q, block.k, block.v))
        x += self._linear(attention(q, k, v, self.hp.n_head, self._pool, cancelled), block.o, cancelled)
        # MLP branch: x += down(gelu(up(ln2(x))))
        h = layer_norm(x, block.ln2, eps)
        x += self._linear(gelu(self._linear(h, block.up, cancelled)), block.down, cancelled)
        return x

    def _linears(self) -> list[Linear]:
        """Every weight product's matrix (their types are checked at construction)."""
        m = self.mmproj
        blocks = [lin for b in m.blocks for lin in (b.q, b.k, b.v, b.o, b.up, b.down)]
        return [m.patch, *blocks, m.mm_up, m.mm_down]

    def _linear(self, x: np.ndarray, linear: Linear, cancelled: Callable[[], bool]) -> np.ndarray:
        """x (n, n_in) @ W^T + b on the C kernels, SLICE_ROWS rows of x at a time."""
        w = linear.weight
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.shape[1] != w.n_cols:
            raise ValueError(f"input width {x.shape[1]} for a weight of {w.n_cols} columns")
        y = np.empty((x.shape[0], w.n_rows), dtype=np.float32)
        weight = ffi.cast("const void *", w.data.ctypes.data)
        for r in range(0, x.shape[0], SLICE_ROWS):
            if cancelled():
                raise EncodeCancelled
            rows = min(SLICE_ROWS, x.shape[0] - r)
            status = lib.strata_matmul(
                w.type, weight, w.n_rows, w.n_cols, ffi.cast("const float *", x[r:].ctypes.data), rows,
                ffi.cast("float *", y[r:].ctypes.data), self.threads,
            )
            if status != lib.STRATA_OK:
                raise RuntimeError(f"strata_matmul: {ffi.string(lib.strata_status_string(status)).decode()}")
        y += linear.bias
        return y


# --- the steps, as plain functions of arrays


def patchify(pixels: np.ndarray, p: int) -> np.ndarray:
    """(3, H, W) -> (H/p * W/p, 3 * p * p): patches in row-major grid order, each in (channel, row, column) order."""
    c, height, width = pixels.shape
    gy, gx = height // p, width // p
    patches = pixels.reshape(c, gy, p, gx, p).transpose(1, 3, 0, 2, 4)
    return np.ascontiguousarray(patches).reshape(gy * gx, c * p * p)


def bicubic_weights(n_in: int, n_out: int) -> np.ndarray:
    """(n_out, n_in) matrix of 1-D bicubic resampling with half-pixel centres (align_corners=False), the cubic
    convolution kernel with a = -0.75, and sample indices clamped at the edges.

    These are the conventions of SigLIP's position-embedding interpolation (torch's bicubic resize).
    """
    a = -0.75
    weights = np.zeros((n_out, n_in), dtype=np.float64)
    for i in range(n_out):
        src = (i + 0.5) * n_in / n_out - 0.5
        base = int(np.floor(src))
        t = src - base
        # distances of the four taps base-1 .. base+2 from src
        for tap, d in zip(range(base - 1, base + 3), (1 + t, t, 1 - t, 2 - t), strict=True):
            if d <= 1:
                w = ((a + 2) * d - (a + 3)) * d * d + 1
            else:
                w = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
            weights[i, min(max(tap, 0), n_in - 1)] += w
    return weights


def bilinear_antialiased_weights(n_in: int, n_out: int) -> np.ndarray:
    """(n_out, n_in) matrix of 1-D bilinear resampling with antialiasing, half-pixel centres: the triangle filter
    widened by the reduction factor when shrinking, taps outside the input dropped and the rest renormalised.

    These are the conventions of torch's `interpolate(mode="bilinear", align_corners=False, antialias=True)`, which
    SigLIP2 (LFM2-VL's vision tower) resizes its position embeddings with.
    """
    scale = n_in / n_out
    support = max(scale, 1.0)  # the filter's half-width in input samples
    weights = np.zeros((n_out, n_in), dtype=np.float64)
    for i in range(n_out):
        centre = scale * (i + 0.5)
        lo, hi = max(int(centre - support + 0.5), 0), min(int(centre + support + 0.5), n_in)
        taps = np.maximum(0.0, 1.0 - np.abs((np.arange(lo, hi) - centre + 0.5) / support))
        weights[i, lo:hi] = taps / taps.sum()
    return weights


def position_embeddings(pos: np.ndarray, side: int, gy: int, gx: int, antialiased: bool = False) -> np.ndarray:
    """The (side x side) grid of position embeddings resized to (gy x gx): float32 (gy * gx, n_embd); bicubic, or
    with `antialiased` bilinear with antialiasing (both are the identity on the native grid)."""
    n_embd = pos.shape[1]
    if (gy, gx) == (side, side):
        return pos
    resample = bilinear_antialiased_weights if antialiased else bicubic_weights
    grid = pos.reshape(side, side * n_embd).astype(np.float64)
    rows = (resample(side, gy) @ grid).reshape(gy, side, n_embd)  # resized along y
    resized = resample(side, gx) @ rows  # then along x: (gy, gx, n_embd)
    return resized.reshape(gy * gx, n_embd).astype(np.float32)


def layer_norm(x: np.ndarray, norm: Norm, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    var = np.mean(centred * centred, axis=-1, keepdims=True)
    return centred / np.sqrt(var + eps) * norm.weight + norm.bias


def gelu(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (SigLIP's gelu_pytorch_tanh)."""
    return 0.5 * x * (1.0 + np.tanh(np.float32(np.sqrt(2.0 / np.pi)) * (x + np.float32(0.044715) * x * x * x)))


def gelu_erf(x: np.ndarray) -> np.ndarray:
    """GELU, exact (erf): LFM2-VL's projector activation ("gelu")."""
    return (0.5 * x * (1.0 + _erf(x * np.float32(0.5**0.5)))).astype(np.float32, copy=False)


def _erf(x: np.ndarray) -> np.ndarray:
    """erf to within 1.5e-7 (Abramowitz and Stegun 7.1.26), below float32's resolution of GELU's output."""
    a = np.abs(x).astype(np.float64)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return (np.sign(x) * (1.0 - poly * np.exp(-a * a))).astype(np.float32)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_head: int, pool: Executor,
              cancelled: Callable[[], bool] = _never, block: int = 256) -> np.ndarray:
    """Bidirectional multi-head attention: (n, n_embd) each -> (n, n_embd).

    Work is split into tiles of one head and `block` query rows, run on `pool`: a (block, n) score tile stays in
    cache through the softmax's passes, memory stays bounded for any picture size, and the tiles spread over the
    encoder's threads (numpy releases the GIL in them). Once `cancelled()` is true the remaining tiles are skipped.

    Raises:
        EncodeCancelled: `cancelled()` returned true.
    """
    n, n_embd = q.shape
    head_dim = n_embd // n_head
    qh = np.ascontiguousarray((q * np.float32(head_dim**-0.5)).reshape(n, n_head, head_dim).transpose(1, 0, 2))
    kt = np.ascontiguousarray(k.reshape(n, n_head, head_dim).transpose(1, 2, 0))  # (n_head, head_dim, n)
    vh = np.ascontiguousarray(v.reshape(n, n_head, head_dim).transpose(1, 0, 2))  # (n_head, n, head_dim)
    out = np.empty((n, n_head, head_dim), dtype=np.float32)

    def tile(h: int, r: int) -> bool:
        if cancelled():
            return False
        scores = qh[h, r : r + block] @ kt[h]  # (block, n)
        scores -= scores.max(axis=1, keepdims=True)
        np.exp(scores, out=scores)
        # normalise after the product: fewer divisions than dividing the scores
        out[r : r + block, h] = (scores @ vh[h]) / scores.sum(axis=1, keepdims=True)
        return True

    futures = [pool.submit(tile, h, r) for h in range(n_head) for r in range(0, n, block)]
    # Invariant: every tile has returned before this function does, cancelled or not (a list, not a generator).
    if not all([future.result() for future in futures]):  # noqa: C419 - see the invariant above
        raise EncodeCancelled
    return out.reshape(n, n_embd)


def pixel_unshuffle(features: np.ndarray, merge: int) -> np.ndarray:
    """(gy, gx, n) -> (gy/m * gx/m, m * m * n): each m x m square of patches concatenated in row-major order."""
    gy, gx, n = features.shape
    squares = features.reshape(gy // merge, merge, gx // merge, merge, n).transpose(0, 2, 1, 3, 4)
    return np.ascontiguousarray(squares).reshape((gy // merge) * (gx // merge), merge * merge * n)
