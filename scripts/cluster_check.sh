#!/usr/bin/env bash
# The first thing to run on a new multi-GPU node (docs/testing.md#cluster-check): what a single GPU
# without network cannot show -- Transformer Engine's layer spec against the local one (logits and
# one RL step), an SGLang server launched by the job taking weight updates and answering greedy
# tokens like megarl's torch engine, NCCL shard-to-shard weight sync between GPUs (GB/s against the
# link), and async against sync on 8 GPUs. One JSON report: WORKDIR/report.json (also printed),
# rewritten as each check ends. Not yet run on a GPU cluster.
#
#   scripts/cluster_check.sh [--gpus 8] [--checks te_vs_local,sglang_vs_engine,nccl_sync,async_vs_sync]
#                            [--link-gb-s 450] [--workdir cluster_check] [--dry]
#
# Needs megarl's GPU install (pip install -e '.[gpu]': megatron-core, Transformer Engine, SGLang).
# --dry writes the configs and every command each check would run, and runs none.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONUNBUFFERED=1 MEGARL_LOG_ACTIVITY=1
exec "$PYTHON" -m megarl.bench.cluster_check "$@"
