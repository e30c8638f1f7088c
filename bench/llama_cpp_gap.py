"""Where our logits and llama.cpp's part on quantised files: each engine against itself and against the other,
with f16 and f32 KV caches, several batch sizes and thread counts, on the files of tests/engine/data/
(`tests/llama_cpp_quantize.py`). Needs llama-cpp-python.

    python bench/llama_cpp_gap.py [PRESET ...]

Each column is max over the prompt's positions of max |a - b| / max |b|. The f32-cache columns isolate the
weight formats; the f16-cache ones are what both engines run by default. Findings are in the docstring of
tests/engine/test_llama_cpp_files.py.
"""

from __future__ import annotations

import pathlib
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from llama_cpp_quantize import PRESETS, Packed, llama_cpp_logits, write_source  # noqa: E402

from strata.engine_cffi import Engine  # noqa: E402


def ours(path: pathlib.Path, tokens: list[int], kv: str, n_batch: int = 64, threads: int = 2) -> np.ndarray:
    with Engine.load(path, n_ctx=64, threads=threads, kv=kv, n_batch=n_batch) as engine:
        return np.concatenate([engine.eval(tokens[i:i + n_batch], all_logits=True)
                               for i in range(0, len(tokens), n_batch)])


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float((np.abs(a - b).max(axis=1) / np.abs(b).max(axis=1)).max())


COLUMNS = ["ours/lcpp f32", "ours/lcpp f16", "lcpp f16/f32", "ours f16/f32", "lcpp b1/b64", "ours b1/b64",
           "lcpp t1/t2", "ours t1/t2"]


def row(path: pathlib.Path, tokens: list[int]) -> list[float]:
    l32, l16 = llama_cpp_logits(path, tokens, "f32"), llama_cpp_logits(path, tokens, "f16")
    o32, o16 = ours(path, tokens, "f32"), ours(path, tokens, "f16")
    lcpp_b1, ours_b1 = llama_cpp_logits(path, tokens, "f32", n_batch=1), ours(path, tokens, "f32", n_batch=1)
    lcpp_t1, ours_t1 = llama_cpp_logits(path, tokens, "f32", n_threads=1), ours(path, tokens, "f32", threads=1)
    return [rel(o32, l32), rel(o16, l16), rel(l16, l32), rel(o16, o32), rel(lcpp_b1, l32), rel(ours_b1, o32),
            rel(lcpp_t1, l32), rel(ours_t1, o32)]


def main() -> None:
    packed = Packed()
    tokens = packed.manifest["tokens"]
    presets = sys.argv[1:] or PRESETS
    print(f"{'file':10} " + " ".join(f"{c:>13}" for c in COLUMNS))
    with tempfile.TemporaryDirectory() as work:
        files = {"source": write_source(pathlib.Path(work) / "source.gguf")}
        files |= {p: packed.unpack(p, pathlib.Path(work) / f"{p}.gguf") for p in presets}
        for name, path in files.items():
            print(f"{name:10} " + " ".join(f"{v:13.1e}" for v in row(path, tokens)), flush=True)


if __name__ == "__main__":
    main()
