#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: build the engine and its CUDA library, then
#   1. run every CUDA kernel against its reference kernel and the CPU engine on realistic shapes (decode and prompt
#      products of 2048x2048, 4096x11008 and 11008x4096 weights, attention over 4096 positions, the Gated DeltaNet's
#      convolution, norms and delta rule at Qwen3.5's head shapes, ...) and print one table: numerics, GB/s, and
#      the fraction of the card's nominal memory bandwidth, a device-to-device copy's in its header
#      (strata.engine_cffi.device_check);
#   2. run the GPU backend's forward pass (qwen3moe, prompt chunks and decode of three sequences, an expert cache of
#      half the experts, then every expert held: the model fully on the card, each step resident, queued at once;
#      qwen35moe with its MTP block's drafts) against the CPU engine on generated models
#      (strata.engine_cffi.backend_check);
#   3. time decode (one sequence, then four) of generated qwen3moe and qwen35moe models (Q8_0, 2.0 and 0.8 GiB) on
#      the CPU engine alone, on the card with every expert held, with an expert cache of a third of the experts
#      (paced uploads, warmed up) and with none (every routed expert on the CPU's threads: llama.cpp's --n-cpu-moe
#      layout), and print one table: tok/s, each against the CPU engine, the cache's hit rate, and for the models
#      fully on the card the bytes a step reads and the fraction of the bound those bytes set at the bandwidth of
#      a device-to-device copy (strata.engine_cffi.decode_check; figures only, it fails only on an error);
#   4. encode a picture through the real `strata-vision --gpu` process and the CPU encoder, the demo encoder and a
#      generated small one (1000 rows), and print their rows' difference and times (strata.vision.gpu_check).
# Exits non-zero when a kernel or the backend is outside its tolerance (or nothing could run, or a check failed
# with an error).
#
#   ./scripts/gpu-check.sh              the full shapes, the small models and the decode models (a few minutes)
#   ./scripts/gpu-check.sh --quick      the test suite's small shapes, the tiny models and the demo encoder alone
#
# Python: the .venv of ./scripts/test.sh's set-up when there is one, else python3 with the project's dependencies
# (cffi, numpy, gguf) already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "gpu-check: $*" >&2; }
if [ -x .venv/bin/python ]; then
    . .venv/bin/activate
fi
python=$(command -v python || command -v python3)
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

if ! nvidia-smi -L >&2; then
    say "no NVIDIA GPU here (nvidia-smi failed)"
    exit 2
fi
export PATH="$PATH:${CUDA_HOME:-/usr/local/cuda}/bin"
if ! command -v nvcc >/dev/null; then
    say "nvcc not found: the CUDA library cannot be built"
    exit 2
fi
# the three architectures CI builds, and this card's own when it is none of them
card=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')
archs=86,89,90
case ",$archs," in *",$card,"*) ;; *) archs="$archs,$card" ;; esac
say "building the engine and libstrata_cuda.so (sm_${archs//,/, sm_})"
started=$(date +%s)
STRATA_CUDA_ARCHS=$archs "$python" build_engine.py
say "built in $(( $(date +%s) - started )) s"
status=0
"$python" -m strata.engine_cffi.device_check --device cuda "$@" || status=$?
quick=()  # the kernel check's other flags (--runs) are its own
for arg in "$@"; do [ "$arg" = --quick ] && quick=(--quick); done
"$python" -m strata.engine_cffi.backend_check --device cuda ${quick[@]+"${quick[@]}"} || status=$?
"$python" -m strata.engine_cffi.decode_check --device cuda ${quick[@]+"${quick[@]}"} || status=$?
"$python" -m strata.vision.gpu_check --device cuda ${quick[@]+"${quick[@]}"} || status=$?
exit $status
