"""Quantised Qwen3.5 files' distance from their exact maths, ours beside llama.cpp's, over several random models
and prompts: how much of a gap between the two engines' distances is a difference in the maths and how much is
the spread of a single draw. Needs llama-cpp-python and llama.cpp's converter (as tests/engine/
test_qwen35_quantised.py, whose one model and prompt are `--models 1 --prompts 1`).

    python bench/quant_distance.py [--arch qwen35moe] [--models 6] [--prompts 9] [--presets Q8_0,Q4_K_M,IQ4_XS]

Each model is a random 4-layer checkpoint (`qwen35_checkpoints`, full attention every 2nd layer, seed 0, 1, ...)
converted by llama.cpp's converter and quantised by its quantizer to each preset; each prompt is 300 random token
ids (seeds 5, 6, ...). Exact: our engine on the file dequantised to F32. Distance: per position max |logits -
exact| / std(exact), the median over positions. Per case the ratio ours / llama.cpp.

The two engines' products differ in two places, where ggml rounds more: F16 weights take F16 activations in ggml
(F32 ones here), Q4_1 / Q5_1 weights take Q8_1 ones, whose block sums are stored as f16 (Q8_0 ones here, the sum
kept exact). So each case also has a floor: the same ratio on a copy of the file with its F16, Q4_1 and Q5_1
tensors dequantised to F32 (the same weights, which both engines then multiply in F32), where the engines agree
to ~5e-7 of the logits' std until a rounding-order difference flips an expert choice or an activation's int8
step, which the recurrent state carries on: what such flips alone do to the median.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
# not bench/ itself: its kernels.py would stand for the `kernels` package that transformers imports
sys.path[:] = [str(ROOT / "tests"), str(ROOT / "tests" / "engine"),
               *(p for p in sys.path if pathlib.Path(p or ".").resolve() != ROOT / "bench")]

from gguf import GGMLQuantizationType, GGUFReader  # noqa: E402
from gguf_rewrite import rewrite  # noqa: E402
from llama_cpp_convert import qwen_tokenizer  # noqa: E402
from llama_cpp_quantize import quantize  # noqa: E402
from logit_distance import llama_cpp, median_distance, ours  # noqa: E402
from qwen35_checkpoints import checkpoint, convert_checkpoint  # noqa: E402

N_TOKENS = 300


# the weight types whose products ggml rounds otherwise than our engine (see above)
OTHERWISE = frozenset({GGMLQuantizationType.F16, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_1})


def model_files(arch: str, seed: int, presets: list[str], work: pathlib.Path,
                tokenizer: pathlib.Path) -> dict[str, tuple[pathlib.Path, pathlib.Path, pathlib.Path]]:
    """Each preset's file, its dequantised copy and its copy with the OTHERWISE tensors dequantised, for the model
    of `seed`."""
    directory = work / f"{arch}-{seed}"
    directory.mkdir()
    source = convert_checkpoint(checkpoint(arch, n_layer=4, interval=2, seed=seed), directory, tokenizer)
    files = {}
    for preset in presets:
        path = quantize(source, directory / f"{preset}.gguf", preset)
        reader = GGUFReader(path)
        files[preset] = (path, rewrite(reader, directory / f"{preset}-f32.gguf", dequantised=True),
                         rewrite(reader, directory / f"{preset}-same.gguf", dequantised=OTHERWISE))
    return files


def summary(name: str, ratios: list[float]) -> str:
    mean, spread = statistics.fmean(ratios), statistics.stdev(ratios) if len(ratios) > 1 else 0.0
    farther = sum(r > 1 for r in ratios)
    return (f"{name}: {len(ratios)} cases, mean {mean:.4f} (s.e. {spread / len(ratios) ** 0.5:.4f}), "
            f"s.d. {spread:.4f}, {min(ratios):.3f}-{max(ratios):.3f}, above 1 in {farther}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="qwen35moe", choices=["qwen35moe", "qwen35"])
    parser.add_argument("--models", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=9)
    parser.add_argument("--presets", default="Q8_0,Q4_K_M,IQ4_XS")
    args = parser.parse_args()
    presets = args.presets.split(",")
    ratios: dict[str, list[float]] = {p: [] for p in presets}
    floor: list[float] = []
    print("model prompt preset   ours    llama.cpp ratio  | floor: ours    llama.cpp ratio")
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        (work / "tokenizer").mkdir()
        qwen_tokenizer(work / "tokenizer")
        for seed in range(args.models):
            files = model_files(args.arch, seed, presets, work, work / "tokenizer")
            for prompt in range(5, 5 + args.prompts):
                tokens = [int(t) for t in np.random.default_rng(prompt).integers(0, 151000, N_TOKENS)]
                for preset, (path, dequantised, same) in files.items():
                    exact = ours(dequantised, tokens)
                    a, b = (median_distance(run(path, tokens), exact) for run in (ours, llama_cpp))
                    c, d = (median_distance(run(same, tokens), exact) for run in (ours, llama_cpp))
                    ratios[preset].append(a / b)
                    floor.append(c / d)
                    print(f"{seed:5d} {prompt:6d} {preset:7s} {a:.4f}  {b:.4f}    {a / b:.3f}  | "
                          f"{c:.4f}  {d:.4f}    {c / d:.3f}", flush=True)
    for preset, values in ratios.items():
        print(summary(f"ours / llama.cpp, {preset}", values))
    print(summary("ours / llama.cpp, all", [r for values in ratios.values() for r in values]))
    print(summary("floor: ours / llama.cpp, F16, Q4_1 and Q5_1 tensors as F32", floor))


if __name__ == "__main__":
    main()
