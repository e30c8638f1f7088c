#!/usr/bin/env bash
# Set up from nothing (a virtual environment in .venv, the engine compiled by pip), make the default model if it
# is missing, and start the server on 127.0.0.1:8080. Extra arguments go to `strata serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet -e .
model=models/default.gguf
if [ ! -f "$model" ]; then
    mkdir -p models
    strata make-model --arch qwen3moe --size small --dtype q4_k --vocab qwen --out "$model"
fi
exec strata serve --model "$model" "$@"
