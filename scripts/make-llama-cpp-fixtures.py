#!/usr/bin/env python3
"""Regenerate tests/engine/data/llama_cpp_quants.json and .bin.xz: files written by llama.cpp's own quantizer and
llama.cpp's logits on them, which tests/engine/test_llama_cpp_files.py reads without llama.cpp.

Needs llama-cpp-python (`pip install llama-cpp-python==0.3.36`, which builds llama.cpp from source: ~20 minutes
on 2 cores) in the environment of the suite (`. .venv/bin/activate`). It generates a small qwen3moe with our
writer, quantises it with `llama_model_quantize` to each preset (with an importance matrix where llama.cpp
requires one), has llama.cpp score a fixed prompt on every file, and packs files and logits (each distinct tensor
stored once, xz-compressed). The same steps run in the test when llama-cpp-python is installed, and must give the
same bytes: rerun this script after changing the model generator or upgrading llama.cpp, and commit the result.

    python scripts/make-llama-cpp-fixtures.py [PRESET ...]   # default: every preset
"""

from __future__ import annotations

import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

from llama_cpp_quantize import DATA, PRESETS, make


def main() -> None:
    presets = sys.argv[1:] or PRESETS
    unknown = sorted(set(presets) - set(PRESETS))
    if unknown:
        sys.exit(f"unknown presets {unknown}; known: {' '.join(PRESETS)}")
    with tempfile.TemporaryDirectory() as work:
        manifest = make(pathlib.Path(work), presets)
    for preset, entry in manifest["presets"].items():
        types = sorted({t for _name, t, *_ in entry["tensors"]})
        print(f"{preset:10} {entry['size']:8} bytes  {' '.join(types)}")
    for suffix in (".json", ".bin.xz"):
        path = DATA.with_suffix(suffix)
        print(f"wrote {path.relative_to(DATA.parents[3])} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
