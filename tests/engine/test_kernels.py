"""The engine's kernels against independent references.

Dequantisation must match the gguf package bit for bit. The fast products are checked against the naive
reference (dequantise, sum in double), and the naive reference against numpy in float64. The engine's internal
kernel interface (kernels.h, which cffi's module does not wrap) is reached through the same shared library.
"""

from __future__ import annotations

import os
import pathlib

import cffi
import numpy as np
import pytest
import strata.engine_cffi._engine as engine_module
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as Q
from strata.engine_cffi._engine import ffi, lib

from strata.engine_cffi import EngineError, get_rows
from strata.modelgen.quants import encode, random_blocks

# Every weight type current quantisation presets produce.
QUANT_32 = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.MXFP4]  # blocks of 32, dotted with Q8_0
QUANT_256 = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.IQ3_S, Q.IQ3_XXS, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S,
             Q.IQ1_S, Q.IQ1_M]  # super-blocks of 256, dotted with Q8_K
QUANT_TYPES = QUANT_32 + QUANT_256
WEIGHT_TYPES = [Q.F32, Q.F16, Q.BF16] + QUANT_TYPES
# Activation block of each weight type's products; None: activations stay f32.
ACT_BLOCK = {Q.F32: None, Q.F16: None, Q.BF16: None} | dict.fromkeys(QUANT_32, 32) | dict.fromkeys(QUANT_256, 256)
# Relative to sum |w x|: float32 accumulation in a different order than the double reference. The worst case
# grows like n * 2^-24 (6e-5 at n = 1024); blocked sums stay orders of magnitude below that.
ACCUMULATION_RTOL = 1e-5


