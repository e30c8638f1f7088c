"""Every device kernel against its reference kernel and the CPU engine, as one table (`scripts/gpu-check.sh`).

For each case the fast kernel, the reference kernel ("<name>_ref") and the CPU engine's result (the host
device's kernel: the engine's own product, or the C port of the reference) run on the same random inputs. A case
passes when the fast kernel is within the stated tolerance of both:

- products: the activations' quantisation bound of the kernel tests (tests/engine/test_kernels.py): each
  activation moves by less than one step amax / 127 of its block, so |dy| <= sum_i |w_i| step_i, counted once for
  the device's 32-value blocks and once for the CPU engine's own blocks (Q8_0's 32, Q8_K's 256), plus 1e-5 of
  sum |w x| for float accumulation in another order; F16 / BF16 (activations kept f32): the 1e-5 alone. That
  bound is a worst case, loose enough to hide a lost term; so each type also runs on "lossless" activations, which
  both quantisers represent exactly (integers up to 127 times a power of two, 127 in every 32-block), where the
  fast kernel must match the reference within the 1e-5 alone;
- RMS norm, RoPE, SwiGLU: 1e-5 of the magnitude of the terms (|x| s |w|, |x0| + |x1|, |g u|; RoPE's unturned
  values exactly);
- attention: 1e-5 of the largest |v| its head reads;
- KV rows stored: the CPU engine's bits (f32, f16 and int8 rows and their scales);
- rows added: 1e-5 of the sum of the terms' magnitudes;
- top-k: the same experts in the same order, weights within 1e-5;
- DeltaNet: the convolution within 1e-5 of sum_j |w_j| times the largest |x|, its conv state exactly (copied
  inputs); L2 norm within 1e-5 of the scale; the gates within 1e-5 of |a| (1 + |alpha + dt_bias|), beta within
  1e-6; the gated RMS norm within 1e-5 of each value's magnitude; the delta
  rule (outputs and the state after it) within 1e-5 of the largest |value| (at least 1): its recurrent form
  (`delta_rule`, the token loop) on decode (one token per sequence) and a prompt (sequences of ragged lengths), its
  chunked form (`delta_rule_chunked`) on the prompt, whose lengths cross the 64-token chunks (the CPU engine's
  chunked form and the reference's, in double, against the card's blocked products: the same sums in other
  orders);
- Qwen3.5's gates (x / (1 + e^-g): gated attention's per value, the shared expert's per row): 1e-5 of each value's
  magnitude;
- a layer's routed experts: the grouping by expert (each slot's place, each expert's run, the gathered rows)
  equal to numpy's stable sort; the product over every expert's run in one launch within the products' bound of
  the reference, the CPU engine and numpy (float64 over the dequantised weights), for every weight type.

GB/s is what the fast kernel moves (weights, inputs, outputs once) over its time by the device's events, the mean
of a few runs after a warm-up; "of peak" divides by the card's nominal memory bandwidth (its memory clock times
its bus width). The header gives beside it what a copy from one place of the device to another moves
(`copy_bandwidth`: bytes read plus bytes written), the bandwidth a kernel can reach in practice.

    python -m strata.engine_cffi.device_check --device cuda      # the full shapes (on a GPU)
    python -m strata.engine_cffi.device_check --device host --quick
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as Q

from strata.engine_cffi.device import Device, DeviceError
from strata.modelgen.quants import random_blocks

MATMUL_TYPES = (Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.MXFP4, Q.F32, Q.F16, Q.BF16)
# The CPU engine's activation block for each type's products (None: f32 activations); the device's is 32.
ENGINE_ACT_BLOCK = {Q.Q8_0: 32, Q.MXFP4: 32, Q.F32: None, Q.F16: None, Q.BF16: None} | dict.fromkeys(
    (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS), 256)
DEVICE_ACT_BLOCK = 32
RTOL = 1e-5
RULE_RTOL = 1e-5  # the delta rule (the CPU engine measured 7e-7 over 300 tokens of 128-wide heads)
D_CONV = 4
KV_TYPES = {"f32": 0, "f16": 1, "int8": 2}


@dataclass(frozen=True)
class Shapes:
    matmul: tuple[tuple[int, int, int], ...]  # (rows, n, n_tok)
    norm: tuple[int, int]                     # (n_tok, n)
    rope: tuple[int, int, int]                # (n_tok, n_head, head_dim)
    attention: tuple[int, int, int, int, int]  # (n_seq, n_head, n_head_kv, head_dim, n_ctx)
    swiglu: int
    topk: tuple[int, int, int]                # (n_tok, n_expert, k)
    add_rows: tuple[int, int, int]            # (n_tok, k, n)
    deltanet: tuple[int, int, int, int]       # (n_seq, n_k_heads, n_v_heads, head_dim), convolution of 4
    prompt: tuple[int, ...]                   # the tokens of each sequence of a prompt chunk
    moe: tuple[tuple[int, int, int, int, int], ...]  # (n_tok, n_expert, k, n, rows): a layer's routed experts
    copy: int                                 # bytes of the copy that measures the bandwidth


FULL = Shapes(matmul=((2048, 2048, 1), (11008, 4096, 1), (4096, 11008, 1), (2048, 2048, 64)), norm=(64, 4096),
              rope=(64, 32, 128), attention=(4, 32, 8, 128, 4096), swiglu=64 * 11008, topk=(64, 128, 8),
              add_rows=(64, 8, 4096), deltanet=(16, 16, 32, 128), prompt=(300, 129, 64, 1),
              moe=((1, 128, 8, 2048, 768), (64, 32, 8, 2048, 768)), copy=1 << 30)
QUICK = Shapes(matmul=((40, 512, 1), (24, 768, 9)), norm=(5, 256), rope=(3, 4, 64), attention=(2, 4, 2, 64, 48),
               swiglu=1000, topk=(6, 32, 4), add_rows=(5, 3, 300), deltanet=(3, 2, 4, 32), prompt=(70, 5, 1),
               moe=((1, 8, 2, 256, 40), (9, 8, 3, 256, 24)), copy=8 << 20)


@dataclass(frozen=True)
class Row:
    kernel: str
    type: str
    shape: str
    rel_ref: float   # max |fast - ref| / max |ref|
    rel_cpu: float   # max |fast - cpu| / max |cpu|
    passed: bool
    gbps: float
    peak: float      # gbps over the card's bandwidth, 0 unknown


@dataclass
class Case:
    kernel: str
    type: str
    shape: str
    args: Callable[[Device], dict[str, Any]]   # the launch's arguments on that device (its buffers made)
    out: Callable[[Device, dict[str, Any]], np.ndarray]  # the result, read back
    reset: Callable[[Device, dict[str, Any]], None]      # put in-place inputs back before a run
    tolerance: Callable[[np.ndarray], np.ndarray]        # the allowed |fast - other| per value, given other
    nbytes: int
    exact: Callable[[np.ndarray, np.ndarray], bool] | None = None  # what must agree exactly (top-k's ids)
    ref_tolerance: Callable[[np.ndarray], np.ndarray] | None = None  # against the reference, when tighter


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    scale = float(np.max(np.abs(b))) or 1.0
    return float(np.max(np.abs(a.astype(np.float64) - b))) / scale


def _buffers(arrays: dict[str, np.ndarray], outputs: dict[str, tuple[tuple[int, ...], Any]]) -> Callable:
    def make(dev: Device) -> dict[str, Any]:
        made = {name: dev.to_device(a) for name, a in arrays.items()}
        for name, (shape, dtype) in outputs.items():
            made[name] = dev.alloc(int(np.prod(shape)) * np.dtype(dtype).itemsize)
        return made
    return make


def _no_reset(dev: Device, args: dict[str, Any]) -> None:
    return None


# --- the cases


def random_weights(qtype: Q, rows: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, row_bytes) uint8 weights of `qtype`."""
    if qtype in (Q.F32, Q.F16):
        dtype = np.float32 if qtype == Q.F32 else np.float16
        return rng.standard_normal((rows, n), dtype=np.float32).astype(dtype).view(np.uint8)
    if qtype in (Q.BF16, Q.Q8_0):
        return quants.quantize(rng.standard_normal((rows, n), dtype=np.float32), qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    return random_blocks(qtype, rows * n // block, rng).reshape(rows, n // block * size)


def _act_bound(x: np.ndarray, aw: np.ndarray, block: int | None) -> np.ndarray:
    if block is None:
        return np.zeros((x.shape[0], aw.shape[0]))
    amax = np.abs(x).reshape(x.shape[0], -1, block).max(axis=2)
    return np.repeat(amax / 127.0, block, axis=1).astype(np.float64) @ aw.T


def matmul_tolerance(qtype: Q, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """(n_tok, rows): what two products of w and x may differ by when each quantises x its own way."""
    aw = np.abs(quants.dequantize(w, qtype).reshape(w.shape[0], x.shape[1]).astype(np.float64))
    bound = RTOL * (np.abs(x.astype(np.float64)) @ aw.T) + 1e-30
    if ENGINE_ACT_BLOCK[qtype] is not None:
        bound += _act_bound(x, aw, DEVICE_ACT_BLOCK) + _act_bound(x, aw, ENGINE_ACT_BLOCK[qtype])
    return bound


def lossless_activations(n_tok: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """(n_tok, n) activations that 32- and 256-value int8 blocks hold exactly: per 256 values one power of two
    times integers in [-127, 127], each 32 of them with a +-127."""
    q = rng.integers(-127, 128, size=(n_tok * n // 32, 32))
    q[:, 0] = rng.choice([-127, 127], size=q.shape[0])
    scale = np.repeat(2.0 ** rng.integers(-8, 1, size=(n_tok * n // 256, 1)), 8, axis=0)
    return (q * scale).astype(np.float32).reshape(n_tok, n)


def matmul_case(qtype: Q, rows: int, n: int, n_tok: int, rng: np.random.Generator, lossless: bool = False) -> Case:
    w = random_weights(qtype, rows, n, rng)
    x = lossless_activations(n_tok, n, rng) if lossless else rng.standard_normal((n_tok, n), dtype=np.float32)
    bound = matmul_tolerance(qtype, w, x)
    fixed = dict(type=int(qtype), n=n, rows=rows, n_tok=n_tok, row_bytes=w.shape[1])
    make = _buffers({"w": w, "x": x}, {"y": ((n_tok, rows), np.float32)})
    exact_bound = None
    if lossless:
        aw = np.abs(quants.dequantize(w, qtype).reshape(rows, n).astype(np.float64))
        tight = RTOL * (np.abs(x.astype(np.float64)) @ aw.T) + 1e-30
        exact_bound = lambda _: tight  # noqa: E731
    return Case("matmul", qtype.name, f"{rows}x{n} x{n_tok}" + (" lossless" if lossless else ""),
                lambda dev: fixed | make(dev), lambda dev, a: dev.to_host(a["y"], (n_tok, rows), np.float32),
                _no_reset, lambda _: bound, w.nbytes + x.nbytes + 4 * n_tok * rows, ref_tolerance=exact_bound)


def rms_norm_case(n_tok: int, n: int, rng: np.random.Generator) -> Case:
    x = (rng.standard_normal((n_tok, n)) * rng.uniform(0.1, 10, (n_tok, 1))).astype(np.float32)
    w = rng.uniform(0.5, 1.5, n).astype(np.float32)
    s = 1.0 / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=1, keepdims=True) + 1e-6)
    bound = RTOL * np.abs(x * s * w) + 1e-30
    make = _buffers({"x": x, "w": w}, {"out": ((n_tok, n), np.float32)})
    return Case("rms_norm", "f32", f"{n_tok}x{n}", lambda dev: dict(n=n, n_tok=n_tok, eps=1e-6) | make(dev),
                lambda dev, a: dev.to_host(a["out"], (n_tok, n), np.float32), _no_reset, lambda _: bound,
                8 * n_tok * n + 4 * n)


def rope_case(n_tok: int, n_head: int, hd: int, variant: str, rng: np.random.Generator) -> Case:
    """variant: normal (adjacent pairs), neox, mrope (NEOX, three sections), partial (NEOX on a quarter of each
    head, as Qwen3.5's attention: the rest must come back as it was)."""
    x = rng.standard_normal((n_tok, n_head, hd), dtype=np.float32)
    pos = np.repeat(rng.integers(0, 4096, (n_tok, 1)), 3, axis=1).astype(np.int32)
    rot = hd // 4 if variant == "partial" else hd
    axis = np.zeros(rot // 2, np.uint8)
    if variant == "mrope":  # three sections, interleaved as Qwen3-VL's (h on pairs 1, 4, ..., w on 2, 5, ...)
        pos[:, 1:] += rng.integers(0, 64, (n_tok, 2), dtype=np.int32)
        axis = np.array([i % 3 if i < 3 * (hd // 8) else 0 for i in range(hd // 2)], np.uint8)
    inv_freq = (1e6 ** (-np.arange(0, rot, 2) / rot)).astype(np.float32)
    neox = variant != "normal"
    a_idx = np.arange(rot // 2) if neox else 2 * np.arange(rot // 2)
    b_idx = a_idx + rot // 2 if neox else a_idx + 1
    pair = np.abs(x[..., a_idx]) + np.abs(x[..., b_idx])
    bound = np.zeros_like(x, dtype=np.float64)
    bound[..., a_idx], bound[..., b_idx] = RTOL * pair, RTOL * pair
    make = _buffers({"x": x, "pos": pos, "inv_freq": inv_freq, "axis": axis}, {})
    fixed = dict(n_tok=n_tok, n_head=n_head, head_dim=hd, neox=int(neox), n_rot=rot)

    def reset(dev: Device, a: dict[str, Any]) -> None:  # RoPE turns x in place
        dev.upload(a["x"], x)
        dev.sync()

    return Case("rope", variant, f"{n_tok}x{n_head}x{hd}", lambda dev: fixed | make(dev),
                lambda dev, a: dev.to_host(a["x"], x.shape, np.float32), reset, lambda _: bound, 8 * x.size)


def attention_case(n_seq: int, n_head: int, n_kv: int, hd: int, n_ctx: int, kv: str,
                   rng: np.random.Generator) -> Case:
    """Decode: one query token per sequence over the positions it holds, in layer 1 of a 2-layer cache, the first
    from position 0, the others from a later one (the MTP block's window)."""
    n_layer, il = 2, 1
    shape = (n_seq, n_layer, n_kv, n_ctx, hd)
    k32, v32 = (rng.standard_normal(shape, dtype=np.float32) for _ in range(2))
    k_scale = v_scale = np.ones(shape[:-1], np.float32)
    k: np.ndarray
    v: np.ndarray
    if kv == "f16":
        k, v = k32.astype(np.float16), v32.astype(np.float16)
        vmax = np.abs(v.astype(np.float32))
    elif kv == "int8":
        k_scale, v_scale = (np.abs(a).max(axis=-1) / 127 for a in (k32, v32))
        k, v = (np.round(a / s[..., None]).astype(np.int8) for a, s in ((k32, k_scale), (v32, v_scale)))
        vmax = np.abs(v * v_scale[..., None])
    else:
        k, v, vmax = k32, v32, np.abs(v32)
    q = rng.standard_normal((n_seq, n_head, hd), dtype=np.float32)
    seq = np.arange(n_seq, dtype=np.int32)[::-1].copy()
    n_pos = rng.integers(1, n_ctx + 1, n_seq).astype(np.int32)
    n_pos[0] = n_ctx
    first = np.where(np.arange(n_seq) > 0, n_pos // 2, 0).astype(np.int32)
    group = n_head // n_kv
    bound = np.empty((n_seq, n_head, hd))
    for t in range(n_seq):
        for h in range(n_head):
            bound[t, h] = RTOL * vmax[seq[t], il, h // group, first[t]:n_pos[t]].max()
    make = _buffers({"q": q, "k": k, "v": v, "k_scale": k_scale, "v_scale": v_scale, "seq": seq, "n_pos": n_pos,
                     "first": first}, {"out": (q.shape, np.float32)})
    fixed = dict(n_tok=n_seq, n_head=n_head, n_head_kv=n_kv, head_dim=hd, kv_type=KV_TYPES[kv], n_layer=n_layer,
                 il=il, n_ctx=n_ctx)
    read = int((n_pos - first).sum()) * n_kv * hd * k.itemsize * 2  # each token's K and V rows of every kv head
    return Case("attention", f"kv {kv}", f"{n_seq}x{n_head}/{n_kv}x{hd} ctx {n_ctx}", lambda dev: fixed | make(dev),
                lambda dev, a: dev.to_host(a["out"], q.shape, np.float32), _no_reset, lambda _: bound,
                read + 8 * q.size)


def swiglu_case(n: int, rng: np.random.Generator) -> Case:
    g = (rng.standard_normal(n) * 4).astype(np.float32)
    u = rng.standard_normal(n, dtype=np.float32)
    bound = RTOL * np.abs(g.astype(np.float64) * u) + 1e-30
    make = _buffers({"g": g, "u": u}, {"out": ((n,), np.float32)})
    return Case("swiglu", "f32", f"{n}", lambda dev: dict(n=n) | make(dev),
                lambda dev, a: dev.to_host(a["out"], (n,), np.float32), _no_reset, lambda _: bound, 12 * n)


def topk_case(n_tok: int, n_expert: int, k: int, rng: np.random.Generator) -> Case:
    logits = (rng.standard_normal((n_tok, n_expert)) * 2).astype(np.float32)
    make = _buffers({"logits": logits}, {"ids": ((n_tok, k), np.int32), "weights": ((n_tok, k), np.float32)})

    def out(dev: Device, a: dict[str, Any]) -> np.ndarray:  # ids then weights, side by side
        ids = dev.to_host(a["ids"], (n_tok, k), np.int32)
        return np.concatenate([ids.astype(np.float32), dev.to_host(a["weights"], (n_tok, k), np.float32)], axis=1)

    def same_ids(a: np.ndarray, b: np.ndarray) -> bool:
        return bool(np.array_equal(a[:, :k], b[:, :k]))

    bound = np.concatenate([np.zeros((n_tok, k)), np.full((n_tok, k), RTOL)], axis=1)
    return Case("topk", f"{n_expert} experts", f"{n_tok} x top-{k}",
                lambda dev: dict(n_tok=n_tok, n_expert=n_expert, k=k) | make(dev), out, _no_reset,
                lambda _: bound, logits.nbytes + 8 * n_tok * k, exact=same_ids)


def add_rows_case(n_tok: int, k: int, n: int, rng: np.random.Generator) -> Case:
    """A token's k experts mixed into its row: out += sum_j weight * y[idx] over slots in a shuffled order."""
    out0 = rng.standard_normal((n_tok, n), dtype=np.float32)
    y = rng.standard_normal((n_tok * k, n), dtype=np.float32)
    idx = rng.permutation(n_tok * k).astype(np.int32)
    weight = rng.uniform(0, 1, n_tok * k).astype(np.float32)
    terms = np.abs(out0.astype(np.float64)) + (np.abs(weight[:, None] * y[idx])).reshape(n_tok, k, n).sum(axis=1)
    bound = RTOL * terms + 1e-30
    make = _buffers({"out": out0, "y": y, "idx": idx, "weight": weight}, {})

    def reset(dev: Device, a: dict[str, Any]) -> None:  # it adds into out
        dev.upload(a["out"], out0)
        dev.sync()

    return Case("add_rows", "f32", f"{n_tok}x{k}x{n}", lambda dev: dict(n_tok=n_tok, k=k, n=n) | make(dev),
                lambda dev, a: dev.to_host(a["out"], (n_tok, n), np.float32), reset, lambda _: bound,
                8 * out0.size + 4 * out0.size * k)


def kv_store_case(n_seq: int, n_kv: int, hd: int, n_ctx: int, kv: str, rng: np.random.Generator) -> Case:
    """One token per sequence stored at a random position of layer 1 of a 2-layer cache; the whole cache (and
    the scales) read back, as raw bytes: every implementation must give the CPU engine's bits."""
    n_layer, rows = 2, n_seq * 2 * n_kv * n_ctx
    elem = {"f32": 4, "f16": 2, "int8": 1}[kv]
    k_in, v_in = (rng.standard_normal((n_seq, n_kv, hd), dtype=np.float32) * 3 for _ in range(2))
    seq = np.arange(n_seq, dtype=np.int32)[::-1].copy()
    pos = rng.integers(0, n_ctx, n_seq).astype(np.int32)
    make = _buffers({"k_in": k_in, "v_in": v_in, "seq": seq, "pos": pos},
                    {"k": ((rows * hd * elem,), np.uint8), "v": ((rows * hd * elem,), np.uint8),
                     "k_scale": ((rows,), np.float32), "v_scale": ((rows,), np.float32)})
    fixed = dict(n_tok=n_seq, n_head_kv=n_kv, head_dim=hd, kv_type=KV_TYPES[kv], n_layer=n_layer, il=1, n_ctx=n_ctx)

    def reset(dev: Device, a: dict[str, Any]) -> None:  # rows it does not write stay zero
        for name in ("k", "v", "k_scale", "v_scale"):
            dev.memset(a[name], 0, (rows * hd * elem) if name in ("k", "v") else 4 * rows)
        dev.sync()

    def args(dev: Device) -> dict[str, Any]:
        made = fixed | make(dev)
        reset(dev, made)
        return made

    def out(dev: Device, a: dict[str, Any]) -> np.ndarray:
        parts = [dev.to_host(a[name], (rows * hd * elem,), np.uint8) for name in ("k", "v")]
        scales = [dev.to_host(a[name], (rows,), np.float32).view(np.uint8) for name in ("k_scale", "v_scale")]
        return np.concatenate(parts + scales).astype(np.float32)

    return Case("kv_store", f"kv {kv}", f"{n_seq}x{n_kv}x{hd}", args, out, reset,
                lambda other: np.zeros(other.shape), 2 * k_in.nbytes + 2 * n_seq * n_kv * hd * elem)


# --- Gated DeltaNet


def _sequences(lengths: tuple[int, ...]) -> dict[str, np.ndarray]:
    """seq_first for sequences of `lengths` tokens, their state slots in reverse order (slot != index)."""
    first = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return {"seq_first": first, "seq": np.arange(len(lengths), dtype=np.int32)[::-1].copy()}


def _in_place(case_arrays: dict[str, np.ndarray], names: tuple[str, ...]) -> Callable[[Device, dict[str, Any]], None]:
    def reset(dev: Device, a: dict[str, Any]) -> None:
        for name in names:
            dev.upload(a[name], case_arrays[name])
        dev.sync()
    return reset


def dn_conv_case(lengths: tuple[int, ...], channels: int, rng: np.random.Generator) -> Case:
    """The convolution of a chunk's sequences from their conv states, slots state_stride apart (a gap after each
    state, as the CPU engine's delta-rule state follows it)."""
    n_tok, n_seq, k = sum(lengths), len(lengths), D_CONV
    stride = channels * (k - 1) + 5
    arrays = {"x": rng.standard_normal((n_tok, channels), dtype=np.float32),
              "w": rng.standard_normal((channels, k), dtype=np.float32) * 0.5,
              "state": rng.standard_normal((n_seq, stride), dtype=np.float32)} | _sequences(lengths)
    scale = RTOL * float(np.abs(arrays["w"]).sum(axis=1).max()) * float(max(np.abs(arrays["x"]).max(),
                                                                           np.abs(arrays["state"]).max()))
    bound = np.concatenate([np.full(n_tok * channels, scale), np.zeros(n_seq * stride)])
    make = _buffers(arrays, {"out": ((n_tok, channels), np.float32)})
    fixed = dict(n_seq=n_seq, d_conv=k, channels=channels, state_stride=stride)

    def out(dev: Device, a: dict[str, Any]) -> np.ndarray:  # the outputs, then every slot's state
        return np.concatenate([dev.to_host(a["out"], (n_tok * channels,), np.float32),
                               dev.to_host(a["state"], (n_seq * stride,), np.float32)])

    return Case("dn_conv", f"conv {k}", f"{n_seq} seqs {n_tok} tok x{channels}", lambda dev: fixed | make(dev), out,
                _in_place(arrays, ("state",)), lambda _: bound, 8 * n_tok * channels + 8 * n_seq * stride)


def l2_norm_case(n_tok: int, n_head: int, hd: int, rng: np.random.Generator) -> Case:
    """The q heads of rows twice as wide (the k heads after them stay as they are), scaled by 1/sqrt(hd)."""
    x = rng.standard_normal((n_tok, 2 * n_head * hd), dtype=np.float32) * 3
    scale = 1.0 / np.sqrt(hd)
    bound = np.full(x.size, RTOL * scale)
    make = _buffers({"x": x}, {})
    fixed = dict(n_tok=n_tok, n_head=n_head, head_dim=hd, row_stride=x.shape[1], scale=scale)
    return Case("l2_norm", "f32", f"{n_tok}x{n_head}x{hd}", lambda dev: fixed | make(dev),
                lambda dev, a: dev.to_host(a["x"], (x.size,), np.float32), _in_place({"x": x}, ("x",)),
                lambda _: bound, 4 * n_tok * n_head * hd)


def dn_gates_case(n_tok: int, n_head: int, rng: np.random.Generator) -> Case:
    """alpha + dt_bias across softplus's threshold of 20; g and beta read back side by side."""
    alpha = (rng.standard_normal((n_tok, n_head)) * 12).astype(np.float32)
    beta = (rng.standard_normal((n_tok, n_head)) * 4).astype(np.float32)
    a = -rng.uniform(0.1, 10, n_head).astype(np.float32)
    dt_bias = rng.standard_normal(n_head).astype(np.float32)
    g_bound = RTOL * np.abs(a) * (1 + np.abs(alpha.astype(np.float64) + dt_bias))
    bound = np.concatenate([g_bound, np.full(beta.shape, 1e-6)], axis=1)
    arrays = {"alpha": alpha, "beta": beta, "a": a, "dt_bias": dt_bias}

    def out(dev: Device, a: dict[str, Any]) -> np.ndarray:
        return np.concatenate([dev.to_host(a[n], alpha.shape, np.float32) for n in ("alpha", "beta")], axis=1)

    return Case("dn_gates", "f32", f"{n_tok}x{n_head}", lambda dev: dict(n_tok=n_tok, n_head=n_head) |
                _buffers(arrays, {})(dev), out, _in_place(arrays, ("alpha", "beta")), lambda _: bound,
                16 * alpha.size)


def delta_rule_inputs(n_tok: int, hk: int, hv: int, hd: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """q, k, v rows hv * hd wide (q and k heads in the first hk * hd), q and k heads L2-normed (q by 1/sqrt(hd)
    too) as the layer hands them over; decays and strengths of the models' range (g = -a softplus(.) < 0,
    beta = sigmoid(.))."""
    width = hv * hd
    rows = {}
    for name in ("q", "k", "v"):
        rows[name] = rng.standard_normal((n_tok, width), dtype=np.float32)
    for name, scale in (("q", 1.0 / np.sqrt(hd)), ("k", 1.0)):
        heads = rows[name][:, : hk * hd].reshape(n_tok, hk, hd)
        heads *= scale / np.linalg.norm(heads, axis=-1, keepdims=True)
        rows[name][:, : hk * hd] = heads.reshape(n_tok, hk * hd)
    rows["g"] = -rng.uniform(0.001, 2.0, (n_tok, hv)).astype(np.float32)
    rows["beta"] = rng.uniform(0.0, 1.0, (n_tok, hv)).astype(np.float32)
    return rows


def delta_rule_case(lengths: tuple[int, ...], hk: int, hv: int, hd: int, rng: np.random.Generator,
                    kernel: str = "delta_rule") -> Case:
    """The rule (`kernel`: its recurrent form or its chunked one) over a chunk's sequences from states left by
    earlier tokens, slots state_stride apart."""
    n_tok, n_seq = sum(lengths), len(lengths)
    stride = hv * hd * hd + 3
    arrays = delta_rule_inputs(n_tok, hk, hv, hd, rng) | _sequences(lengths)
    arrays["state"] = (0.1 * rng.standard_normal((n_seq, stride))).astype(np.float32)
    make = _buffers(arrays, {"out": ((n_tok, hv, hd), np.float32)})
    fixed = dict(n_seq=n_seq, n_k_heads=hk, n_v_heads=hv, head_dim=hd, row_stride=hv * hd, state_stride=stride)

    def out(dev: Device, a: dict[str, Any]) -> np.ndarray:  # the outputs, then every slot's state
        return np.concatenate([dev.to_host(a["out"], (n_tok * hv * hd,), np.float32),
                               dev.to_host(a["state"], (n_seq * stride,), np.float32)])

    form = "decode" if n_tok == n_seq else "prompt"
    return Case(kernel, form, f"{n_seq} seqs {n_tok} tok {hk}/{hv}x{hd}", lambda dev: fixed | make(dev), out,
                _in_place(arrays, ("state",)),
                lambda other: np.full(other.shape, RULE_RTOL * max(1.0, float(np.abs(other).max()))),
                8 * n_seq * stride + 4 * n_tok * (4 * hv * hd + 2 * hv))


def gated_rms_norm_case(n_rows: int, n: int, rng: np.random.Generator) -> Case:
    x = (rng.standard_normal((n_rows, n)) * rng.uniform(0.1, 10, (n_rows, 1))).astype(np.float32)
    z = (rng.standard_normal((n_rows, n)) * 3).astype(np.float32)
    w = rng.uniform(0.5, 1.5, n).astype(np.float32)
    x64, z64 = x.astype(np.float64), z.astype(np.float64)
    s = 1.0 / np.sqrt(np.mean(x64**2, axis=1, keepdims=True) + 1e-6)
    bound = RTOL * np.abs(x64 * s * w * z64 / (1 + np.exp(-z64))) + 1e-30
    make = _buffers({"x": x, "z": z, "w": w}, {"out": ((n_rows, n), np.float32)})
    return Case("gated_rms_norm", "f32", f"{n_rows}x{n}",
                lambda dev: dict(n=n, n_rows=n_rows, eps=1e-6) | make(dev),
                lambda dev, a: dev.to_host(a["out"], (n_rows, n), np.float32), _no_reset, lambda _: bound,
                12 * n_rows * n + 4 * n)


def sigmoid_gate_case(n_rows: int, n: int, per_value: bool, rng: np.random.Generator) -> Case:
    """Gated attention's (per value: each head's output by its gate, the gates every other head_dim values of a
    row twice as wide) or the shared expert's (one gate a row)."""
    gate_stride = 2 * n if per_value else 1
    x = (rng.standard_normal((n_rows, n)) * 3).astype(np.float32)
    gate = (rng.standard_normal(n_rows * gate_stride) * 4).astype(np.float32)
    g = gate.reshape(n_rows, gate_stride)[:, :n] if per_value else gate[:, None]
    bound = RTOL * np.abs(x / (1 + np.exp(-g.astype(np.float64)))) + 1e-30
    make = _buffers({"x": x, "gate": gate}, {})
    return Case("sigmoid_gate", "per value" if per_value else "per row", f"{n_rows}x{n}",
                lambda dev: dict(n=n, n_rows=n_rows, gate_stride=gate_stride, per_value=int(per_value)) | make(dev),
                lambda dev, a: dev.to_host(a["x"], (n_rows, n), np.float32), _in_place({"x": x}, ("x",)),
                lambda _: bound, 8 * x.size + 4 * g.size)


def deltanet_cases(shapes: Shapes, rng: np.random.Generator) -> Iterator[Case]:
    n_seq, hk, hv, hd = shapes.deltanet
    decode = (1,) * n_seq
    yield dn_conv_case(decode, (2 * hk + hv) * hd, rng)
    yield dn_conv_case(shapes.prompt, (2 * hk + hv) * hd, rng)
    yield l2_norm_case(n_seq, hk, hd, rng)
    yield dn_gates_case(max(n_seq, sum(shapes.prompt)), hv, rng)
    yield delta_rule_case(decode, hk, hv, hd, rng)
    yield delta_rule_case(shapes.prompt, hk, hv, hd, rng)
    yield delta_rule_case(shapes.prompt, hk, hv, hd, rng, "delta_rule_chunked")
    yield gated_rms_norm_case(n_seq * hv, hd, rng)


# --- a vision encoder's pieces (strata-vision --gpu)


@dataclass(frozen=True)
class VisionShapes:
    layer_norm: tuple[int, int]        # (n_tok, n)
    gelu: int
    vit_attention: tuple[tuple[int, int, int], ...]  # (n_tok, n_head, head_dim)


# A SigLIP-so400m-sized tower (width 1152, 16 heads of 72, MLP 4304) on 1024 patches; the quick shapes cross the
# fast attention kernel's tiles of 32 queries and keys and take heads that are not a multiple of 32.
VISION_SHAPES = {FULL: VisionShapes(layer_norm=(1024, 1152), gelu=1024 * 4304, vit_attention=((1024, 16, 72),)),
                 QUICK: VisionShapes(layer_norm=(5, 300), gelu=1000, vit_attention=((70, 2, 40), (33, 3, 16)))}


def layer_norm_case(n_tok: int, n: int, rng: np.random.Generator) -> Case:
    x = (rng.standard_normal((n_tok, n)) * rng.uniform(0.1, 10, (n_tok, 1)) + rng.uniform(-5, 5, (n_tok, 1)))
    x = x.astype(np.float32)
    w = rng.uniform(0.5, 1.5, n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    x64 = x.astype(np.float64)
    s = 1.0 / np.sqrt(np.var(x64, axis=1, keepdims=True) + 1e-6)
    # the mean is summed in f32: each value's error is of its row's largest |x| times s
    bound = RTOL * (np.abs(x64).max(axis=1, keepdims=True) * s * np.abs(w) + np.abs(b)) + 1e-30
    make = _buffers({"x": x, "w": w, "b": b}, {"out": ((n_tok, n), np.float32)})
    return Case("layer_norm", "f32", f"{n_tok}x{n}", lambda dev: dict(n=n, n_tok=n_tok, eps=1e-6) | make(dev),
                lambda dev, a: dev.to_host(a["out"], (n_tok, n), np.float32), _no_reset, lambda _: bound,
                8 * n_tok * n + 8 * n)


def gelu_case(n: int, erf: bool, rng: np.random.Generator) -> Case:
    x = (rng.standard_normal(n) * 4).astype(np.float32)
    bound = RTOL * np.abs(x.astype(np.float64)) + 1e-30
    make = _buffers({"x": x}, {"out": ((n,), np.float32)})
    return Case("gelu", "erf" if erf else "tanh", f"{n}", lambda dev: dict(n=n, erf=int(erf)) | make(dev),
                lambda dev, a: dev.to_host(a["out"], (n,), np.float32), _no_reset, lambda _: bound, 8 * n)


def vit_attention_case(n_tok: int, n_head: int, hd: int, rng: np.random.Generator) -> Case:
    """Every patch attending to every patch; scores of order a few, as a trained tower's."""
    q, k, v = (rng.standard_normal((n_tok, n_head, hd), dtype=np.float32) for _ in range(3))
    q *= np.float32(2.0 / np.sqrt(np.sqrt(hd)))
    bound = np.broadcast_to(RTOL * np.abs(v).max(axis=(0, 2))[None, :, None], q.shape)
    make = _buffers({"q": q, "k": k, "v": v}, {"out": (q.shape, np.float32)})
    return Case("vit_attention", "f32", f"{n_tok}x{n_head}x{hd}",
                lambda dev: dict(n_tok=n_tok, n_head=n_head, head_dim=hd) | make(dev),
                lambda dev, a: dev.to_host(a["out"], q.shape, np.float32), _no_reset, lambda _: bound,
                16 * q.size)


def vision_cases(shapes: VisionShapes, rng: np.random.Generator) -> Iterator[Case]:
    yield layer_norm_case(*shapes.layer_norm, rng)
    for erf in (False, True):
        yield gelu_case(shapes.gelu, erf, rng)
    for shape in shapes.vit_attention:
        yield vit_attention_case(*shape, rng)


def routing(n_tok: int, n_expert: int, k: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """k distinct experts per token, and the grouping numpy gives them (a stable sort of the slots by expert):
    ids (n_tok, k), slot_of (each slot's place), first and count (per expert)."""
    ids = np.argsort(rng.random((n_tok, n_expert)), axis=1)[:, :k].astype(np.int32)
    order = np.argsort(ids.reshape(-1), kind="stable")
    slot_of = np.empty(n_tok * k, np.int32)
    slot_of[order] = np.arange(n_tok * k)
    count = np.bincount(ids.reshape(-1), minlength=n_expert).astype(np.int32)
    first = (np.cumsum(count) - count).astype(np.int32)
    return ids, slot_of, first, count


def moe_group_case(n_tok: int, n_expert: int, k: int, n: int, rng: np.random.Generator) -> Case:
    """A chunk's slots grouped by expert: the places, the runs and the gathered rows, each equal to numpy's."""
    ids, slot_of, first, count = routing(n_tok, n_expert, k, rng)
    x = rng.standard_normal((n_tok, n), dtype=np.float32)
    x_out = np.empty((n_tok * k, n), np.float32)
    x_out[slot_of] = np.repeat(x, k, axis=0)
    want = np.concatenate([slot_of, first, count, x_out.reshape(-1)]).astype(np.float64)
    outputs = {"x_out": ((n_tok * k, n), np.float32), "slot_of": ((n_tok * k,), np.int32),
               "first": ((n_expert,), np.int32), "count": ((n_expert,), np.int32)}
    make = _buffers({"ids": ids, "x": x}, outputs)

    def out(dev: Device, a: dict[str, Any]) -> np.ndarray:
        return np.concatenate([dev.to_host(a[name], shape, dtype).reshape(-1).astype(np.float64)
                               for name, (shape, dtype) in (("slot_of", outputs["slot_of"]),
                                                            ("first", outputs["first"]),
                                                            ("count", outputs["count"]),
                                                            ("x_out", outputs["x_out"]))])

    return Case("moe_group", "i32", f"{n_tok}x{k} of {n_expert}, {n}",
                lambda dev: dict(n_tok=n_tok, k=k, n_expert=n_expert, n=n) | make(dev), out, _no_reset,
                lambda other: np.zeros(other.shape), 4 * (ids.size + x.size + x_out.size),
                exact=lambda a, b: bool(np.array_equal(a, b) and np.array_equal(a, want)))


def moe_matmul_case(qtype: Q, n_tok: int, n_expert: int, k: int, n: int, rows: int,
                    rng: np.random.Generator) -> Case:
    """Every expert's matrix times its run of the grouped rows, in one launch: the matrices at an offset into each
    expert's slot (after another matrix, as up and down lie after gate), reached through a table of the slots
    (NULL for the experts no token chose, which must not be read). Within the products' bound of the reference,
    the CPU engine and numpy (float64 over the dequantised weights)."""
    _, _, first, count = routing(n_tok, n_expert, k, rng)
    n_slots, used = n_tok * k, np.flatnonzero(count).tolist()
    w = {e: random_weights(qtype, rows, n, rng) for e in used}  # the others are never read: no slot
    row_bytes = w[used[0]].shape[1]
    offset, table = 64 * row_bytes, 8 * n_expert  # an unused matrix of 64 rows before each expert's
    slot_bytes = offset + rows * row_bytes
    x = rng.standard_normal((n_slots, n), dtype=np.float32)
    bound = np.empty((n_slots, rows))
    want = np.empty((n_slots, rows))
    for e in used:
        run = slice(int(first[e]), int(first[e] + count[e]))
        bound[run] = matmul_tolerance(qtype, w[e], x[run])
        we = quants.dequantize(w[e], qtype).reshape(rows, n).astype(np.float64)
        want[run] = x[run].astype(np.float64) @ we.T
    fixed = dict(type=int(qtype), n_expert=n_expert, n=n, rows=rows, max_rows=n_tok, n_slots=n_slots,
                 row_bytes=row_bytes, offset=offset)
    make = _buffers({"first": first, "count": count, "x": x}, {"y": ((n_slots, rows), np.float32)})

    def args(dev: Device) -> dict[str, Any]:
        """One allocation: the table of the slots' pointers, then the chosen experts' slots."""
        block = dev.alloc(table + len(used) * slot_bytes)
        at = {e: table + i * slot_bytes for i, e in enumerate(used)}
        base = int(dev.ffi.cast("uintptr_t", block))
        dev.upload(block, np.array([base + at[e] if e in at else 0 for e in range(n_expert)], np.uint64))
        for e in used:
            dev.upload(dev.ffi.cast("char *", block) + at[e] + offset, w[e])
        dev.sync()
        return fixed | make(dev) | {"slots": block}

    return Case("moe_matmul", qtype.name, f"{rows}x{n} x{n_tok}x{k} of {n_expert}", args,
                lambda dev, a: dev.to_host(a["y"], (n_slots, rows), np.float32), _no_reset, lambda _: bound,
                len(used) * rows * row_bytes + x.nbytes + 4 * n_slots * rows,
                exact=lambda a, _: bool(np.all(np.abs(a - want) <= bound)))


def cases(shapes: Shapes, rng: np.random.Generator) -> Iterator[Case]:
    """The cases, made one at a time (the full shapes' inputs take hundreds of MB each)."""
    for qtype in MATMUL_TYPES:
        for rows, n, n_tok in shapes.matmul:
            yield matmul_case(qtype, rows, n, n_tok, rng)
        yield matmul_case(qtype, *shapes.matmul[0], rng, lossless=True)
    yield rms_norm_case(*shapes.norm, rng)
    for variant in ("normal", "neox", "mrope", "partial"):
        yield rope_case(*shapes.rope, variant, rng)
    for kv in KV_TYPES:
        yield attention_case(*shapes.attention, kv, rng)
    yield swiglu_case(shapes.swiglu, rng)
    yield topk_case(*shapes.topk, rng)
    yield add_rows_case(*shapes.add_rows, rng)
    n_seq, _, n_kv, hd, n_ctx = shapes.attention
    for kv in KV_TYPES:  # the whole cache is compared: a short one
        yield kv_store_case(n_seq, n_kv, hd, min(n_ctx, 64), kv, rng)
    yield from deltanet_cases(shapes, rng)
    n_tok, n_head, hd = shapes.rope
    yield sigmoid_gate_case(n_tok * n_head, hd, True, rng)
    yield sigmoid_gate_case(*shapes.norm, False, rng)
    yield from vision_cases(VISION_SHAPES[shapes], rng)
    for n_tok, n_expert, k, n, rows in shapes.moe:
        yield moe_group_case(n_tok, n_expert, k, n, rng)
        for qtype in MATMUL_TYPES:
            yield moe_matmul_case(qtype, n_tok, n_expert, k, n, rows, rng)


# --- running a case


def _run(dev: Device, case: Case, name: str) -> np.ndarray:
    args = case.args(dev)
    try:
        dev.launch(name, **args)
        return case.out(dev, args)
    finally:
        free_args(dev, args)


def free_args(dev: Device, args: dict[str, Any]) -> None:
    """Free the device buffers among a case's launch arguments."""
    for value in args.values():
        if isinstance(value, dev.ffi.CData):
            dev.free(value)


def _timed(dev: Device, case: Case, runs: int) -> float:
    """Seconds per run of the fast kernel, the mean of `runs` after one warm-up."""
    args = case.args(dev)
    try:
        case.reset(dev, args)
        dev.launch(case.kernel, **args)
        start = dev.record()
        for _ in range(runs):
            dev.launch(case.kernel, **args)
        end = dev.record()
        dev.event_sync(end)
        return dev.elapsed_ms(start, end) / 1e3 / runs
    finally:
        free_args(dev, args)


def copy_bandwidth(dev: Device, nbytes: int, runs: int = 5) -> float:
    """Bytes a second that a copy of `nbytes` from one place of the device to another moves, each byte read once and
    written once (2 nbytes a copy), timed by the device's events: the mean of `runs` after a warm-up."""
    src, dst = dev.alloc(nbytes), dev.alloc(nbytes)
    try:
        dev.memset(src, 1, nbytes)
        dev.copy(dst, src, nbytes)
        start = dev.record()
        for _ in range(runs):
            dev.copy(dst, src, nbytes)
        end = dev.record()
        dev.event_sync(end)
        return 2 * nbytes * runs / max(dev.elapsed_ms(start, end) / 1e3, 1e-9)
    finally:
        dev.free(src)
        dev.free(dst)


def within(case: Case, fast: np.ndarray, other: np.ndarray, reference: bool = False) -> bool:
    if case.exact is not None and not case.exact(fast, other):
        return False
    tolerance = case.ref_tolerance if reference and case.ref_tolerance else case.tolerance
    return bool(np.all(np.abs(fast.astype(np.float64) - other) <= tolerance(other)))


def check_case(dev: Device, cpu: Device, case: Case, runs: int) -> Row:
    fast, ref = _run(dev, case, case.kernel), _run(dev, case, case.kernel + "_ref")
    on_cpu = _run(cpu, case, case.kernel)
    passed = within(case, fast, ref, reference=True) and within(case, fast, on_cpu)
    seconds = _timed(dev, case, runs)
    gbps = case.nbytes / seconds / 1e9 if seconds > 0 else 0.0
    peak = gbps * 1e9 / dev.bandwidth if dev.bandwidth else 0.0
    return Row(case.kernel, case.type, case.shape, _rel(fast, ref), _rel(fast, on_cpu), passed, gbps, peak)


def format_table(rows: list[Row], device: str, bandwidth: float, copied: float) -> str:
    peak = f"{bandwidth / 1e9:.0f} GB/s" if bandwidth else "unknown"
    lines = [f"device: {device} (memory bandwidth {peak}; a device-to-device copy {copied / 1e9:.0f} GB/s)",
             f"| {'kernel':<18} | {'type':<12} | {'shape':<28} | {'rel err vs ref':>14} | {'rel err vs CPU':>14} "
             f"| {'result':<6} | {'GB/s':>8} | {'of peak':>7} |",
             f"|{'-' * 20}|{'-' * 14}|{'-' * 30}|{'-' * 16}|{'-' * 16}|{'-' * 8}|{'-' * 10}|{'-' * 9}|"]
    for r in rows:
        frac = f"{100 * r.peak:.0f}%" if r.peak else "-"
        lines.append(f"| {r.kernel:<18} | {r.type:<12} | {r.shape:<28} | {r.rel_ref:>14.2e} | {r.rel_cpu:>14.2e} "
                     f"| {'pass' if r.passed else 'FAIL':<6} | {r.gbps:>8.1f} | {frac:>7} |")
    failed = sum(not r.passed for r in rows)
    lines.append(f"{len(rows) - failed} of {len(rows)} cases pass" + (f", {failed} FAIL" if failed else ""))
    return "\n".join(lines)


def run_checks(dev: Device, cpu: Device, shapes: Shapes, runs: int, seed: int = 0,
               progress: Callable[[Row], None] | None = None) -> list[Row]:
    rows = []
    for case in cases(shapes, np.random.default_rng(seed)):
        rows.append(check_case(dev, cpu, case, runs))
        if progress:
            progress(rows[-1])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m strata.engine_cffi.device_check",
                                     description="Every device kernel against its reference and the CPU engine.")
    parser.add_argument("--device", choices=("cuda", "host"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="small shapes (the test suite's)")
    parser.add_argument("--runs", type=int, default=10, help="timed runs of each fast kernel")
    args = parser.parse_args(argv)
    try:
        dev = Device(args.device)
    except DeviceError as exc:
        print(f"device_check: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    shapes = QUICK if args.quick else FULL
    with dev, Device("host") as cpu:
        rows = run_checks(dev, cpu, shapes, args.runs,
                          progress=lambda r: print(f"  {r.kernel} {r.type} {r.shape}: "
                                                   f"{'pass' if r.passed else 'FAIL'}", file=sys.stderr))
        copied = copy_bandwidth(dev, shapes.copy)
        print(format_table(rows, dev.name, dev.bandwidth, copied))
    print(f"({time.monotonic() - started:.0f} s)", file=sys.stderr)
    return 0 if all(r.passed for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
