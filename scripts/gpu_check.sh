#!/usr/bin/env bash
# The one-GPU check: a machine with one NVIDIA GPU, no network, only PyTorch with CUDA
# preinstalled and room for under 60 MB of extra wheels. Under 8 minutes.
#
#   scripts/gpu_check.sh [--preset llama3-1b] [--batch 128] [...]   (python -m megarl.bench.gpu_check --help)
#
# Installs megatron-core 0.16.1 from a local wheel when it does not import (2.6 MB; put it in
# $MEGARL_WHEELS, default ./wheels: `pip download --no-deps megatron-core==0.16.1 -d wheels`
# on a machine with network), then runs the Megatron trainer (local layer spec, bf16, random
# ~1.2B Llama) and megarl's torch engine as two processes on the GPU, syncs the weights in the
# middle of generation (CUDA IPC: NCCL refuses two ranks on one device), and prints one JSON
# line: trainer_tokens_per_s, trainer_mfu, generator_tokens_per_s, sync_seconds, sync_GB_per_s,
# version_spans_appear. megarl itself runs from this checkout (PYTHONPATH); it needs no
# transformers, tokenizer or SGLang here.
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
exec timeout 460 "$PYTHON" -m megarl.bench.gpu_check "$@"
