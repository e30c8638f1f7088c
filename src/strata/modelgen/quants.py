"""Tensor encodings for generated models: float types and Q8_0/Q4_0 through the `gguf` package, and our own
numpy quantisers for the K-quants Q4_K and Q6_K (the `gguf` package only dequantises those).

Block layouts (256 weights per super-block, little-endian), as ggml defines them:
  Q4_K (144 bytes): d f16, dmin f16, scales[12] (eight 6-bit scales and eight 6-bit mins, packed), qs[128]
                    (4-bit q, two sub-blocks of 32 per 32 bytes: low nibbles the first, high the second);
                    w = d * scale * q - dmin * min.
  Q6_K (210 bytes): ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] int8, d f16; w = d * scale * (q - 32).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

QK_K = 256
_GGUF_QUANTISED = (GGMLQuantizationType.BF16, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0)


def encode(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """`x` (float32, rows along the last axis) encoded as `qtype`, as raw bytes (uint8, rows of bytes)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if qtype == GGMLQuantizationType.F32:
        data = x
    elif qtype == GGMLQuantizationType.F16:
        data = x.astype(np.float16)
    elif qtype in _GGUF_QUANTISED:
        data = quants.quantize(x, qtype)
    elif qtype == GGMLQuantizationType.Q4_K:
        data = quantize_q4_k(x)
    elif qtype == GGMLQuantizationType.Q6_K:
        data = quantize_q6_k(x)
    else:
        raise ValueError(f"no encoder for {qtype.name}")
    return data.view(np.uint8).reshape(*x.shape[:-1], -1)


