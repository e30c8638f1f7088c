"""Build the C engine as the cffi extension `strata.engine_cffi._engine` (API mode, out of line).

`pip install .` runs this through setup.py's `cffi_modules`; `python build_engine.py` rebuilds the extension in
place during development. The cdef is `strata_engine.h` itself, so every declaration exists once.

With `nvcc` on the PATH (or in $CUDA_HOME/bin), the in-place build also compiles the CUDA kernels (cuda/*.cu) into
`libstrata_cuda.so` beside the extension, which the engine loads with dlopen only when a CUDA device is asked for;
without nvcc the extension is built exactly the same and says so in one line.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from cffi import FFI

ROOT = pathlib.Path(__file__).resolve().parent
ENGINE_DIR = ROOT / "src" / "strata" / "engine_cffi"
HEADER = ENGINE_DIR / "strata_engine.h"
MODULE = "strata.engine_cffi._engine"
CUDA_DIR = ENGINE_DIR / "cuda"
CUDA_LIBRARY = ENGINE_DIR / "libstrata_cuda.so"
# the card generations the library runs on: Ampere consumer cards, Ada, Hopper (STRATA_CUDA_ARCHS overrides)
CUDA_ARCHS = os.environ.get("STRATA_CUDA_ARCHS", "86,89,90").split(",")
NVCC_ARGS = ["-O3", "-std=c++17", "-Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra,-fPIC,-fvisibility=hidden"]

# the forward pass runs on our own pthread pool; OpenMP remains for strata_matmul
# -fno-semantic-interposition: calls between our own exported functions stay direct (and inlinable) under -fPIC.
# STRATA_MARCH (e.g. haswell for the AVX2 paths, x86-64 for the scalar ones) builds for another CPU than this one.
COMPILE_ARGS = ["-O3", f"-march={os.environ.get('STRATA_MARCH', 'native')}", "-fno-semantic-interposition", "-std=gnu11", "-pthread", "-fopenmp",
                "-Wall", "-Wno-unused-function"]
# -fopenmp again at link time, else omp_* symbols are undefined at import; -ldl for the CUDA library's dlopen
LINK_ARGS = ["-pthread", "-fopenmp", "-lm", "-ldl"]


def make_builder(base: pathlib.Path | None) -> FFI:
    """The cffi builder with paths relative to `base`, or absolute for None: setuptools wants them relative to the
    project root, while the in-place build compiles inside its build directory and so needs them absolute."""

    def path(p: pathlib.Path) -> str:
        return str(p if base is None else p.relative_to(base))

    builder = FFI()
    builder.cdef(HEADER.read_text())
    builder.set_source(
        MODULE,
        '#include <stddef.h>\n#include "strata_engine.h"\n',
        sources=sorted(path(p) for p in [*ENGINE_DIR.glob("*.c"), *CUDA_DIR.glob("*.c")]),
        include_dirs=[path(ENGINE_DIR)],
        extra_compile_args=COMPILE_ARGS,
        extra_link_args=LINK_ARGS,
    )
    return builder


ffibuilder = make_builder(ROOT)


def build_in_place() -> pathlib.Path:
    """Compile into build/ and copy the extension next to the Python wrapper."""
    build_dir = os.environ.get("STRATA_BUILD_DIR", str(ROOT / "build" / "cffi"))
    built = pathlib.Path(make_builder(None).compile(tmpdir=build_dir, verbose=False))
    target = ENGINE_DIR / built.name
    # copy then rename: a process that has the old extension loaded keeps its file (overwriting it in place
    # crashes that process)
    staged = target.with_suffix(".tmp")
    shutil.copyfile(built, staged)
    os.replace(staged, target)
    return target


def find_nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    return shutil.which("nvcc") or shutil.which("nvcc", path=os.path.join(cuda_home, "bin"))


def nvcc_command(nvcc: str, source: pathlib.Path, out: pathlib.Path, archs: list[str]) -> list[str]:
    """The command compiling one .cu file into an object for `archs` (e.g. ["86", "90"])."""
    gencode = [arg for a in archs for arg in ("-gencode", f"arch=compute_{a},code=sm_{a}")]
    return [nvcc, *NVCC_ARGS, *gencode, "-c", str(source), "-o", str(out)]


def build_cuda_library(nvcc: str) -> pathlib.Path:
    """Compile cuda/*.cu (one nvcc per file, side by side) and link them into libstrata_cuda.so, the CUDA
    runtime linked in statically (the library needs only the driver where it runs)."""
    build_dir = pathlib.Path(os.environ.get("STRATA_BUILD_DIR", str(ROOT / "build" / "cffi"))) / "cuda"
    build_dir.mkdir(parents=True, exist_ok=True)
    sources = sorted(CUDA_DIR.glob("*.cu"))
    objects = [build_dir / (s.stem + ".o") for s in sources]
    commands = [nvcc_command(nvcc, source, obj, CUDA_ARCHS) for source, obj in zip(sources, objects, strict=True)]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        runs = list(pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True), commands))
    for run in runs:
        if run.returncode != 0:
            raise RuntimeError(f"nvcc failed:\n{run.stdout}{run.stderr}")
    staged = CUDA_LIBRARY.with_suffix(".tmp")
    subprocess.run([nvcc, "-shared", "-o", str(staged), *map(str, objects)], check=True)
    os.replace(staged, CUDA_LIBRARY)
    return CUDA_LIBRARY


if __name__ == "__main__":
    if sys.argv[1:] != ["--cuda"]:  # --cuda: the CUDA library alone (the extension came from pip)
        print(build_in_place(), file=sys.stderr)
    nvcc = find_nvcc()
    if nvcc:
        print(build_cuda_library(nvcc), file=sys.stderr)
    else:
        print("nvcc not found: the CPU engine only (no libstrata_cuda.so)", file=sys.stderr)
