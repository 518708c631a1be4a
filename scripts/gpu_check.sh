#!/usr/bin/env bash
# The one-GPU check: a machine with one NVIDIA GPU, no network, only PyTorch with CUDA
# preinstalled (an older torch than megarl's pin is fine) and room for under 60 MB of extra
# wheels. A few minutes.
#
#   scripts/gpu_check.sh [--preset llama3-1b] [--steps 4] [...]   (python -m megarl.bench.gpu_check --help)
#
# Installs megatron-core 0.16.1 from a local wheel when it does not import (2.6 MB; put it in
# $MEGARL_WHEELS, default ./wheels, fetched for the GPU machine's Python -- its wheels are per
# Python version: docs/testing.md#carrying-megatron-core-to-the-gpu-machine gives pip's
# --python-version / --platform flags), then runs `megarl train` itself for a few steps:
# the Megatron trainer (local layer spec, bf16) and megarl's torch engine as two ranks on the
# one GPU, weight syncs through CUDA IPC, a random ~1.5B Llama, random token prompts and the
# synthetic reward -- no transformers, tokenizer, math-verify, TensorBoard or PyYAML needed.
# Prints one JSON line: trainer tokens/s and MFU, generator tokens/s, sync seconds and GB/s,
# lag, KL at step 1 (--mode sync|async, --no-final-checkpoint, --results FILE for a line per step
# as produced: `megarl bench gpu-check --help`). megarl itself runs from this checkout (PYTHONPATH).
# scripts/gpu_smoke.sh runs it, among other steps, in a short GPU window.
# Mixture of experts: scripts/gpu_check.sh --preset qwen3-moe-mini (a random 1.98B Qwen3-MoE).
# Every rank prints "megarl activity: ..." lines as it goes (MEGARL_LOG_ACTIVITY=1): a slow step
# keeps printing, a hang stops.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
if ! "$PYTHON" -c "import megatron.core" 2>/dev/null; then
    "$PYTHON" -m pip install --no-index --no-deps "${MEGARL_WHEELS:-wheels}"/megatron_core-0.16.1-*.whl
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Megatron's TP overlap ordering; harmless at TP 1 and what every megarl GPU run sets
export CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTHONUNBUFFERED=1
nvidia-smi -L || true
exec timeout 500 "$PYTHON" -m megarl.bench.gpu_check "$@"