def random_weights(qtype: Q, n_rows: int, n_cols: int, rng: np.random.Generator) -> np.ndarray:
    """(n_rows, row_bytes) uint8 weights of `qtype`."""
    if qtype == Q.F32:
        return rng.standard_normal((n_rows, n_cols), dtype=np.float32).view(np.uint8)
    if qtype == Q.F16:
        return rng.standard_normal((n_rows, n_cols)).astype(np.float16).view(np.uint8)
    if qtype in (Q.BF16, Q.Q8_0, Q.Q4_0):
        return quants.quantize(rng.standard_normal((n_rows, n_cols), dtype=np.float32), qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    return random_blocks(qtype, n_rows * n_cols // block, rng).reshape(n_rows, n_cols // block * size)


def dequantize(qtype: Q, data: np.ndarray, n: int) -> np.ndarray:
    out = np.empty(n, dtype=np.float32)
    status = lib.strata_dequantize_row(int(qtype), ffi.from_buffer(data), ffi.from_buffer("float[]", out), n)
    assert status == lib.STRATA_OK
    return out


def matmul(qtype: Q, w: np.ndarray, x: np.ndarray, n_threads: int | None = None) -> np.ndarray:
    """y = x @ w^T by the fast path (n_threads given) or the naive reference (None)."""
    n_rows, (n_tok, n_cols) = w.shape[0], x.shape
    y = np.full((n_tok, n_rows), np.nan, dtype=np.float32)
    args = (int(qtype), ffi.from_buffer(w), n_rows, n_cols, ffi.from_buffer("float[]", x), n_tok,
            ffi.from_buffer("float[]", y))
    status = lib.strata_matmul(*args, n_threads) if n_threads else lib.strata_matmul_naive(*args)
    assert status == lib.STRATA_OK, ffi.string(lib.strata_status_string(status))
    return y


def weights_f32(qtype: Q, w: np.ndarray, n_cols: int) -> np.ndarray:
    return quants.dequantize(w, qtype).reshape(w.shape[0], n_cols)


# --- block formats


@pytest.mark.parametrize("qtype", WEIGHT_TYPES)
def test_row_bytes_match_gguf(qtype):
    block, size = GGML_QUANT_SIZES[qtype]
    assert lib.strata_type_supported(int(qtype)) == 1
    assert lib.strata_row_bytes(int(qtype), 4 * 256) == 4 * 256 // block * size


def test_unsupported_types_and_shapes():
    assert lib.strata_type_supported(int(Q.Q8_K)) == 0  # activations only
    assert lib.strata_type_supported(int(Q.TQ1_0)) == 0
    assert lib.strata_row_bytes(int(Q.TQ1_0), 256) == 0
    assert lib.strata_row_bytes(int(Q.Q4_K), 100) == 0
    out = np.zeros(256, dtype=np.float32)
    assert lib.strata_dequantize_row(int(Q.TQ1_0), ffi.NULL, ffi.from_buffer("float[]", out), 256) == \
        lib.STRATA_ERR_UNSUPPORTED
    x = np.zeros((1, 100), dtype=np.float32)
    args = (ffi.from_buffer(bytes(1000)), 1, 100, ffi.from_buffer("float[]", x), 1, ffi.from_buffer("float[]", out))
    assert lib.strata_matmul(int(Q.Q8_0), *args, 1) == lib.STRATA_ERR_INVALID_ARG
    assert lib.strata_matmul_naive(int(Q.Q8_K), *args) == lib.STRATA_ERR_UNSUPPORTED


def test_status_strings_are_distinct():
    codes = [lib.STRATA_OK, lib.STRATA_ERR_INVALID_ARG, lib.STRATA_ERR_UNSUPPORTED, lib.STRATA_ERR_NOMEM,
             lib.STRATA_ERR_CONTEXT_FULL, lib.STRATA_ABORTED]
    texts = {ffi.string(lib.strata_status_string(c)) for c in codes}
    assert len(texts) == len(codes) and b"" not in texts


# --- dequantisation: bit for bit what gguf computes


def assert_same_bits(got: np.ndarray, want: np.ndarray):
    np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_dequantize_random_blocks_bit_exact(qtype):
    rng = np.random.default_rng(int(qtype))
    block = GGML_QUANT_SIZES[qtype][0]
    blocks = random_blocks(qtype, 400, rng)
    assert_same_bits(dequantize(qtype, blocks, 400 * block), quants.dequantize(blocks, qtype).ravel())


@pytest.mark.parametrize("qtype", [Q.BF16, Q.Q8_0, Q.Q4_0])
def test_dequantize_gguf_quantised_rows_bit_exact(qtype):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(64 * 32) * rng.uniform(0.01, 100)).astype(np.float32)
    data = quants.quantize(x, qtype)
    assert_same_bits(dequantize(qtype, data, x.size), quants.dequantize(data, qtype))


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16])
def test_dequantize_every_finite_16_bit_pattern(qtype):
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    exponent_all_ones = 0x7C00 if qtype == Q.F16 else 0x7F80
    nan = ((bits & exponent_all_ones) == exponent_all_ones) & ((bits & ~np.uint16(0x8000 | exponent_all_ones)) != 0)
    bits = bits[~nan]  # infinities stay, NaN payloads are not part of the contract
    want = quants.dequantize(bits.view(np.uint8), qtype)
    assert_same_bits(dequantize(qtype, bits.view(np.uint8), bits.size), want)


def test_dequantize_f32_is_a_copy():
    x = np.random.default_rng(3).standard_normal(1000).astype(np.float32)
    assert_same_bits(dequantize(Q.F32, x.view(np.uint8), x.size), x)


# --- rows of a table: the device backend's token embeddings (strata_get_rows)


@pytest.mark.parametrize("qtype", WEIGHT_TYPES)
def test_get_rows_bit_exact(qtype):
    rng = np.random.default_rng(int(qtype) + 50)
    n_rows, n_cols = 40, 512
    w = random_weights(qtype, n_rows, n_cols, rng)
    ids = np.array([7, 0, 39, 7, 12])  # any order, repeated, both ends
    assert_same_bits(get_rows(qtype, w, n_rows, n_cols, ids), weights_f32(qtype, w, n_cols)[ids])


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q6_K])
def test_get_rows_of_the_writers_encodings(qtype):
    """The generated models' own encodings (strata.modelgen's quantisers), scales spread over decades."""
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((16, 256)) * rng.uniform(0.01, 100, (16, 1))).astype(np.float32)
    w = encode(x, qtype)
    ids = np.arange(16)[::-1]
    assert_same_bits(get_rows(qtype, w, 16, 256, ids), weights_f32(qtype, w, 256)[ids])


