#!/usr/bin/env bash
# Set up from nothing (a virtual environment in .venv, the engine compiled by pip) and start the server on
# 127.0.0.1:8080 with the shipped demo model and its CPU image encoder. Extra arguments go to `strata serve`
# (e.g. --model F.gguf for another model).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
echo "serve.sh: installing into .venv and compiling the C engine (about a minute the first time) ..."
python -m pip install --quiet --upgrade pip
python -m pip install --quiet -e '.[clients]'
echo "serve.sh: starting strata serve $*"
exec strata serve "$@"
