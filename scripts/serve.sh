#!/usr/bin/env bash
# Set up (a virtual environment in .venv, the engine compiled by pip) and start the server on 127.0.0.1:8080 with
# the shipped demo model and its CPU image encoder. Extra arguments go to `strata serve` (e.g. --model F.gguf for
# another model).
#
# The install is editable, so Python changes need no reinstall; it runs again only when what it builds from has
# changed since the last one: the C engine's sources, its build script, or pyproject.toml (their digest is kept
# in .venv/strata-build.stamp). A second start goes straight to `strata serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "serve.sh: $*"; }
stamp_file=.venv/strata-build.stamp
stamp=$(cat pyproject.toml setup.py build_engine.py src/strata/engine_cffi/*.[ch] src/strata/engine_cffi/cuda/*.[ch] |
        sha256sum | cut -d' ' -f1)
if [ -x .venv/bin/strata ] && [ "$(cat "$stamp_file" 2>/dev/null)" = "$stamp" ]; then
    say "up to date (.venv); starting strata serve $*"
    . .venv/bin/activate
    exec strata serve "$@"
fi
if [ ! -d .venv ]; then
    say "creating the virtual environment .venv"
    python3 -m venv .venv
fi
. .venv/bin/activate
say "updating pip"
python -m pip install --quiet --upgrade pip
say "installing strata and its dependencies into .venv, then compiling the C engine"
say "(a first build takes a few minutes on 2 cores and prints nothing meanwhile)"
started=$SECONDS
python -m pip install --quiet -e '.[clients]'
echo "$stamp" > "$stamp_file"
say "installed in $((SECONDS - started)) s; starting strata serve $*"
exec strata serve "$@"