def test_get_rows_refusals():
    w = random_weights(Q.Q8_0, 4, 64, np.random.default_rng(1))
    assert get_rows(Q.Q8_0, w, 4, 64, np.zeros(0, np.int32)).shape == (0, 64)
    with pytest.raises(EngineError, match="id 4 \\(at 1\\) outside the table's 4 rows"):
        get_rows(Q.Q8_0, w, 4, 64, np.array([0, 4]))
    with pytest.raises(EngineError, match="id -1"):
        get_rows(Q.Q8_0, w, 4, 64, np.array([-1]))
    with pytest.raises(EngineError, match="bytes hold no 5 rows"):
        get_rows(Q.Q8_0, w, 5, 64, np.array([0]))
    with pytest.raises(EngineError, match="type 34 is not a weight type"):
        get_rows(Q.TQ1_0, w, 1, 64, np.array([0]))
    with pytest.raises(EngineError, match="4 rows of 48 q8_0 values"):
        get_rows(Q.Q8_0, w, 4, 48, np.array([0]))


# --- products

SHAPES = [  # (n_tok, n_rows, n_cols before rounding up to the type's block): one token (decode), a few, more
    # than a tile; odd row counts; 17, 4, 32, 33 and 7 blocks of 32 (every remainder of the kernels' 2- and
    # 4-block steps), and f32 rows with a vector tail; more tokens than one block of 64 (an odd number past it)
    (1, 37, 544), (3, 5, 100), (7, 67, 1000), (20, 33, 1056), (1, 1, 200), (67, 9, 600),
]


