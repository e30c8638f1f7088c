"""Files written by llama.cpp's own quantizer, read by our engine: logits against llama.cpp's on the same file.

A generated qwen3moe model (F32, every token routed to every expert, so that no near-tie in routing can send the
two engines down different experts) goes through `llama_model_quantize` to each preset; both engines then score
the same prompt, max |ours - llama.cpp| / max |llama.cpp| per position. On the F32 source the two agree to 3e-4;
on every preset here the worst position measured 1.3-2.4% (MXFP4_MOE 1.3%, Q3_K_L 2.4%), and a Q8_0 file from
our own writer shows the same 1.6%, though our Q8_0 product agrees with ggml's on the same weights and
activations to 2e-7: that gap lies in how the two forward passes treat quantised models, not in the block
formats. A block layout read differently from llama.cpp gives O(1), far above the tolerance.

Skipped when llama-cpp-python (the `bench` extra) is not installed. The presets that need an importance matrix
(IQ3_XXS, IQ2_*, IQ1_*) are not here: llama_model_quantize takes it only as a C++ object.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from gguf import GGUFReader

from strata.engine_cffi import Engine
from strata.modelgen import write_random_model

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

PRESETS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M",
           "Q5_K_S", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_M", "MXFP4_MOE"]
TOLERANCE = 5e-2
N_TOKENS = 24


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("llama_cpp") / "f32.gguf"
    return write_random_model(path, arch="qwen3moe", size="tiny", dtype="f32", n_expert_used=8)


def quantize(source: pathlib.Path, out: pathlib.Path, preset: str) -> pathlib.Path:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{preset}")
    params.nthread = 2
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params)
    assert status == 0, f"llama_model_quantize({preset}) returned {status}"
    return out


def llama_cpp_logits(path: pathlib.Path, tokens: list[int]) -> np.ndarray:
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=64, n_threads=2, logits_all=True,
                          verbose=False)
    try:
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)], dtype=np.float32)
    finally:
        llm.close()


def our_logits(path: pathlib.Path, tokens: list[int]) -> np.ndarray:
    with Engine.load(path, n_ctx=64, threads=2, kv="f16", n_batch=64) as engine:
        return engine.eval(tokens, all_logits=True)


@pytest.mark.parametrize("preset", PRESETS)
def test_quantised_file_matches_llama_cpp(source: pathlib.Path, tmp_path: pathlib.Path, preset: str) -> None:
    path = quantize(source, tmp_path / f"{preset}.gguf", preset)
    types = {t.tensor_type.name for t in GGUFReader(path).tensors}
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, 256, N_TOKENS)]
    ours, theirs = our_logits(path, tokens), llama_cpp_logits(path, tokens)
    err = np.abs(ours - theirs).max(axis=1) / np.abs(theirs).max(axis=1)
    assert np.all(err < TOLERANCE), f"{preset} ({sorted(types)}): relative errors {np.round(err, 4)}"
