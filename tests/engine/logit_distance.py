"""A file's logits from our engine and from llama.cpp (`llama_cpp.Llama`), both with an f32 KV cache, and their
distance from the exact maths: what test_qwen35_quantised.py checks and bench/quant_distance.py sweeps."""

from __future__ import annotations

import pathlib

import numpy as np
from llama_cpp_quantize import llama_in_cpu_layout

from strata.engine_cffi import Engine


def ours(path: pathlib.Path, tokens: list[int]) -> np.ndarray:
    with Engine.load(path, n_ctx=512, threads=2, kv="f32", n_batch=512) as engine:
        return engine.eval(tokens, all_logits=True)


def llama_cpp(path: pathlib.Path, tokens: list[int]) -> np.ndarray:
    import llama_cpp

    llm = llama_in_cpu_layout(model_path=str(path), n_ctx=512, n_batch=512, n_ubatch=512, n_threads=2,
                              n_threads_batch=2, type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32,
                              logits_all=True, verbose=False)
    try:
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)], dtype=np.float32)
    finally:
        llm.close()


def median_distance(got: np.ndarray, exact: np.ndarray) -> float:
    """Per position max |got - exact| / std(exact); the median over positions."""
    return float(np.median(np.abs(got - exact).max(axis=-1) / exact.std()))
