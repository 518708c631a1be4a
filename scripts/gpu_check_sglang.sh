#!/usr/bin/env bash
# The SGLang GPU check, for machines with SGLang and Transformer Engine (pip install -e '.[gpu]'):
# `megarl train` with generator.backend=sglang for a few asynchronous steps on one GPU -- the job
# writes a block-fp8 checkpoint from the trainer's weights, launches an SGLang server on it for its
# generator replica (sharing the GPU with the Megatron trainer, TE layer spec, bf16) and runs
# SGLang's in-flight update protocol into megarl's receiver inside the SGLang TP worker every step.
# Prints one JSON line (trainer and generator tokens/s, sync seconds and GB/s, lag, KL at step 1).
#
#   scripts/gpu_check_sglang.sh [--preset llama3-1b] [--steps 4] [...]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
"$PYTHON" -c "import sglang, transformer_engine" || {
    echo "scripts/gpu_check_sglang.sh: needs SGLang and Transformer Engine (pip install -e '.[gpu]')" >&2; exit 2; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTHONUNBUFFERED=1
nvidia-smi -L || true
exec timeout 600 "$PYTHON" -m megarl.bench.gpu_check_sglang "$@"
