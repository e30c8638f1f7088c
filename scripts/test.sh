#!/usr/bin/env bash
# Set up from nothing (a virtual environment in .venv, the engine compiled by pip, the references the tests
# compare against), check lint and types, and run the test suite. Extra arguments go to pytest.
#
#   ./scripts/test.sh            the whole suite: the gate CI runs
#   ./scripts/test.sh --fast     the unit tests only (pytest -m "not slow", under a minute); set-up, lint and
#                                types are skipped when .venv is up to date
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "test.sh: $*"; }
fast=0
if [ "${1:-}" = "--fast" ]; then
    fast=1
    shift
fi
llama_cpp_python=0.3.36  # the llama.cpp the tests compare against (its converter, quantizer and logits)
stamp_file=.venv/strata-test.stamp
stamp=$(cat pyproject.toml setup.py build_engine.py src/strata/engine_cffi/*.[ch] src/strata/engine_cffi/cuda/* |
        sha256sum | cut -d' ' -f1)

if [ $fast = 1 ] && [ -x .venv/bin/python ] && [ "$(cat "$stamp_file" 2>/dev/null)" = "$stamp" ]; then
    . .venv/bin/activate
    say "up to date (.venv); the fast tier"
    exec python -m pytest -m "not slow" "$@"
fi

# The browser tests (tests/web) drive Debian's chromium: installed here when missing and this runs as root.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing Debian's chromium for the browser tests"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } ||
        echo "warning: chromium could not be installed; the browser tests will be skipped" >&2
fi
if [ ! -d .venv ]; then
    say "creating the virtual environment .venv"
    python3 -m venv .venv
fi
. .venv/bin/activate
say "installing strata with its test extras into .venv and compiling the C engine (a few minutes the first time)"
python -m pip install --quiet --upgrade pip
python -m pip install --quiet -e '.[test]'
# the CUDA kernels, where nvcc is installed (three architectures: about 7 s on 2 cores); without it the CPU engine
python build_engine.py --cuda
echo "$stamp" > "$stamp_file"

# llama.cpp's converter, and llama-cpp-python itself, come from one source archive on the package index.
sdist=.cache/sdist/llama_cpp_python-$llama_cpp_python.tar.gz
if [ ! -f "$sdist" ]; then
    say "downloading llama-cpp-python $llama_cpp_python's source archive (llama.cpp's converter and library)"
    python -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$llama_cpp_python" -d .cache/sdist
fi
LLAMA_CPP_PYTHON_SDIST=$sdist ./scripts/fetch-llama-cpp.sh
if ! python -c "import llama_cpp" 2>/dev/null; then
    say "building llama-cpp-python $llama_cpp_python from source (llama.cpp in C++: about 5 minutes on 2 cores, once)"
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python -m pip install --quiet "$sdist"
fi

say "ruff"
ruff check src tests
say "mypy"
mypy
if [ $fast = 1 ]; then
    say "the fast tier"
    exec python -m pytest -m "not slow" "$@"
fi
say "the test suite"
exec python -m pytest "$@"
