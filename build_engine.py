"""Build the C engine as the cffi extension `strata.engine_cffi._engine` (API mode, out of line).

`pip install .` runs this through setup.py's `cffi_modules`; `python build_engine.py` rebuilds the extension in
place during development. The cdef is `strata_engine.h` itself, so every declaration exists once.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys

from cffi import FFI

ROOT = pathlib.Path(__file__).resolve().parent
ENGINE_DIR = ROOT / "src" / "strata" / "engine_cffi"
HEADER = ENGINE_DIR / "strata_engine.h"
MODULE = "strata.engine_cffi._engine"

# the forward pass runs on our own pthread pool; OpenMP remains for strata_matmul
# -fno-semantic-interposition: calls between our own exported functions stay direct (and inlinable) under -fPIC.
# STRATA_MARCH (e.g. haswell for the AVX2 paths, x86-64 for the scalar ones) builds for another CPU than this one.
COMPILE_ARGS = ["-O3", f"-march={os.environ.get('STRATA_MARCH', 'native')}", "-fno-semantic-interposition", "-std=gnu11", "-pthread", "-fopenmp",
                "-Wall", "-Wno-unused-function"]
LINK_ARGS = ["-pthread", "-fopenmp", "-lm"]  # -fopenmp again at link time, else omp_* symbols are undefined at import


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
        sources=sorted(path(p) for p in ENGINE_DIR.glob("*.c")),
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


if __name__ == "__main__":
    print(build_in_place(), file=sys.stderr)
