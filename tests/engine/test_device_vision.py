"""The device kernels of a vision encoder (`strata-vision --gpu`) on the host device, against numpy in float64 with
the check driver's tolerances: LayerNorm, both GELUs, and full attention over a picture's patches (heads that are
not a multiple of 32, more tokens than the fast kernel's tiles of 32)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from test_device import run

from strata.engine_cffi import device_check
from strata.engine_cffi.device import Device, DeviceError


@pytest.fixture
def dev():
    with Device("host", budget=1 << 26) as d:
        yield d


@pytest.mark.parametrize("name", ["layer_norm", "layer_norm_ref"])
def test_layer_norm_matches_numpy(dev, name):
    case = device_check.layer_norm_case(7, 300, np.random.default_rng(1))
    args = case.args(dev)
    x, w, b = (dev.to_host(args[k], shape, np.float32) for k, shape in (("x", (7, 300)), ("w", (300,)),
                                                                         ("b", (300,))))
    device_check.free_args(dev, args)
    out = np.empty_like(x)
    run(dev, name, {"x": x, "w": w, "b": b}, {"out": out}, n=300, n_tok=7, eps=1e-6)
    x64 = x.astype(np.float64)
    want = (x64 - x64.mean(axis=1, keepdims=True)) / np.sqrt(x64.var(axis=1, keepdims=True) + 1e-6) * w + b
    assert np.all(np.abs(out - want) <= case.tolerance(want))


@pytest.mark.parametrize("erf", [False, True])
def test_gelu_matches_numpy(dev, erf):
    x = np.random.default_rng(2).standard_normal(500).astype(np.float32) * 4
    out = np.empty_like(x)
    run(dev, "gelu", {"x": x}, {"out": out}, n=x.size, erf=int(erf))
    x64 = x.astype(np.float64)
    if erf:
        want = 0.5 * x64 * (1 + np.vectorize(math.erf)(x64 / math.sqrt(2)))
    else:
        want = 0.5 * x64 * (1 + np.tanh(math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64**3)))
    assert np.abs(out - want).max() <= 1e-6 * np.abs(x64).max()


@pytest.mark.parametrize("shape", [(70, 2, 40), (33, 3, 16), (1, 1, 8)])
def test_vit_attention_matches_numpy(dev, shape):
    n, heads, hd = shape
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((n, heads, hd), dtype=np.float32) for _ in range(3))
    out = np.empty_like(q)
    run(dev, "vit_attention", {"q": q, "k": k, "v": v}, {"out": out}, n_tok=n, n_head=heads, head_dim=hd)
    scores = np.einsum("qhd,khd->hqk", q.astype(np.float64), k.astype(np.float64)) / math.sqrt(hd)
    weights = np.exp(scores - scores.max(axis=2, keepdims=True))
    want = np.einsum("hqk,khd->qhd", weights / weights.sum(axis=2, keepdims=True), v.astype(np.float64))
    assert np.abs(out - want).max() <= device_check.RTOL * np.abs(v).max()


def test_vit_attention_refuses_heads_over_256_values(dev):
    with pytest.raises(DeviceError, match=r"vit_attention: head_dim 288 \(up to 256\)"):
        dev.launch("vit_attention", n_tok=1, n_head=1, head_dim=288)
