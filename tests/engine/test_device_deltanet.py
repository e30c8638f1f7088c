"""The device's Gated DeltaNet kernels (Qwen3.5's recurrent layers) on the host device: the short convolution with
its conv state, the L2 norm of q/k heads, the gated delta rule (its recurrent form, `delta_rule`, and its chunked
one, `delta_rule_chunked`) and the gated RMS norm, against numpy in float64 and, for the rule, against the CPU
engine's own (`strata_delta_rule`) bit for bit: the host device runs blocks_deltanet.c's code, token by token or in
64-token chunks.

Tolerances are the check driver's (device_check.py), which gpu-check.sh applies to the CUDA kernels.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from strata.engine_cffi._engine import ffi, lib

from strata.engine_cffi import device_check
from strata.engine_cffi.device import Device


@pytest.fixture
def dev():
    with Device("host", budget=1 << 26) as d:
        yield d


def launch(dev: Device, name: str, arrays: dict[str, np.ndarray], **fixed: Any) -> None:
    """Launch `name` on device copies of arrays, then read every array back (in place)."""
    ptrs = {k: dev.to_device(v) for k, v in arrays.items()}
    dev.launch(name, **fixed, **ptrs)
    for k, v in arrays.items():
        dev.download(v, ptrs[k])
    dev.sync()
    for p in ptrs.values():
        dev.free(p)


def sequences(lengths: tuple[int, ...]) -> dict[str, np.ndarray]:
    return device_check._sequences(lengths)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


@pytest.mark.parametrize("lengths", [(1, 1, 1), (5, 1, 70)])
def test_dn_conv_matches_numpy_and_carries_the_state(dev, lengths):
    rng = np.random.default_rng(sum(lengths))
    n_tok, n_seq, C, K = sum(lengths), len(lengths), 40, device_check.D_CONV
    stride = C * (K - 1) + 5
    x = rng.standard_normal((n_tok, C), dtype=np.float32)
    w = rng.standard_normal((C, K), dtype=np.float32)
    state0 = rng.standard_normal((n_seq, stride), dtype=np.float32)
    arrays = {"x": x, "w": w, "state": state0.copy(), "out": np.zeros((n_tok, C), np.float32)} | sequences(lengths)
    launch(dev, "dn_conv", arrays, n_seq=n_seq, d_conv=K, channels=C, state_stride=stride)
    first, seq = arrays["seq_first"], arrays["seq"]
    for s in range(n_seq):
        before = state0[seq[s], : C * (K - 1)].reshape(C, K - 1).T  # (K - 1, C), oldest first
        inputs = np.concatenate([before, x[first[s]: first[s + 1]]]).astype(np.float64)
        for i in range(lengths[s]):
            want = silu(np.einsum("kc,ck->c", inputs[i: i + K], w.astype(np.float64)))
            got = arrays["out"][first[s] + i]
            assert np.all(np.abs(got - want) <= 1e-5 * np.abs(w).sum(axis=1) * np.abs(inputs).max())
        np.testing.assert_array_equal(arrays["state"][seq[s], : C * (K - 1)], inputs[-(K - 1):].T.reshape(-1))
        np.testing.assert_array_equal(arrays["state"][seq[s], C * (K - 1):], state0[seq[s], C * (K - 1):])


def test_l2_norm_normalises_each_head_in_place_and_leaves_the_rest(dev):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 5 * 16), dtype=np.float32) * 4
    arrays = {"x": x.copy()}
    launch(dev, "l2_norm", arrays, n_tok=3, n_head=2, head_dim=16, row_stride=80, scale=0.25)
    heads = x[:, :32].reshape(3, 2, 16).astype(np.float64)
    want = heads * 0.25 / np.sqrt((heads**2).sum(axis=-1, keepdims=True) + 1e-6)
    assert np.max(np.abs(arrays["x"][:, :32].reshape(3, 2, 16) - want)) <= 1e-7
    np.testing.assert_array_equal(arrays["x"][:, 32:], x[:, 32:])


def test_dn_gates_match_numpy_on_both_sides_of_softplus_threshold(dev):
    rng = np.random.default_rng(3)
    alpha = np.array([[-30, -3, 0, 5, 19.5, 25]], np.float32)
    beta = np.array([[-20, -1, 0, 0.5, 3, 30]], np.float32)
    a, dt_bias = -rng.uniform(0.1, 10, 6).astype(np.float32), np.full(6, 0.25, np.float32)
    arrays = {"alpha": alpha.copy(), "beta": beta.copy(), "a": a, "dt_bias": dt_bias}
    launch(dev, "dn_gates", arrays, n_tok=1, n_head=6)
    x = alpha.astype(np.float64) + dt_bias
    g = a * np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))
    assert np.all(np.abs(arrays["alpha"] - g) <= 1e-6 * np.abs(g) + 1e-30)
    assert np.all(np.abs(arrays["beta"] - 1 / (1 + np.exp(-beta.astype(np.float64)))) <= 1e-7)


def test_gated_rms_norm_matches_numpy(dev):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((6, 32)) * [[0.01], [1], [30], [1e3], [1], [1]]).astype(np.float32)
    z = (rng.standard_normal((6, 32)) * 4).astype(np.float32)
    w = rng.uniform(0.5, 1.5, 32).astype(np.float32)
    arrays = {"x": x, "z": z, "w": w, "out": np.zeros_like(x)}
    launch(dev, "gated_rms_norm", arrays, n=32, n_rows=6, eps=1e-6)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64**2, axis=1, keepdims=True) + 1e-6) * w * silu(z.astype(np.float64))
    assert np.all(np.abs(arrays["out"] - want) <= 1e-5 * np.abs(want) + 1e-30)


def reference_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                   S: np.ndarray) -> np.ndarray:
    """One sequence's tokens through the rule, token by token in float64 (heads (n_tok, heads, d)); S (hv, d, d)
    updated in place."""
    hk, out = q.shape[1], np.zeros(v.shape)
    for t in range(q.shape[0]):
        for h in range(v.shape[1]):
            S[h] *= np.exp(g[t, h])
            S[h] += np.outer(k[t, h % hk], beta[t, h] * (v[t, h] - S[h].T @ k[t, h % hk]))
            out[t, h] = S[h].T @ q[t, h % hk]
    return out


def engine_rule(q, k, v, g, beta, state: np.ndarray, chunked: bool) -> np.ndarray:
    """The CPU engine's rule on one sequence's heads; state (hv, d, d) f32 updated in place."""
    arrays = [np.ascontiguousarray(a, dtype=np.float32) for a in (q, k, v, g, beta)]
    out = np.zeros(v.shape, np.float32)
    n_tok, hk, d = q.shape
    assert lib.strata_delta_rule(*(ffi.from_buffer("float[]", a) for a in arrays), n_tok, hk, v.shape[1], d,
                                 int(chunked), ffi.from_buffer("float[]", state), ffi.from_buffer("float[]", out)) == 0
    return out


def test_the_engine_takes_runs_of_more_than_16_tokens_by_the_chunked_form():
    """The CPU engine's choice of form per run (blocks_deltanet.c), which the device backend follows."""
    assert [lib.strata_deltanet_chunked(n) for n in (1, 2, 16, 17, 64, 300)] == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("kernel,lengths", [
    ("delta_rule", (1, 1, 1)), ("delta_rule", (70, 1, 64, 5, 16, 17)),
    # the chunked form across the 64-token chunks' edges, alone and two sequences of different lengths
    *(("delta_rule_chunked", lengths) for lengths in ((1,), (63,), (64,), (65,), (200,), (65, 200)))])