def byte_shape(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> tuple[int, ...]:
    """The shape of `encode`'s output for a float tensor of `shape`."""
    block, size = GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        raise ValueError(f"row length {shape[-1]} is not a multiple of {qtype.name}'s block of {block}")
    return (*shape[:-1], shape[-1] // block * size)


def _blocks(x: np.ndarray) -> np.ndarray:
    if x.shape[-1] % QK_K:
        raise ValueError(f"row length {x.shape[-1]} is not a multiple of {QK_K}")
    return x.reshape(-1, QK_K)


def _f16_round(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).astype(np.float32)


def _safe_div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den, 0 where den is 0 (all-zero blocks)."""
    return np.divide(num, den, out=np.zeros(np.broadcast_shapes(num.shape, den.shape), np.float32), where=den != 0)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Q4_K blocks of `x` (float32, rows a multiple of 256 long), as uint8 (n_blocks, 144).

    Per sub-block of 32: an asymmetric range [min(x, 0), max(x)] in 15 steps; the sub-block scales and mins are
    then themselves quantised to 6 bits against the super-block's d and dmin.
    """
    sub = _blocks(x).reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)  # (nb, 8); ggml keeps the zero point at or below 0
    hi = sub.max(axis=2)
    scale, mn = (hi - lo) / 15.0, -lo
    d = _f16_round(scale.max(axis=1) / 63.0)  # (nb,)
    dmin = _f16_round(mn.max(axis=1) / 63.0)
    sc = np.clip(np.rint(_safe_div(scale, d[:, None])), 0, 63).astype(np.uint8)  # (nb, 8)
    # Rounding the min up keeps x + min >= 0, so q never clips at the bottom.
    mq = np.clip(np.ceil(_safe_div(mn, dmin[:, None])), 0, 63).astype(np.uint8)
    step = (d[:, None] * sc)[:, :, None]
    offset = (dmin[:, None] * mq)[:, :, None]
    q = np.clip(np.rint(_safe_div(sub + offset, step)), 0, 15).astype(np.uint8)  # (nb, 8, 32)

    out = np.empty((sub.shape[0], 144), np.uint8)
    out[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    out[:, 2:4] = dmin.astype(np.float16).view(np.uint8).reshape(-1, 2)
    out[:, 4:16] = _pack_scale_min_k4(sc, mq)
    pairs = q.reshape(-1, 4, 2, 32)  # (nb, chunk, low/high nibble, 32)
    out[:, 16:144] = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    return out


def _pack_scale_min_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and eight 6-bit mins into 12 bytes: bytes 0-3 / 4-7 hold scales / mins 0-3 plus, in
    their top 2 bits, the top bits of scales / mins 4-7; bytes 8-11 hold the low 4 bits of scales and mins 4-7."""
    packed = np.empty((sc.shape[0], 12), np.uint8)
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    return packed


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K blocks of `x` (float32, rows a multiple of 256 long), as uint8 (n_blocks, 210).

    Per sub-block of 16: a symmetric scale mapping max |x| to 31 steps; the 16 scales are quantised to int8
    against the super-block's d.
    """
    sub = _blocks(x).reshape(-1, 16, 16)
    scale = np.abs(sub).max(axis=2) / 31.0  # (nb, 16)
    d = _f16_round(scale.max(axis=1) / 127.0)
    sc = np.clip(np.rint(_safe_div(scale, d[:, None])), 0, 127).astype(np.int8)
    step = (d[:, None] * sc)[:, :, None]
    q = (np.clip(np.rint(_safe_div(sub, step)), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)

    out = np.empty((sub.shape[0], 210), np.uint8)
    # Each half of 128 weights: quarters k = 0..3 of 32; ql byte l holds quarter 0 (low) and 2 (high), byte
    # 32 + l quarters 1 and 3; qh byte l holds the top 2 bits of all four quarters.
    ql = np.concatenate([(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
                         (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], axis=2)  # (nb, 2, 64)
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    out[:, 0:128] = ql.reshape(-1, 128)
    out[:, 128:192] = qh.reshape(-1, 64)
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return out


# --- random valid blocks (kernel tests and benchmarks)

# Byte offsets of each block's f16 scales (signed, then ones kept positive: mins are subtracted, as quantisers do).
_T = GGMLQuantizationType
_F16_SCALES = {
    _T.Q8_0: ([0], []), _T.Q4_0: ([0], []), _T.Q4_1: ([0, 2], []), _T.Q5_0: ([0], []), _T.Q5_1: ([0, 2], []),
    _T.IQ4_NL: ([0], []), _T.Q2_K: ([], [80, 82]), _T.Q3_K: ([108], []), _T.Q4_K: ([0], [2]), _T.Q5_K: ([0], [2]),
    _T.Q6_K: ([208], []), _T.IQ4_XS: ([0], []), _T.IQ3_S: ([0], []), _T.IQ3_XXS: ([0], []), _T.IQ2_XXS: ([0], []),
    _T.IQ2_XS: ([0], []), _T.IQ2_S: ([0], []), _T.IQ1_S: ([0], []), _T.IQ1_M: ([], []),
}


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def random_blocks(qtype: GGMLQuantizationType, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes for every field, with finite, sane f16 scales: (n_blocks, block_bytes) uint8."""
    size = GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)

    def scales() -> np.ndarray:
        return _f16_bytes(rng.uniform(1e-3, 2e-2, n_blocks) * rng.choice([-1, 1], n_blocks))

    signed, positive = _F16_SCALES.get(qtype, ([], []))
    for at in signed:
        blocks[:, at:at + 2] = scales()
    for at in positive:
        blocks[:, at:at + 2] = _f16_bytes(rng.uniform(1e-3, 2e-2, n_blocks))
    if qtype == _T.IQ1_M:  # the f16 scale lives in the top nibbles of the four 16-bit words at the end
        d = scales().view(np.uint16).ravel()
        words = blocks[:, -8:].copy().view(np.uint16) & np.uint16(0x0FFF)
        for k in range(4):
            words[:, k] |= ((d >> np.uint16(4 * k)) & np.uint16(0xF)) << np.uint16(12)
        blocks[:, -8:] = words.view(np.uint8)
    if qtype == _T.MXFP4:  # the shared exponent: 2^(e - 127) within a sane range
        blocks[:, 0] = rng.integers(110, 130, n_blocks)
    return blocks
