#!/usr/bin/env bash
# Set up from nothing (a virtual environment in .venv, the engine compiled by pip), check lint and types, and run
# the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet -e '.[test]'
ruff check src tests
mypy
python -m pytest "$@"