def test_delta_rule_gives_the_cpu_engines_bits_and_matches_numpy(dev, kernel, lengths):
    """A chunk's sequences from states left by earlier tokens: each sequence's outputs and state are the CPU
    engine's (its recurrent step, or its chunked form for delta_rule_chunked), within the check's tolerance of the
    rule in float64, and the slots' gaps (state_stride) untouched."""
    rng = np.random.default_rng(sum(lengths) + len(kernel))
    hk, hv, d = 2, 4, 16
    n_tok, n_seq, stride = sum(lengths), len(lengths), hv * d * d + 3
    arrays = device_check.delta_rule_inputs(n_tok, hk, hv, d, rng) | sequences(lengths)
    state0 = (0.1 * rng.standard_normal((n_seq, stride))).astype(np.float32)
    arrays["state"] = state0.copy()
    arrays["out"] = np.zeros((n_tok, hv, d), np.float32)
    launch(dev, kernel, arrays, n_seq=n_seq, n_k_heads=hk, n_v_heads=hv, head_dim=d, row_stride=hv * d,
           state_stride=stride)
    first, seq = arrays["seq_first"], arrays["seq"]
    for s in range(n_seq):
        rows = slice(first[s], first[s + 1])
        q, k, v = (arrays[n][rows].reshape(lengths[s], hv, d) for n in ("q", "k", "v"))
        q, k = q[:, :hk], k[:, :hk]
        g, beta = arrays["g"][rows], arrays["beta"][rows]
        ours = state0[seq[s], : hv * d * d].reshape(hv, d, d).copy()
        want_out = engine_rule(q, k, v, g, beta, ours, chunked=kernel == "delta_rule_chunked")
        np.testing.assert_array_equal(arrays["out"][rows], want_out)
        np.testing.assert_array_equal(arrays["state"][seq[s], : hv * d * d], ours.reshape(-1))
        np.testing.assert_array_equal(arrays["state"][seq[s], hv * d * d:], state0[seq[s], hv * d * d:])
        S = state0[seq[s], : hv * d * d].reshape(hv, d, d).astype(np.float64)
        exact = reference_rule(*(a.astype(np.float64) for a in (q, k, v, g, beta)), S)
        assert np.max(np.abs(want_out - exact)) <= device_check.RULE_RTOL * max(1.0, np.abs(exact).max())
        assert np.max(np.abs(ours - S)) <= device_check.RULE_RTOL * max(1.0, np.abs(S).max())


