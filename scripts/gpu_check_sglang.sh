#!/usr/bin/env bash
# The SGLang GPU check, for machines with SGLang and Transformer Engine (pip install -e '.[gpu]'):
# an SGLang server serving a random ~1.2B Llama in block fp8, the Megatron trainer (TE layer
# spec, bf16) as a second process on the same GPU, and SGLang's in-flight update protocol
# driving megarl's shard-to-shard receiver inside the SGLang TP worker mid-generation.
# Prints one JSON line (generator tokens/s, sync seconds and GB/s, version spans).
#
#   scripts/gpu_check_sglang.sh [--preset llama3-1b] [--prompts 256] [...]
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
