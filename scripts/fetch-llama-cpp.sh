#!/usr/bin/env bash
# llama.cpp's own converter (convert_hf_to_gguf.py with its `conversion` package and gguf-py), and the vocabulary
# test files and chat templates it keeps under models/, taken from llama-cpp-python's source archive on PyPI into
# .cache/, for the tests that check our reading of the files it writes. Does nothing when they are all there.
# LLAMA_CPP_PYTHON_SDIST names a local copy of the archive instead.
set -euo pipefail
cd "$(dirname "$0")/.."
version=0.3.36
dest=.cache/llama.cpp-$version
# Qwen3.5's pre-tokenizer: its vocabulary with test inputs and llama.cpp's ids for them, and its chat template.
models=(models/ggml-vocab-qwen35.gguf models/ggml-vocab-qwen35.gguf.inp models/ggml-vocab-qwen35.gguf.out
        models/templates/Qwen3.5-4B.jinja)
complete=1
for file in convert_hf_to_gguf.py "${models[@]}"; do
    [ -f "$dest/$file" ] || complete=0
done
[ "$complete" = 1 ] && exit 0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
archive=${LLAMA_CPP_PYTHON_SDIST:-}
if [ -z "$archive" ]; then
    python -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$tmp"
    archive=$tmp/llama_cpp_python-$version.tar.gz
fi
top=llama_cpp_python-$version/vendor/llama.cpp
tar -xzf "$archive" -C "$tmp" "$top/convert_hf_to_gguf.py" "$top/conversion" "$top/gguf-py" "${models[@]/#/$top/}"
mkdir -p .cache
rm -rf "$dest"
mv "$tmp/$top" "$dest"