@pytest.mark.parametrize("kernel", ["delta_rule", "delta_rule_chunked"])
def test_a_run_without_a_slot_is_left_to_the_other_form(dev, kernel):
    """A run whose slot is -1 is skipped (its outputs and its state as they were), so that the device backend splits
    a chunk's runs between the two kernels (a decode step beside a prompt) as the CPU engine splits them: the two
    launches together give each run what its form's launch alone gives."""
    rng = np.random.default_rng(7)
    lengths, hk, hv, d = (3, 40), 1, 2, 16  # the recurrent form's run, then the chunked form's
    n_tok, stride = sum(lengths), hv * d * d
    arrays = device_check.delta_rule_inputs(n_tok, hk, hv, d, rng) | sequences(lengths)
    arrays["state"] = (0.1 * rng.standard_normal((2, stride))).astype(np.float32)
    arrays["out"] = np.full((n_tok, hv, d), 7.0, np.float32)
    fixed = dict(n_seq=2, n_k_heads=hk, n_v_heads=hv, head_dim=d, row_stride=hv * d, state_stride=stride)
    forms = ("delta_rule", "delta_rule_chunked")
    before, first = {name: a.copy() for name, a in arrays.items()}, arrays["seq_first"]
    other = 1 - forms.index(kernel)  # the run this kernel skips

    def slots(runs: list[int]) -> np.ndarray:
        return np.where(np.isin(np.arange(2), runs), before["seq"], -1).astype(np.int32)

    launch(dev, kernel, arrays | {"seq": slots([1 - other])}, **fixed)
    skipped = slice(first[other], first[other + 1])
    assert np.all(arrays["out"][skipped] == 7.0) and not np.any(np.delete(arrays["out"], skipped, axis=0) == 7.0)
    np.testing.assert_array_equal(arrays["state"][before["seq"][other]], before["state"][before["seq"][other]])
    launch(dev, forms[other], arrays | {"seq": slots([other])}, **fixed)
    for run, form in enumerate(forms):
        alone = {name: a.copy() for name, a in before.items()}
        launch(dev, form, alone | {"seq": slots([run])}, **fixed)
        rows, slot = slice(first[run], first[run + 1]), before["seq"][run]
        np.testing.assert_array_equal(arrays["out"][rows], alone["out"][rows])
        np.testing.assert_array_equal(arrays["state"][slot], alone["state"][slot])


