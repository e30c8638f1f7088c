"""Our Q4_K / Q6_K quantisers against the `gguf` package's own dequantisers."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from strata.modelgen.quants import byte_shape, encode

Q4_K, Q6_K = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K
# Worst per-block relative RMS error allowed: 4 bits over an asymmetric range with 6-bit sub-block scales, and
# 6 bits symmetric with 8-bit scales. Gaussian data measures ~0.08 / ~0.02 (at most 0.09 / 0.022); heavy tails
# stretch the range that the steps must cover, so they get 1.5x the bound.
BOUND = {Q4_K: 0.10, Q6_K: 0.03}
HEAVY_TAIL_FACTOR = 1.5


def block_rel_rms(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    err = (y - x).reshape(-1, 256)
    ref = x.reshape(-1, 256)
    return np.sqrt((err**2).mean(axis=1) / (ref**2).mean(axis=1))


def roundtrip(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    data = encode(x, qtype)
    assert data.shape == byte_shape(x.shape, qtype)
    return quants.dequantize(data, qtype)


def inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    scaled = rng.standard_normal((16, 512), dtype=np.float32)
    scaled *= np.logspace(-3, 3, 16, dtype=np.float32)[:, None]  # magnitudes far from 1
    heavy = rng.standard_t(3, (16, 512)).astype(np.float32)  # outliers
    return {
        "gaussian": rng.standard_normal((64, 1024), dtype=np.float32),
        "positive": rng.uniform(1.0, 2.0, (8, 256)).astype(np.float32),  # min above 0
        "negative": rng.uniform(-2.0, -1.0, (8, 256)).astype(np.float32),
        "scaled": scaled,
        "heavy_tails": heavy,
        "3d": rng.standard_normal((3, 4, 256), dtype=np.float32),
    }


@pytest.mark.parametrize("qtype", [Q4_K, Q6_K])
@pytest.mark.parametrize("name", list(inputs()))
def test_k_quant_error_bound(qtype: GGMLQuantizationType, name: str) -> None:
    x = inputs()[name]
    y = roundtrip(x, qtype)
    assert y.shape == x.shape
    assert block_rel_rms(x, y).max() < BOUND[qtype] * (HEAVY_TAIL_FACTOR if name == "heavy_tails" else 1.0)


@pytest.mark.parametrize("qtype", [Q4_K, Q6_K])
def test_k_quant_zero_and_constant_blocks(qtype: GGMLQuantizationType) -> None:
    x = np.zeros((2, 256), np.float32)
    x[1] = 0.75
    y = roundtrip(x, qtype)
    assert np.array_equal(y[0], x[0])
    np.testing.assert_allclose(y[1], x[1], rtol=0.02)


@pytest.mark.parametrize("qtype", [Q4_K, Q6_K])
def test_k_quant_rejects_partial_blocks(qtype: GGMLQuantizationType) -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        encode(np.ones((2, 320), np.float32), qtype)


def test_q6_k_beats_q4_k() -> None:
    x = inputs()["gaussian"]
    assert block_rel_rms(x, roundtrip(x, Q6_K)).mean() < block_rel_rms(x, roundtrip(x, Q4_K)).mean() / 3
