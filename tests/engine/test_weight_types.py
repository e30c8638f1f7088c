"""Every weight type through the model loader and the forward pass.

A tiny qwen3 model whose matrices are random valid blocks of one type, against the same model with those blocks
dequantised (by the `gguf` package) to F32: the two differ only by the activation quantisation (Q8_0 or Q8_K) the
quantised products apply, as llama.cpp's do.
"""

from __future__ import annotations

import math
import pathlib

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFWriter, quants
from gguf import GGMLQuantizationType as Q
from test_kernels import QUANT_TYPES

from strata.engine_cffi import Engine
from strata.modelgen.hparams import hparams_for
from strata.modelgen.quants import random_blocks
from strata.modelgen.vocab import get_vocab
from strata.modelgen.writer import _add_hparams, add_vocab, tensor_specs

# Logits relative to their largest. Rounding activations to 8 bits before every product of two layers of random
# blocks measured 0.5-11% (Q8_0 2%, Q4_K 11%: random blocks make a chaotic network); a wrong block layout or
# kernel gives uncorrelated logits, O(1).
TOLERANCE = 0.15


def write_pair(tmp_path: pathlib.Path, qtype: Q) -> tuple[pathlib.Path, pathlib.Path]:
    """The model with its matrices in `qtype`, and its F32 twin."""
    hp, voc = hparams_for("qwen3", "tiny"), get_vocab("bytes")
    rng = np.random.default_rng(int(qtype))
    block, size = GGML_QUANT_SIZES[qtype]
    tensors = []
    for spec in tensor_specs("qwen3", hp, voc.n_vocab, "f32"):
        if len(spec.shape) == 1:  # norms; small q/k norms keep attention soft, so errors are not amplified
            gain = 0.2 if "q_norm" in spec.name or "k_norm" in spec.name else 1.0
            tensors.append((spec.name, (np.full(spec.shape, gain, np.float32),) * 2))
            continue
        n_blocks = math.prod(spec.shape) // block
        data = random_blocks(qtype, n_blocks, rng).reshape(*spec.shape[:-1], spec.shape[-1] // block * size)
        tensors.append((spec.name, (data, quants.dequantize(data, qtype))))
    paths = []
    for twin in (0, 1):
        path = tmp_path / f"{qtype.name}-{twin}.gguf"
        writer = GGUFWriter(path, "qwen3")
        _add_hparams(writer, "qwen3", hp, voc.n_vocab)
        add_vocab(writer, voc)
        for name, pair in tensors:
            arr = pair[twin]
            if twin == 0 and arr.dtype == np.uint8:
                writer.add_tensor(name, arr, raw_dtype=qtype)
            else:
                writer.add_tensor(name, arr.astype(np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        paths.append(path)
    return paths[0], paths[1]


def logits(path: pathlib.Path, tokens: list[int]) -> np.ndarray:
    with Engine.load(path, n_ctx=64, threads=2, kv="f32", n_batch=8) as engine:
        return engine.eval(tokens, all_logits=True)


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_model_of_each_weight_type_matches_its_f32_twin(tmp_path, qtype):
    quantised, twin = write_pair(tmp_path, qtype)
    tokens = list(np.random.default_rng(0).integers(0, 256, 12))
    got, want = logits(quantised, tokens), logits(twin, tokens)
    err = np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)
    assert np.all(err < TOLERANCE), f"relative errors per position {np.round(err, 4)}"