@pytest.mark.parametrize("kernel", ["delta_rule", "delta_rule_chunked"])
def test_a_rule_over_no_runs_is_not_launched(dev, kernel):
    """n_seq 0 (a chunk whose runs all take the other form) is checked and then not launched: the device's work
    clock counts no piece of work for it, where the same launch over one run counts one."""
    fixed = dict(n_k_heads=1, n_v_heads=2, head_dim=16, row_stride=32, state_stride=512)
    arrays = device_check.delta_rule_inputs(4, 1, 2, 16, np.random.default_rng(3)) | sequences((4,))
    arrays |= {"state": np.zeros((1, 512), np.float32), "out": np.zeros((4, 2, 16), np.float32)}
    ptrs = {k: dev.to_device(v) for k, v in arrays.items()}
    work = dev.ffi.new("double[3]")
    dev.lib.strata_dev_time_work(dev.handle, 1)
    pieces = []
    for n_seq in (0, 1):
        dev.launch(kernel, n_seq=n_seq, **fixed, **ptrs)
        dev.lib.strata_dev_work_seconds(dev.handle, work)
        pieces.append(work[2])
    assert pieces == [0, 1]
    assert np.any(dev.to_host(ptrs["out"], (4, 2, 16), np.float32) != 0)
    with pytest.raises(device_check.DeviceError, match=f"{kernel}: .*n_seq -1"):
        dev.launch(kernel, n_seq=-1, **fixed, **ptrs)
    for ptr in ptrs.values():
        dev.free(ptr)


@pytest.mark.parametrize("kernel", ["delta_rule", "delta_rule_chunked"])
def test_delta_rule_refuses_heads_the_fast_kernel_cannot_hold(dev, kernel):
    args = dict(n_seq=1, n_k_heads=1, n_v_heads=1, head_dim=256, row_stride=256, state_stride=256 * 256)
    with pytest.raises(device_check.DeviceError, match=f"{kernel}: head_dim 256"):
        dev.launch(kernel, **args)


@pytest.mark.parametrize("name", ["dn_conv", "delta_rule", "delta_rule_chunked"])
def test_the_host_checks_the_sequences_rows(dev, name):
    """seq_first lies in device memory, where only the host device can check it."""
    bad = {"seq_first": np.array([0, 3, 2], np.int32), "seq": np.array([0, 1], np.int32)}
    ptrs = {k: dev.to_device(v) for k, v in bad.items()}
    fixed = (dict(n_seq=2, d_conv=4, channels=8, state_stride=24) if name == "dn_conv" else
             dict(n_seq=2, n_k_heads=1, n_v_heads=1, head_dim=8, row_stride=8, state_stride=64))
    with pytest.raises(device_check.DeviceError, match=f"{name}: seq_first must start at 0 and never decrease"):
        dev.launch(name, **fixed, **ptrs)
    for p in ptrs.values():
        dev.free(p)


@pytest.mark.parametrize("name,fields,says", [
    ("dn_conv", dict(n_seq=1, d_conv=4, channels=8, state_stride=23), "state_stride 23 is less than"),
    ("delta_rule", dict(n_seq=1, n_k_heads=1, n_v_heads=2, head_dim=8, row_stride=8, state_stride=128),
     "row_stride 8"),
    ("delta_rule", dict(n_seq=1, n_k_heads=1, n_v_heads=2, head_dim=8, row_stride=16, state_stride=127),
     "state_stride 127"),
    ("delta_rule_chunked", dict(n_seq=1, n_k_heads=1, n_v_heads=2, head_dim=8, row_stride=8, state_stride=128),
     "delta_rule_chunked: row_stride 8"),
    ("delta_rule_chunked", dict(n_seq=1, n_k_heads=1, n_v_heads=2, head_dim=8, row_stride=16, state_stride=127),
     "delta_rule_chunked: row_stride 16, state_stride 127"),
    ("l2_norm", dict(n_tok=1, n_head=2, head_dim=8, row_stride=15), "rows 15 apart"),
])
def test_strides_that_would_overlap_are_refused(dev, name, fields, says):
    with pytest.raises(device_check.DeviceError, match=says):
        dev.launch(name, **fields)