def round_up(n_cols: int, qtype: Q) -> int:
    block = GGML_QUANT_SIZES[qtype][0]
    return -(-n_cols // block) * block


def lossless_activations(qtype: Q, n_tok: int, n_cols: int, rng: np.random.Generator) -> np.ndarray:
    """Activations the type's activation quantiser represents exactly: per block, integers in [-127, 127]
    with one of magnitude 127, times a power of two (so amax / 127 is exact, in f16 too)."""
    block = ACT_BLOCK[qtype]
    if block is None:  # activations stay f32
        return rng.standard_normal((n_tok, n_cols), dtype=np.float32)
    q = rng.integers(-127, 128, size=(n_tok * n_cols // block, block))
    q[:, 0] = rng.choice([-127, 127], size=q.shape[0])
    scale = 2.0 ** rng.integers(-8, 1, size=(q.shape[0], 1))
    return (q * scale).astype(np.float32).reshape(n_tok, n_cols)


def accumulation_slack(w32: np.ndarray, x: np.ndarray) -> np.ndarray:
    return ACCUMULATION_RTOL * (np.abs(x.astype(np.float64)) @ np.abs(w32.astype(np.float64)).T) + 1e-30


@pytest.mark.parametrize("qtype", WEIGHT_TYPES)
@pytest.mark.parametrize("n_tok,n_rows,n_cols", SHAPES)
def test_fast_equals_naive_on_lossless_activations(qtype, n_tok, n_rows, n_cols):
    rng = np.random.default_rng(n_tok * 1000 + n_rows + int(qtype))
    n_cols = round_up(n_cols, qtype)
    w = random_weights(qtype, n_rows, n_cols, rng)
    x = lossless_activations(qtype, n_tok, n_cols, rng)
    naive = matmul(qtype, w, x)
    slack = accumulation_slack(weights_f32(qtype, w, n_cols), x)
    for n_threads in (1, 2):
        err = np.abs(matmul(qtype, w, x, n_threads).astype(np.float64) - naive)
        assert np.all(err <= slack), f"{n_threads} threads: worst {np.max(err / slack):.3g} x the tolerance"


def quantisation_bound(qtype: Q, w32: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Largest |y_fast - y_naive| that quantising the activations can explain.

    Each activation moves by less than one step d = amax_block / 127 (half a step from rounding, plus at most
    127 * |d - f16(d)| < 0.07 d from storing d in f16), so |dy| <= sum_i |w_i| d_block(i), plus float slack."""
    block = ACT_BLOCK[qtype]
    if block is None:
        return accumulation_slack(w32, x)
    amax = np.abs(x).reshape(x.shape[0], -1, block).max(axis=2)
    step = np.repeat(amax / 127.0, block, axis=1)
    return step.astype(np.float64) @ np.abs(w32.astype(np.float64)).T + accumulation_slack(w32, x)


@pytest.mark.parametrize("qtype", WEIGHT_TYPES)
@pytest.mark.parametrize("n_tok,n_rows,n_cols", SHAPES)
def test_fast_within_quantisation_error_of_naive(qtype, n_tok, n_rows, n_cols):
    rng = np.random.default_rng(n_tok * 7 + n_rows + int(qtype))
    n_cols = round_up(n_cols, qtype)
    w = random_weights(qtype, n_rows, n_cols, rng)
    x = (rng.standard_normal((n_tok, n_cols)) * rng.uniform(0.1, 10)).astype(np.float32)
    naive = matmul(qtype, w, x)
    err = np.abs(matmul(qtype, w, x, 2).astype(np.float64) - naive)
    bound = quantisation_bound(qtype, weights_f32(qtype, w, n_cols), x)
    assert np.all(err <= bound), f"worst {np.max(err / bound):.3g} x the bound"


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_activation_rounding_is_to_nearest(qtype):
    """The bound above would also admit truncation. Rounding to nearest leaves errors uniform in +-d/2
    (variance d^2 / 12) and independent, so sum_i w_i e_i has variance sum_i w_i^2 d_i^2 / 12; truncation
    would give about 4 times that. Over 2,000 outputs the measured ratio lands within a few percent of 1
    (f16 storage of Q8_0's d adds a little)."""
    rng = np.random.default_rng(5)
    n_tok, n_rows, n_cols = 20, 100, 1024
    w = random_weights(qtype, n_rows, n_cols, rng)
    x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
    err = matmul(qtype, w, x, 2).astype(np.float64) - matmul(qtype, w, x)
    block = ACT_BLOCK[qtype]
    step = np.repeat(np.abs(x).reshape(n_tok, -1, block).max(axis=2) / 127.0, block, axis=1)
    expected_var = (step.astype(np.float64) ** 2 / 12) @ (weights_f32(qtype, w, n_cols).astype(np.float64) ** 2).T
    assert 0.8 < np.mean(err**2) / np.mean(expected_var) < 1.25


@pytest.mark.parametrize("n_tok,n_rows,n_cols", [(1, 9, 100), (5, 31, 257), (16, 64, 1024)])
def test_naive_f32_equals_numpy(n_tok, n_rows, n_cols):
    rng = np.random.default_rng(n_cols)
    w = rng.standard_normal((n_rows, n_cols), dtype=np.float32)
    x = rng.standard_normal((n_tok, n_cols), dtype=np.float32)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    got = matmul(Q.F32, w, x)
    scale = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T  # cancellation leaves |y| << this
    assert np.all(np.abs(got - want) <= 1e-6 * np.maximum(np.abs(want), 1e-3 * scale))


def test_more_threads_than_rows():
    rng = np.random.default_rng(11)
    w = random_weights(Q.Q8_0, 3, 64, rng)
    x = lossless_activations(Q.Q8_0, 2, 64, rng)
    got, naive = matmul(Q.Q8_0, w, x, 8), matmul(Q.Q8_0, w, x)
    assert np.all(np.abs(got - naive) <= accumulation_slack(weights_f32(Q.Q8_0, w, 64), x))


# --- the internal interface the forward pass uses (kernels.h)


@pytest.fixture(scope="module")
def kernels():
    """kernels.h's functions from the engine's shared library (the header minus its preprocessor lines)."""
    header = pathlib.Path(engine_module.__file__).with_name("kernels.h").read_text()
    kffi = cffi.FFI()
    kffi.cdef("\n".join(line for line in header.splitlines() if not line.startswith("#")))
    return kffi, kffi.dlopen(engine_module.__file__)


def quantize_rows(kernels, vec_dot_type: Q, x: np.ndarray) -> np.ndarray:
    kffi, klib = kernels
    n_tok, n = x.shape
    out = np.zeros((n_tok, GGML_QUANT_SIZES[vec_dot_type][1] * n // GGML_QUANT_SIZES[vec_dot_type][0]), np.uint8)
    for t in range(n_tok):
        klib.strata_quantize_row_any(int(vec_dot_type), kffi.from_buffer("float[]", x[t]), kffi.from_buffer(out[t]), n)
    return out


def test_f16_round_trip_matches_numpy(kernels):
    _, klib = kernels
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(20000) * 10.0 ** rng.uniform(-9, 5.5, 20000)).astype(np.float32)  # subnormal to inf
    got = np.array([klib.strata_f32_to_f16(float(v)) for v in x], dtype=np.uint16)
    with np.errstate(over="ignore"):  # overflow to infinity is part of what is compared
        want = x.astype(np.float16)
    np.testing.assert_array_equal(got, want.view(np.uint16))
    back = np.array([klib.strata_f16_to_f32(int(h)) for h in got], dtype=np.float32)
    assert_same_bits(back, got.view(np.float16).astype(np.float32))


def test_quantize_q8_0_matches_gguf(kernels):
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((8, 1024)) * 10.0 ** rng.uniform(-3, 3, (8, 1))).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block
    x[1, :32] = np.arange(-16, 16) * 0.5  # halves: round away from zero
    np.testing.assert_array_equal(quantize_rows(kernels, Q.Q8_0, x), quants.quantize(x, Q.Q8_0))


def test_quantize_q8_k_matches_numpy(kernels):
    """Q8_K as the gguf package quantises Q8_0 (d = amax / 127 in f32, round half away from zero), with d kept
    in f32 and the sum of each 16 values."""
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((4, 512)) * 10.0 ** rng.uniform(-3, 3, (4, 1))).astype(np.float32)
    blocks = x.reshape(-1, 256)
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        q = quants.np_roundf(blocks * np.where(d == 0, np.float32(0), np.float32(1) / d)).astype(np.int8)
    want = np.zeros(len(blocks), dtype=[("d", "<f4"), ("qs", "i1", 256), ("bsums", "<i2", 16)])
    want["d"], want["qs"], want["bsums"] = d[:, 0], q, q.reshape(-1, 16, 16).sum(axis=2, dtype=np.int16)
    got = quantize_rows(kernels, Q.Q8_K, x)
    np.testing.assert_array_equal(got.ravel(), want.view(np.uint8).ravel())


@pytest.mark.parametrize("qtype", WEIGHT_TYPES)
@pytest.mark.parametrize("n_tok", [6, 19])  # a few tokens; enough for the K-quants' prepared rows, plus a pair and one
def test_gemm_rows_matches_its_naive_reference(kernels, qtype, n_tok):
    """A row range [r0, r1) written into a wider y (ldy > rows), as the forward pass splits rows between
    threads; the reference sees the same quantised activations, so only the summation order differs."""
    kffi, klib = kernels
    rng = np.random.default_rng(int(qtype) + 100 + n_tok)
    n_rows, ldy, r0, r1 = 24, 30, 3, 22  # 19 rows: a band of 16 in the K-quant prompt path, and 3 more
    n_cols = round_up(544, qtype)
    w = random_weights(qtype, n_rows, n_cols, rng)
    x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
    vec_dot_type = Q(kernels[1].strata_traits(int(qtype)).vec_dot_type)
    xq = quantize_rows(kernels, vec_dot_type, x)
    x_seen = np.zeros_like(x)
    for t in range(n_tok):
        klib.strata_dequantize_row_any(int(vec_dot_type), kffi.from_buffer(xq[t]),
                                       kffi.from_buffer("float[]", x_seen[t]), n_cols)
    ys = []
    for fn in (klib.strata_gemm_rows, klib.strata_gemm_rows_naive):
        y = np.full((n_tok, ldy), np.nan, dtype=np.float32)
        fn(int(qtype), n_cols, kffi.from_buffer(w), r0, r1, kffi.from_buffer(xq), n_tok,
           kffi.from_buffer("float[]", y), ldy)
        assert np.isnan(y[:, :r0]).all() and np.isnan(y[:, r1:]).all()
        ys.append(y[:, r0:r1].astype(np.float64))
    slack = accumulation_slack(weights_f32(qtype, w, n_cols)[r0:r1], x_seen)
    assert np.all(np.abs(ys[0] - ys[1]) <= slack)
    want = x_seen.astype(np.float64) @ weights_f32(qtype, w, n_cols)[r0:r1].astype(np.float64).T
    assert np.all(np.abs(ys[1] - want) <= 1e-6 * np.abs(want) + 1e-30)


@pytest.mark.parametrize("n_tok", [7, 29, 39])
@pytest.mark.parametrize("qtype", WEIGHT_TYPES)
def test_a_tokens_row_does_not_depend_on_the_tokens_beside_it(kernels, qtype, n_tok):
    """Each token's outputs are the same bits whether it is the product's only token (decode: the direct tiles)
    or one of 7 (a few sequences decoding: direct tiles of four tokens, two and one) or 39 (a prompt: rows
    prepared once, in tiles of several tokens and the rest, and rows beyond the prepared tiles), so a sequence's
    logits in a batch equal its logits alone."""
    kffi, klib = kernels
    rng = np.random.default_rng(int(qtype) + 300)
    n_rows = 41  # prompt bands of 16 rows and 9 more; 39 tokens go 8 at a time and 4 + 2 + 1
    n_cols = round_up(544, qtype)
    w = random_weights(qtype, n_rows, n_cols, rng)
    xq = quantize_rows(kernels, Q(klib.strata_traits(int(qtype)).vec_dot_type),
                       rng.standard_normal((n_tok, n_cols)).astype(np.float32))

    def product(x: np.ndarray) -> np.ndarray:
        y = np.zeros((len(x), n_rows), dtype=np.float32)
        klib.strata_gemm_rows(int(qtype), n_cols, kffi.from_buffer(w), 0, n_rows, kffi.from_buffer(x), len(x),
                              kffi.from_buffer("float[]", y), n_rows)
        return y

    together = product(xq)
    for t in range(n_tok):
        assert_same_bits(product(xq[t:t + 1]), together[t:t + 1])


@pytest.mark.parametrize("r0, r1", [(3, 12), (16, 41), (5, 41)])
def test_q8_0_rows_in_any_range_do_not_depend_on_the_tokens_beside_them(kernels, r0, r1):
    """Q8_0 rows read as they lie, over a range of fewer rows than a tile of the tile unit (AMX, where the machine
    has it) and over ranges whose last tile reaches back into rows already written: each of 1 to 20 tokens gets
    the same bits alone (the exact VNNI tiles) as with the others (those tiles, bands laid out per call, or the tile
    unit), only the range's rows are written, and every output is within the quantisation bound of the naive
    product."""
    kffi, klib = kernels
    rng = np.random.default_rng(r0 * 100 + r1)
    n_rows, n_cols = 41, 17 * 32  # an odd block count
    w = random_weights(Q.Q8_0, n_rows, n_cols, rng)
    x = rng.standard_normal((20, n_cols)).astype(np.float32)
    xq = quantize_rows(kernels, Q.Q8_0, x)

    def product(rows: np.ndarray) -> np.ndarray:
        y = np.full((len(rows), n_rows), np.nan, dtype=np.float32)
        klib.strata_gemm_rows(int(Q.Q8_0), n_cols, kffi.from_buffer(w), r0, r1, kffi.from_buffer(rows), len(rows),
                              kffi.from_buffer("float[]", y), n_rows)
        return y

    for n_tok in (1, 2, 3, 17, 20):
        together = product(xq[:n_tok])
        assert np.isnan(together[:, :r0]).all() and np.isnan(together[:, r1:]).all()
        for t in range(n_tok):
            assert_same_bits(product(xq[t:t + 1]), together[t:t + 1])
        err = np.abs(together[:, r0:r1].astype(np.float64) - matmul(Q.Q8_0, w, x[:n_tok])[:, r0:r1])
        assert np.all(err <= quantisation_bound(Q.Q8_0, weights_f32(Q.Q8_0, w, n_cols)[r0:r1], x[:n_tok]))


# --- the band layout the engine keeps of a Q8_0 output weight (AVX-512 VNNI builds)


def vnni_native_build() -> bool:
    """This build was compiled for this CPU (no STRATA_MARCH), and the CPU has AVX-512 VNNI."""
    cpu = pathlib.Path("/proc/cpuinfo")
    return "STRATA_MARCH" not in os.environ and cpu.exists() and "avx512_vnni" in cpu.read_text()


def bands_of(w: np.ndarray, n_cols: int) -> np.ndarray:
    n_bytes = lib.strata_bands_bytes(int(Q.Q8_0), w.shape[0], n_cols)
    if not n_bytes:
        assert not vnni_native_build(), "a native AVX-512 VNNI build lays Q8_0 out in bands"
        assert lib.strata_bands_prepare(int(Q.Q8_0), ffi.from_buffer(w), w.shape[0], n_cols,
                                        ffi.from_buffer(np.zeros(64, np.uint8))) == lib.STRATA_ERR_UNSUPPORTED
        pytest.skip("this build keeps Q8_0 on its direct tiles")
    bands = np.full(n_bytes, 0x55, dtype=np.uint8)  # every byte is written
    assert lib.strata_bands_prepare(int(Q.Q8_0), ffi.from_buffer(w), w.shape[0], n_cols,
                                    ffi.from_buffer(bands)) == lib.STRATA_OK
    return bands


def matmul_bands(bands: np.ndarray, n_rows: int, x: np.ndarray, n_threads: int) -> np.ndarray:
    n_tok, n_cols = x.shape
    y = np.full((n_tok, n_rows), np.nan, dtype=np.float32)
    status = lib.strata_matmul_bands(int(Q.Q8_0), ffi.from_buffer(bands), n_rows, n_cols,
                                     ffi.from_buffer("float[]", x), n_tok, ffi.from_buffer("float[]", y), n_threads)
    assert status == lib.STRATA_OK, ffi.string(lib.strata_status_string(status))
    return y


def test_only_q8_0_has_a_band_layout():
    assert lib.strata_bands_bytes(int(Q.Q4_K), 64, 512) == 0
    assert lib.strata_bands_bytes(int(Q.F32), 64, 512) == 0
    assert lib.strata_bands_bytes(int(Q.Q8_0), 64, 100) == 0  # not whole blocks
    if vnni_native_build():  # 16 rows a band; pairs of blocks of 32 values + 16 scales each, odd counts padded
        assert lib.strata_bands_bytes(int(Q.Q8_0), 41, 544) == 3 * 9 * (2 * 16 * 34)


@pytest.mark.parametrize("n_tok,n_rows,n_cols", [(1, 41, 544), (7, 41, 544), (2, 16, 32), (39, 37, 1056),
                                                 (5, 3, 96), (13, 150, 64)])
def test_bands_equal_naive_on_lossless_activations(n_tok, n_rows, n_cols):
    rng = np.random.default_rng(n_tok * 100 + n_rows)
    w = random_weights(Q.Q8_0, n_rows, n_cols, rng)
    x = lossless_activations(Q.Q8_0, n_tok, n_cols, rng)
    bands = bands_of(w, n_cols)
    naive = matmul(Q.Q8_0, w, x)
    slack = accumulation_slack(weights_f32(Q.Q8_0, w, n_cols), x)
    for n_threads in (1, 2):
        err = np.abs(matmul_bands(bands, n_rows, x, n_threads).astype(np.float64) - naive)
        assert np.all(err <= slack), f"{n_threads} threads: worst {np.max(err / slack):.3g} x the tolerance"


@pytest.mark.parametrize("n_tok", [7, 39])
def test_a_tokens_row_from_the_bands_does_not_depend_on_the_tokens_beside_it(n_tok):
    """The engine reads its output weight from the bands for 1 token as for many: each token's logits are the
    same bits alone and in a batch, whatever tiles (8, 4, 2, 1 tokens) and streams of bands its row took."""
    rng = np.random.default_rng(n_tok + 500)
    n_rows, n_cols = 41, 544  # 2 bands and 9 rows of a third
    w = random_weights(Q.Q8_0, n_rows, n_cols, rng)
    x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
    bands = bands_of(w, n_cols)
    together = matmul_bands(bands, n_rows, x, 1)
    for t in range(n_tok):
        assert_same_bits(matmul_bands(bands, n_rows, x[t:t + 1], 1), together[t:t + 1])
    assert_same_bits(matmul_bands(bands, n_rows, x, 2), together)
    err = np.abs(together.astype(np.float64) - matmul(Q.Q8_0, w, x))
    assert np.all(err <= quantisation_bound(Q.Q8_0, weights_f32(Q.Q8_0, w, n_cols), x))


def test_the_tile_unit_gives_the_vnni_tiles_bits():
    """Where the machine has the tile unit (AMX), products of 4 tokens and more from the bands take it: each group
    of up to 16 tokens, and a last one of any size, gives the same bits as the VNNI tiles, at 1 and 2 threads."""
    bound = lib.strata_bands_amx(0)
    amx_flags = pathlib.Path("/proc/cpuinfo").exists() and "amx_int8" in pathlib.Path("/proc/cpuinfo").read_text()
    if not bound:
        assert not (vnni_native_build() and amx_flags), "a native build on a CPU with AMX uses the tile unit"
        pytest.skip("no tile unit in this build or on this machine")
    assert bound == 4
    rng = np.random.default_rng(77)
    n_rows, n_cols = 16 * 11 + 5, 544  # bands in 3 streams and the rest, a partial last band, an odd block count
    w = random_weights(Q.Q8_0, n_rows, n_cols, rng)
    bands = bands_of(w, n_cols)
    x = rng.standard_normal((37, n_cols)).astype(np.float32)
    try:
        for n_tok in (1, 4, 5, 8, 9, 16, 17, 20, 37):
            for n_threads in (1, 2):
                lib.strata_bands_amx(1)  # every product on the tile unit
                tiles = matmul_bands(bands, n_rows, x[:n_tok], n_threads)
                lib.strata_bands_amx(1 << 30)  # none
                assert_same_bits(tiles, matmul_bands(bands, n_rows, x[:n_tok], n_threads))
    finally:
        lib.strata_bands_amx(bound)


def test_gemm_bands_writes_only_its_rows(kernels):
    """A range of whole bands and a partial last one, into a wider y, as the forward pass splits rows between
    threads; the same quantised activations through the direct tiles differ only in summation order."""
    kffi, klib = kernels
    rng = np.random.default_rng(9)
    n_tok, n_rows, n_cols, ldy, r0, r1 = 5, 70, 544, 75, 16, 67
    w = random_weights(Q.Q8_0, n_rows, n_cols, rng)
    bands = bands_of(w, n_cols)
    x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
    xq = quantize_rows(kernels, Q.Q8_0, x)
    x_seen = np.zeros_like(x)
    for t in range(n_tok):
        klib.strata_dequantize_row_any(int(Q.Q8_0), kffi.from_buffer(xq[t]), kffi.from_buffer("float[]", x_seen[t]),
                                       n_cols)
    calls = [lambda y: klib.strata_gemm_bands(int(Q.Q8_0), kffi.from_buffer(bands), n_cols, r0, r1,
                                              kffi.from_buffer(xq), n_tok, kffi.from_buffer("float[]", y), ldy),
             lambda y: klib.strata_gemm_rows(int(Q.Q8_0), n_cols, kffi.from_buffer(w), r0, r1, kffi.from_buffer(xq),
                                             n_tok, kffi.from_buffer("float[]", y), ldy)]
    ys = []
    for call in calls:
        y = np.full((n_tok, ldy), np.nan, dtype=np.float32)
        call(y)
        assert np.isnan(y[:, :r0]).all() and np.isnan(y[:, r1:]).all()
        ys.append(y[:, r0:r1].astype(np.float64))
    slack = 2 * accumulation_slack(weights_f32(Q.Q8_0, w, n_cols)[r0:r1], x_seen)
    assert np.all(np.abs(ys[0] - ys[1]) <= slack)


@pytest.mark.parametrize("n_rows,n_cols", [(41, 544), (16, 32), (37, 1056), (3, 96), (150, 64), (70, 4096)])
def test_q8_0_rows_give_the_bits_of_their_bands(n_rows, n_cols):
    """Where a copy at load lays a Q8_0 weight out in bands, its rows as they lie in the file (mapped weights) give
    the same bits for 1 to 20 tokens at 1 and 2 threads: decode through the rows' exact tiles, prompts through bands
    laid out per call, both in the bands' f32 steps."""
    rng = np.random.default_rng(n_rows * 10 + n_cols)
    w = random_weights(Q.Q8_0, n_rows, n_cols, rng)
    bands = bands_of(w, n_cols)
    x = rng.standard_normal((20, n_cols)).astype(np.float32)
    x[::3, rng.integers(0, n_cols, 3)] *= 50  # an outlier widens a block's scale
    for n_tok in range(1, 21):
        for n_threads in (1, 2):
            assert_same_bits(matmul(Q.Q8_0, w, x[:n_tok], n_threads), matmul_bands(bands, n_rows, x[:n_tok], n_threads))
