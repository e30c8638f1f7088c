#!/usr/bin/env bash
# Set up from nothing (a virtual environment in .venv, the engine compiled by pip), check lint and types, and run
# the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# The browser tests (tests/web) drive Debian's chromium: installed here when missing and this runs as root.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing chromium for the browser tests ..."
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } ||
        echo "warning: chromium could not be installed; the browser tests will be skipped" >&2
fi
python3 -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet -e '.[test]'
ruff check src tests
mypy
./scripts/fetch-llama-cpp.sh
python -m pytest "$@"
