"""The device interface (cuda/device.h) on the host device: every kernel against numpy and the CPU engine, the
interface's bookkeeping (memory against the budget, streams, events), the check driver's table, and the CUDA
sources compiling with no warnings where nvcc is present.

On the host device "matmul" is the CPU engine's product (activations quantised as the engine does) and
"matmul_ref" the engine's naive reference, so both must give the engine's bits; the other kernels are C ports of
the reference kernels, checked against numpy in float64 with the driver's tolerances.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants
from strata.engine_cffi._engine import ffi, lib

from strata.engine_cffi import backend_check, device_check
from strata.engine_cffi.device import Device, DeviceError, DeviceUnavailable, interface

ROOT = Path(__file__).parents[2]
CUDA_DIR = ROOT / "src" / "strata" / "engine_cffi" / "cuda"


@pytest.fixture
def dev():
    with Device("host", budget=1 << 26) as d:
        yield d


def engine_matmul(qtype: Q, w: np.ndarray, x: np.ndarray, naive: bool) -> np.ndarray:
    (n_tok, n), rows = x.shape, w.shape[0]
    y = np.empty((n_tok, rows), np.float32)
    args = (int(qtype), ffi.from_buffer(w), rows, n, ffi.from_buffer("float[]", x), n_tok,
            ffi.from_buffer("float[]", y))
    assert (lib.strata_matmul_naive(*args) if naive else lib.strata_matmul(*args, 1)) == lib.STRATA_OK
    return y


def run(dev: Device, name: str, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray], **fixed) -> None:
    """Launch `name` on copies of inputs, filling the arrays of outputs (in place)."""
    ptrs = {k: dev.to_device(v) for k, v in inputs.items()} | {k: dev.alloc(v.nbytes) for k, v in outputs.items()}
    dev.launch(name, **fixed, **ptrs)
    for k, v in outputs.items():
        dev.download(v, ptrs[k])
    dev.sync()
    for p in ptrs.values():
        dev.free(p)


# --- kernels against the CPU engine and numpy


@pytest.mark.parametrize("qtype", device_check.MATMUL_TYPES)
@pytest.mark.parametrize("rows,n,n_tok", [(33, 256, 1), (7, 512, 6)])
def test_matmul_gives_the_cpu_engines_bits_and_is_within_the_quantisation_bound(dev, qtype, rows, n, n_tok):
    rng = np.random.default_rng(int(qtype) * 10 + n_tok)
    w = device_check.random_weights(qtype, rows, n, rng)
    x = rng.standard_normal((n_tok, n), dtype=np.float32)
    got = {}
    for name, naive in (("matmul", False), ("matmul_ref", True)):
        got[name] = np.full((n_tok, rows), np.nan, np.float32)
        run(dev, name, {"w": w, "x": x}, {"y": got[name]}, type=int(qtype), n=n, rows=rows, n_tok=n_tok,
            row_bytes=w.shape[1])
        np.testing.assert_array_equal(got[name], engine_matmul(qtype, w, x, naive))
    w64 = quants.dequantize(w, qtype).reshape(rows, n).astype(np.float64)
    exact = x.astype(np.float64) @ w64.T
    assert np.all(np.abs(got["matmul"] - exact) <= device_check.matmul_tolerance(qtype, w, x))
    assert np.all(np.abs(got["matmul_ref"] - exact) <= 1e-6 * (np.abs(x) @ np.abs(w64).T) + 1e-30)


def test_rms_norm_matches_numpy(dev):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((4, 300)) * [[0.01], [1], [30], [1e3]]).astype(np.float32)
    w = rng.uniform(0.5, 1.5, 300).astype(np.float32)
    out = np.empty_like(x)
    run(dev, "rms_norm", {"x": x, "w": w}, {"out": out}, n=300, n_tok=4, eps=1e-6)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64**2, axis=1, keepdims=True) + 1e-6) * w
    assert np.all(np.abs(out - want) <= 1e-5 * np.abs(want) + 1e-30)


def rope_numpy(x: np.ndarray, angles: np.ndarray, neox: bool) -> np.ndarray:
    """x (n_tok, n_head, hd) turned by angles (n_tok, hd / 2), as complex numbers."""
    hd = x.shape[-1]
    x64 = x.astype(np.float64)
    re, im = (x64[..., : hd // 2], x64[..., hd // 2:]) if neox else (x64[..., 0::2], x64[..., 1::2])
    z = (re + 1j * im) * np.exp(1j * angles)[:, None, :]
    out = np.empty_like(x64)
    if neox:
        out[..., : hd // 2], out[..., hd // 2:] = z.real, z.imag
    else:
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


@pytest.mark.parametrize("variant", ["normal", "neox", "mrope"])
def test_rope_matches_numpy(dev, variant):
    rng = np.random.default_rng(1)
    n_tok, n_head, hd = 5, 3, 32
    x = rng.standard_normal((n_tok, n_head, hd), dtype=np.float32)
    pos = rng.integers(0, 5000, (n_tok, 3)).astype(np.int32)
    axis = (np.arange(hd // 2) % 3 if variant == "mrope" else np.zeros(hd // 2)).astype(np.uint8)
    inv_freq = (1e4 ** (-np.arange(0, hd, 2) / hd)).astype(np.float32)
    angles = (pos[:, axis].astype(np.float32) * inv_freq).astype(np.float64)  # the angle in f32, as the kernels
    ptrs = {k: dev.to_device(v) for k, v in {"x": x, "pos": pos, "inv_freq": inv_freq, "axis": axis}.items()}
    dev.launch("rope", n_tok=n_tok, n_head=n_head, head_dim=hd, neox=int(variant != "normal"), **ptrs)
    got = dev.to_host(ptrs["x"], x.shape, np.float32)
    want = rope_numpy(x, angles, neox=variant != "normal")
    assert np.max(np.abs(got - want)) <= 1e-6 * np.max(np.abs(x))
    assert not np.allclose(got, x)  # it turned


def test_partial_rope_turns_the_first_n_rot_values_and_leaves_the_rest(dev):
    """Qwen3.5's attention: NEOX pairs (i, i + n_rot / 2) over the first n_rot values of each head."""
    rng = np.random.default_rng(8)
    n_tok, n_head, hd, rot = 4, 2, 64, 16
    x = rng.standard_normal((n_tok, n_head, hd), dtype=np.float32)
    pos = rng.integers(0, 5000, (n_tok, 3)).astype(np.int32)
    axis = np.zeros(rot // 2, np.uint8)
    inv_freq = (1e4 ** (-np.arange(0, rot, 2) / rot)).astype(np.float32)
    angles = (pos[:, axis].astype(np.float32) * inv_freq).astype(np.float64)
    ptrs = {k: dev.to_device(v) for k, v in {"x": x, "pos": pos, "inv_freq": inv_freq, "axis": axis}.items()}
    dev.launch("rope", n_tok=n_tok, n_head=n_head, head_dim=hd, neox=1, n_rot=rot, **ptrs)
    got = dev.to_host(ptrs["x"], x.shape, np.float32)
    want = rope_numpy(np.ascontiguousarray(x[..., :rot]), angles, neox=True)
    assert np.max(np.abs(got[..., :rot] - want)) <= 1e-6 * np.max(np.abs(x))
    np.testing.assert_array_equal(got[..., rot:], x[..., rot:])
    with pytest.raises(DeviceError, match="n_rot 66"):
        dev.launch("rope", n_tok=n_tok, n_head=n_head, head_dim=hd, neox=1, n_rot=66, **ptrs)
    for p in ptrs.values():
        dev.free(p)


@pytest.mark.parametrize("kv", ["f32", "f16", "int8"])
def test_attention_matches_numpy(dev, kv):
    rng = np.random.default_rng(2)
    case = device_check.attention_case(2, 4, 2, 32, 20, kv, rng)
    args = case.args(dev)
    host = {name: np.asarray(value) for name, value in args.items() if not isinstance(value, dev.ffi.CData)}
    dev.launch("attention", **args)
    got = case.out(dev, args)
    # numpy from the same inputs, read back through the device
    n_layer, nkv, n_ctx, hd = host["n_layer"], host["n_head_kv"], host["n_ctx"], host["head_dim"]
    dtype = {"f32": np.float32, "f16": np.float16, "int8": np.int8}[kv]
    shape = (2, n_layer, nkv, n_ctx, hd)
    k, v = (dev.to_host(args[n], shape, dtype).astype(np.float64) for n in ("k", "v"))
    if kv == "int8":
        k *= dev.to_host(args["k_scale"], shape[:-1], np.float32)[..., None]
        v *= dev.to_host(args["v_scale"], shape[:-1], np.float32)[..., None]
    q = dev.to_host(args["q"], (2, 4, hd), np.float32).astype(np.float64)
    seq, n_pos = dev.to_host(args["seq"], (2,), np.int32), dev.to_host(args["n_pos"], (2,), np.int32)
    first = dev.to_host(args["first"], (2,), np.int32)
    assert first[0] == 0 and first[1] == n_pos[1] // 2 > 0  # from the start, and a window's later start
    for t in range(2):
        for h in range(4):
            kh, vh = k[seq[t], 1, h // 2, first[t]:n_pos[t]], v[seq[t], 1, h // 2, first[t]:n_pos[t]]
            s = kh @ q[t, h] / np.sqrt(hd)
            p = np.exp(s - s.max())
            want = p @ vh / p.sum()
            assert np.all(np.abs(got[t, h] - want) <= 1e-5 * np.abs(vh).max())
    device_check.free_args(dev, args)


def test_swiglu_matches_numpy(dev):
    g = np.array([-100, -20, -1, 0, 0.5, 3, 30], np.float32)
    u = np.linspace(-2, 2, 7).astype(np.float32)
    out = np.empty_like(g)
    run(dev, "swiglu", {"g": g, "u": u}, {"out": out}, n=7)
    want = g.astype(np.float64) / (1 + np.exp(-g.astype(np.float64))) * u
    assert np.all(np.abs(out - want) <= 1e-6 * np.abs(want) + 1e-30)


def test_topk_picks_the_most_probable_in_order_and_renormalises(dev):
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((6, 40)).astype(np.float32)
    logits[0, [3, 9]] = 5.0  # a tie: the lower index first
    ids, weights = np.empty((6, 4), np.int32), np.empty((6, 4), np.float32)
    run(dev, "topk", {"logits": logits}, {"ids": ids, "weights": weights}, n_tok=6, n_expert=40, k=4)
    want = np.lexsort((np.broadcast_to(np.arange(40), logits.shape), -logits), axis=1)[:, :4]
    np.testing.assert_array_equal(ids, want)
    p = np.exp(logits.astype(np.float64) - logits.max(axis=1, keepdims=True))
    chosen = np.take_along_axis(p, want, axis=1)
    np.testing.assert_allclose(weights, chosen / chosen.sum(axis=1, keepdims=True), rtol=1e-6)


def test_add_rows_mixes_each_tokens_experts_and_adds_a_residual(dev):
    rng = np.random.default_rng(5)
    out0 = rng.standard_normal((3, 40), dtype=np.float32)
    y = rng.standard_normal((6, 40), dtype=np.float32)
    idx = np.array([4, 0, 5, 2, 1, 3], np.int32)
    weight = rng.uniform(0, 1, 6).astype(np.float32)
    out = out0.copy()
    ptrs = {k: dev.to_device(v) for k, v in {"out": out0, "y": y, "idx": idx, "weight": weight}.items()}
    dev.launch("add_rows", n_tok=3, k=2, n=40, **ptrs)
    for t in range(3):  # the token's choices one after another, in f32 (the compiler may fuse each step)
        for j in range(2):
            out[t] += weight[2 * t + j] * y[idx[2 * t + j]]
    got = dev.to_host(ptrs["out"], out.shape, np.float32)
    np.testing.assert_allclose(got, out, rtol=0, atol=1e-6 * np.abs(out).max())
    dev.launch("add_rows", n_tok=3, k=1, n=40, y=ptrs["y"], out=ptrs["out"])  # a residual: row t of y, weight 1
    np.testing.assert_array_equal(dev.to_host(ptrs["out"], out.shape, np.float32), got + y[:3])
    for p in ptrs.values():
        dev.free(p)


def test_sigmoid_gate_scales_by_each_values_gate_or_each_rows(dev):
    """Gated attention: 3 rows of 4 values, their gates every other 4 values of rows of 8 (a head's query, then
    its gate); the shared expert: one gate a row."""
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((3, 4)) * 3).astype(np.float32)
    qg = rng.standard_normal((3, 8)).astype(np.float32)
    qg[0, 4:] = [-100, -20, 0, 30]
    for per_value, gate, g in ((1, qg, qg[:, 4:]), (0, qg[:, 0].copy(), qg[:, :1])):
        ptrs = {"x": dev.to_device(x), "gate": dev.to_device(gate)}
        offset = 4 if per_value else 0
        dev.launch("sigmoid_gate", n=4, n_rows=3, gate_stride=8 if per_value else 1, per_value=per_value,
                   x=ptrs["x"], gate=dev.ffi.cast("float *", ptrs["gate"]) + offset)
        want = x.astype(np.float64) / (1 + np.exp(-g.astype(np.float64)))
        got = dev.to_host(ptrs["x"], x.shape, np.float32)
        assert np.all(np.abs(got - want) <= 1e-7 * np.abs(want) + 1e-37)
        for ptr in ptrs.values():
            dev.free(ptr)
    with pytest.raises(DeviceError, match="gate_stride 3 \\(at least n\\)"):
        dev.launch("sigmoid_gate", n=4, n_rows=1, gate_stride=3, per_value=1)


@pytest.mark.parametrize("kv", ["f32", "f16", "int8"])
def test_kv_store_writes_the_cpu_engines_rows(dev, kv):
    """The rows a token's k and v become in the cache: f32 as they are, f16 rounded to nearest, int8 with
    max|row| / 127 as the scale; only the token's rows change."""
    case = device_check.kv_store_case(2, 2, 32, 6, kv, np.random.default_rng(6))
    args = case.args(dev)
    dev.launch("kv_store", **args)
    elem = {"f32": 4, "f16": 2, "int8": 1}[kv]
    rows = 2 * 2 * 2 * 6
    got = {n: dev.to_host(args[n], (rows * 32 * elem,), np.uint8) for n in ("k", "v")}
    scales = {n: dev.to_host(args[n], (rows,), np.float32) for n in ("k_scale", "v_scale")}
    k_in = dev.to_host(args["k_in"], (2, 2, 32), np.float32)
    seq, pos = dev.to_host(args["seq"], (2,), np.int32), dev.to_host(args["pos"], (2,), np.int32)
    want = np.zeros((2, 2, 2, 6, 32), {"f32": np.float32, "f16": np.float16, "int8": np.int8}[kv])
    want_scale = np.zeros((2, 2, 2, 6), np.float32)
    for t in range(2):
        row = k_in[t]
        if kv == "int8":
            want_scale[seq[t], 1, :, pos[t]] = np.abs(row).max(axis=1) / np.float32(127)
            inv = np.float32(1) / want_scale[seq[t], 1, :, pos[t]]
            want[seq[t], 1, :, pos[t]] = np.rint(row * inv[:, None])
        else:
            want[seq[t], 1, :, pos[t]] = row
    np.testing.assert_array_equal(got["k"], want.reshape(-1).view(np.uint8))
    np.testing.assert_array_equal(scales["k_scale"], want_scale.reshape(-1))
    assert got["v"].any() and not np.array_equal(got["v"], got["k"])
    device_check.free_args(dev, args)


def test_a_miss_on_the_cpu_gives_the_bits_of_a_hit_on_the_host_device(dev):
    """strata_host_expert_ffn (the CPU's side of a step) against the same expert through the host device's
    kernels, and numpy."""
    rng = np.random.default_rng(7)
    E, F, n_tok = 256, 512, 3
    gate, up = (device_check.random_weights(Q.Q4_K, F, E, rng) for _ in range(2))
    down = device_check.random_weights(Q.Q8_0, E, F, rng)
    x = rng.standard_normal((n_tok, E), dtype=np.float32)
    dffi, dlib = interface()
    y = np.empty((n_tok, E), np.float32)
    assert dlib.strata_host_expert_ffn(int(Q.Q4_K), dffi.from_buffer(gate), int(Q.Q4_K), dffi.from_buffer(up),
                                       int(Q.Q8_0), dffi.from_buffer(down), E, F, dffi.from_buffer("float[]", x),
                                       n_tok, dffi.from_buffer("float[]", y)) == 0
    p = {k: dev.to_device(v) for k, v in {"gate": gate, "up": up, "down": down, "x": x}.items()}
    hb, hb2, out = dev.alloc(4 * n_tok * F), dev.alloc(4 * n_tok * F), dev.alloc(4 * n_tok * E)
    dev.launch("matmul", type=int(Q.Q4_K), n=E, rows=F, n_tok=n_tok, row_bytes=gate.shape[1], w=p["gate"], x=p["x"],
               y=hb)
    dev.launch("matmul", type=int(Q.Q4_K), n=E, rows=F, n_tok=n_tok, row_bytes=up.shape[1], w=p["up"], x=p["x"], y=hb2)
    dev.launch("swiglu", n=n_tok * F, g=hb, u=hb2, out=hb)
    dev.launch("matmul", type=int(Q.Q8_0), n=F, rows=E, n_tok=n_tok, row_bytes=down.shape[1], w=p["down"], x=hb, y=out)
    np.testing.assert_array_equal(dev.to_host(out, (n_tok, E), np.float32), y)
    w = {k: quants.dequantize(v, t).reshape(r, c).astype(np.float64)
         for k, v, t, r, c in (("g", gate, Q.Q4_K, F, E), ("u", up, Q.Q4_K, F, E), ("d", down, Q.Q8_0, E, F))}
    g = x @ w["g"].T
    want = (g / (1 + np.exp(-g)) * (x @ w["u"].T)) @ w["d"].T
    assert np.max(np.abs(y - want)) <= 0.05 * np.max(np.abs(want))  # the activations' int8 blocks
    for q in [*p.values(), hb, hb2, out]:
        dev.free(q)


# --- bookkeeping


def test_allocations_count_against_the_budget(dev):
    a = dev.alloc(1 << 25)
    b = dev.alloc(1 << 24)
    assert dev.used == (1 << 25) + (1 << 24) and dev.budget == 1 << 26
    with pytest.raises(DeviceError, match="budget"):
        dev.alloc((1 << 24) + 1)
    assert dev.used == (1 << 25) + (1 << 24)  # the failed one took nothing
    dev.free(a)
    dev.alloc(1 << 25)  # fits again once freed
    dev.free(b)
    with pytest.raises(DeviceError, match="did not allocate"):
        dev.free(b)
    assert dev.used == 1 << 25


def test_copies_must_stay_inside_one_allocation(dev):
    p = dev.alloc(64)
    with pytest.raises(DeviceError, match="not inside one allocation"):
        dev.upload(p, np.zeros(17, np.float32))
    dev.upload(p, np.arange(16, dtype=np.float32))
    dev.memset(p, 0, 32)
    np.testing.assert_array_equal(dev.to_host(p, (16,), np.float32), [0] * 8 + list(range(8, 16)))


def test_a_copy_on_the_device_moves_bytes_between_and_within_allocations(dev):
    a, b = dev.alloc(64), dev.alloc(64)
    dev.upload(a, np.arange(16, dtype=np.float32))
    dev.copy(b, dev.ffi.cast("char *", a) + 16, 32)
    dev.copy(dev.ffi.cast("char *", a) + 32, a, 32)  # within one allocation
    np.testing.assert_array_equal(dev.to_host(b, (8,), np.float32), list(range(4, 12)))
    np.testing.assert_array_equal(dev.to_host(a, (16,), np.float32), [*range(8), *range(8)])
    with pytest.raises(DeviceError, match="overlaps itself"):
        dev.copy(dev.ffi.cast("char *", a) + 8, a, 32)  # cudaMemcpyAsync's result would be undefined
    host = np.zeros(16, np.float32)
    for dst, src in ((b, dev.ffi.cast("char *", a) + 32), (dev.ffi.from_buffer(host), a)):
        with pytest.raises(DeviceError, match="not inside one allocation"):
            dev.copy(dst, src, 64)


def test_streams_and_events_follow_their_rules(dev):
    streams = [dev.stream() for _ in range(7)]
    assert streams == list(range(1, 8))
    with pytest.raises(DeviceError, match="no more than 8 streams"):
        dev.stream()
    with pytest.raises(DeviceError, match="stream 9 does not exist"):
        dev.sync(9)
    with pytest.raises(DeviceError, match="never recorded"):
        dev.wait(1, 0)
    # the upload stream's copy, then compute that waits on it: the order a step's expert uploads will use
    x = np.arange(64, dtype=np.float32) - 30
    px, pout = dev.alloc(x.nbytes), dev.alloc(x.nbytes)
    start = dev.record(0)
    dev.upload(px, x, stream=1)
    uploaded = dev.record(1)
    dev.wait(2, uploaded)
    dev.launch("swiglu", stream=2, n=64, g=px, u=px, out=pout)
    done = dev.record(2)
    dev.event_sync(done)
    assert dev.elapsed_ms(start, done) >= 0
    np.testing.assert_allclose(dev.to_host(pout, (64,), np.float32), x * x / (1 + np.exp(-x)), rtol=1e-6)
    # an event recorded again marks the new point, and uses up no other id
    dev.rerecord(1, uploaded)
    dev.wait(2, uploaded)
    assert dev.record(1) == done + 1
    with pytest.raises(DeviceError, match="never recorded"):
        dev.rerecord(1, done + 2)
    with pytest.raises(DeviceError, match="stream 9 does not exist"):
        dev.rerecord(9, uploaded)


def test_bad_launches_name_what_is_wrong(dev):
    with pytest.raises(DeviceError, match="no kernel named 'gemm'"):
        dev.launch("gemm")
    with pytest.raises(DeviceError, match="no argument named cols"):
        dev.launch("matmul", cols=3)
    with pytest.raises(DeviceError, match="weight type 6 has no device kernel"):
        dev.launch("matmul", type=int(Q.Q5_0), n=32, rows=1, n_tok=1, row_bytes=22)
    with pytest.raises(DeviceError, match="n 100 \\(a positive multiple of 256\\)"):
        dev.launch("matmul", type=int(Q.Q4_K), n=100, rows=1, n_tok=1, row_bytes=144)
    with pytest.raises(DeviceError, match="head_dim 48"):
        dev.launch("attention", head_dim=48, n_head=2, n_head_kv=1)
    with pytest.raises(DeviceError, match="topk: k 40"):
        dev.launch("topk", n_tok=1, n_expert=32, k=40)


def test_a_layers_expert_kernels_check_their_arguments_and_routing(dev):
    """moe_group and moe_matmul refuse shapes they cannot run; on the host, an expert id outside [0, n_expert) and
    an expert's run outside the rows (a card cannot check them: they lie in device memory)."""
    with pytest.raises(DeviceError, match="moe_group: 2 tokens choosing 9 of 8 experts"):
        dev.launch("moe_group", n_tok=2, k=9, n_expert=8, n=32)
    with pytest.raises(DeviceError, match="moe_matmul: 8 experts, at most 0 of 4 rows each"):
        dev.launch("moe_matmul", type=int(Q.Q8_0), n_expert=8, n=32, rows=1, max_rows=0, n_slots=4, row_bytes=34)
    case = device_check.moe_group_case(2, 8, 2, 32, np.random.default_rng(5))
    args = case.args(dev)
    dev.upload(args["ids"], np.array([[1, 2], [8, 3]], np.int32))
    with pytest.raises(DeviceError, match="slot 2 chose expert 8 of 8"):
        dev.launch("moe_group", **args)
    device_check.free_args(dev, args)
    case = device_check.moe_matmul_case(Q.Q8_0, 2, 8, 2, 32, 4, np.random.default_rng(5))
    args = case.args(dev)
    dev.upload(args["first"], np.full(8, 4, np.int32))  # every run starts past the 4 rows
    with pytest.raises(DeviceError, match=r"moe_matmul: an expert.s rows lie outside \[0, n_slots\)"):
        dev.launch("moe_matmul", **args)
    device_check.free_args(dev, args)


def test_attention_on_the_host_checks_each_tokens_positions(dev):
    case = device_check.attention_case(2, 4, 2, 32, 20, "f32", np.random.default_rng(4))
    args = case.args(dev)
    dev.upload(args["n_pos"], np.array([20, 21], np.int32))
    with pytest.raises(DeviceError, match="attention: a token's n_pos is not in \\[1, n_ctx\\]"):
        dev.launch("attention", **args)
    dev.upload(args["n_pos"], np.array([20, 6], np.int32))
    dev.upload(args["first"], np.array([0, 6], np.int32))  # a window starting where the positions end
    with pytest.raises(DeviceError, match="its first position not in \\[0, n_pos\\)"):
        dev.launch("attention", **args)
    device_check.free_args(dev, args)


def test_unknown_kind_is_an_error_naming_it():
    with pytest.raises(DeviceError, match="device kind 'tpu': expected host or cuda"):
        Device("tpu")


def test_cuda_without_a_library_or_a_gpu_says_so_in_one_line():
    dffi, dlib = interface()
    err = dffi.new("char[]", 512)
    assert dlib.strata_dev_open(b"cuda", dffi.NULL, 0, err, len(err)) == dffi.NULL
    assert dffi.string(err).decode() == "cuda: no CUDA library was built (nvcc was not found at build time)"
    try:
        Device("cuda").close()
    except DeviceUnavailable as exc:
        assert str(exc).startswith("cuda: ") and "\n" not in str(exc)


# --- the check driver (scripts/gpu-check.sh) on the host device


def test_check_driver_prints_its_table_and_passes_on_the_host(capsys):
    assert device_check.main(["--device", "host", "--quick", "--runs", "1"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"device: host \(memory bandwidth unknown; a device-to-device copy [1-9]\d* GB/s\)", table[0])
    rows = [line for line in table if line.startswith("| ") and "kernel" not in line]
    assert len(rows) == (3 * len(device_check.MATMUL_TYPES) + 1 + 4 + 3 + 1 + 1 + 1 + 3 + 8 + 2 + 1 + 2 + 2
                         + 2 * (1 + len(device_check.MATMUL_TYPES)))  # the routed experts': grouping, products
    assert all("| pass " in line for line in rows) and table[-1] == f"{len(rows)} of {len(rows)} cases pass"


def test_backend_check_runs_the_forward_pass_on_the_host_and_passes(capsys):
    """The script's second part (strata.engine_cffi.backend_check), on the host device."""
    assert backend_check.main(["--device", "host", "--quick"]) == 0
    out = capsys.readouterr().out
    assert out.count("(agree)") == 8 and out.splitlines()[-1] == "pass"  # half the experts, then all (resident)
    held = [line for line in out.splitlines() if line.startswith("every expert held: ")]
    assert len(held) == 4 and all(" 0 misses, 0 uploads; " in line for line in held)
    assert out.count("MTP drafts (3 a sequence)") == 4  # the qwen35moe models' blocks, on both sides, both runs
    assert out.count(f"a window of {backend_check.WINDOW}:") == 2  # the second run's, the server's window
    assert "qwen3moe tiny f16, expert cache 8 of 16 experts, then all of them (resident), tolerance 1e-05" in out
    assert "qwen35moe tiny f16, expert cache 8 of 16 experts, then all of them (resident), tolerance 1e-05" in out


def test_check_driver_fails_a_kernel_outside_its_tolerance():
    case = device_check.swiglu_case(100, np.random.default_rng(0))
    case.tolerance = lambda other: np.full(other.shape, -1.0)  # nothing can be within
    with Device("host") as d1, Device("host") as d2:
        row = device_check.check_case(d1, d2, case, runs=1)
    assert not row.passed
    assert "FAIL" in device_check.format_table([row], "host", 0.0, 0.0)


# --- the CUDA sources


def build_engine_module():
    spec = importlib.util.spec_from_file_location("build_engine", ROOT / "build_engine.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return build


needs_nvcc = pytest.mark.skipif(build_engine_module().find_nvcc() is None, reason="nvcc is not installed")


@needs_nvcc
def test_cuda_sources_compile_without_warnings(tmp_path):
    build = build_engine_module()
    nvcc = build.find_nvcc()
    runs = [subprocess.Popen(build.nvcc_command(nvcc, src, tmp_path / f"{src.stem}.o", ["90"]),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for src in sorted(CUDA_DIR.glob("*.cu"))]
    assert runs  # the .cu files were found
    for run in runs:
        out, _ = run.communicate(timeout=300)
        assert run.returncode == 0 and out == "", out


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine: the script would run")
def test_gpu_check_script_says_there_is_no_gpu():
    run = subprocess.run([ROOT / "scripts" / "gpu-check.sh", "--quick"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "gpu-check: no NVIDIA GPU here" in run.stderr


@pytest.fixture(scope="module")
def cuda_decoders(tmp_path_factory):
    """tests/engine/cuda_decoders.cu built for the host: the CUDA decoders run without a GPU."""
    exe = tmp_path_factory.mktemp("decoders") / "cuda_decoders"
    nvcc = build_engine_module().find_nvcc()
    subprocess.run([nvcc, "-O2", "-std=c++17", "-Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra",
                    f"-I{CUDA_DIR}", str(Path(__file__).with_name("cuda_decoders.cu")), "-o", str(exe)], check=True)
    return exe


@needs_nvcc
@pytest.mark.parametrize("qtype", device_check.MATMUL_TYPES)
def test_cuda_decoders_match_the_gguf_package(cuda_decoders, qtype):
    """value_at (the reference kernels') bit for bit; the chunks of int8s and scales (the dp4a path's) within
    float rounding of the scales' products; the dp4a product of a row within the quantisation bound of numpy's."""
    n_rows, n = 5, 768
    rng = np.random.default_rng(int(qtype))
    w = device_check.random_weights(qtype, n_rows, n, rng)
    x = device_check.lossless_activations(1, n, rng)  # the device's int8 blocks hold them exactly
    run = subprocess.run([cuda_decoders, str(int(qtype)), str(n_rows), str(n), str(w.shape[1])],
                         input=w.tobytes() + x.tobytes(), capture_output=True, check=True, timeout=30)
    out = np.frombuffer(run.stdout, np.float32)
    by_value, by_chunk = out[: 2 * n_rows * n].reshape(2, n_rows, n)
    want = quants.dequantize(w, qtype).reshape(n_rows, n)
    np.testing.assert_array_equal(by_value.view(np.uint32), want.view(np.uint32))
    np.testing.assert_allclose(by_chunk, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    if device_check.ENGINE_ACT_BLOCK[qtype] is not None:  # quantised: the product as matmul_q8_kernel sums it
        exact = x.astype(np.float64) @ want.astype(np.float64).T
        err = np.abs(out[2 * n_rows * n:] - exact)
        assert np.all(err <= device_check.RTOL * (np.abs(x) @ np.abs(want.astype(np.float64)).T)), err


def test_without_nvcc_the_build_finds_none(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    assert build_engine_module().find_nvcc() is None


def cuda_device_opens() -> bool:
    try:
        Device("cuda").close()
    except DeviceUnavailable:
        return False
    return True


@pytest.mark.skipif(not cuda_device_opens(), reason="no CUDA library or no GPU here")
def test_cuda_kernels_match_their_references_and_the_cpu_engine(capsys):
    assert device_check.main(["--device", "cuda", "--quick", "--runs", "1"]) == 0
