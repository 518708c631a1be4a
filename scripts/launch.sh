#!/usr/bin/env bash
# Launch one megarl job: one torchrun agent per node, one process per rank.
#
#   scripts/launch.sh CONFIG [key=value ...]
#
# One node (or the CPU demo):  scripts/launch.sh configs/tiny_cpu.yaml run.steps=2
# Many nodes, on every node (Megatron-LM's conventions; scripts/slurm.sbatch sets them):
#   NNODES=32 NODE_RANK=<0..31> MASTER_ADDR=<node 0> MASTER_PORT=6000 GPUS_PER_NODE=8 \
#       scripts/launch.sh configs/llama3_8b.yaml
#
# 1. Node 0 runs `megarl train --config CONFIG --prepare-only`: it converts the
#    Hugging Face checkpoint into model.cache_dir on first use (which must be on
#    a filesystem every node mounts) and prints one JSON line with the world
#    size. The other nodes wait until that checkpoint is there.
# 2. Every node runs `torchrun ... -m megarl.cli train --config CONFIG`; each
#    process is one rank of the config's topology (trainer ranks first, then
#    generators; `megarl plan --config CONFIG --dry-run-topology` shows it).
#    GPUs: GPUS_PER_NODE ranks per node (NCCL), NNODES x GPUS_PER_NODE must be
#    the world size. No GPU (no nvidia-smi): the whole world on this one node (gloo).
#
# Environment: NNODES (or NUM_NODES) 1, NODE_RANK 0, MASTER_ADDR 127.0.0.1,
# MASTER_PORT the first of three free ports on one node / 6000 on many (megarl's own store takes
# MASTER_PORT + 1, SGLang weight sync + 2), GPUS_PER_NODE (default: the GPUs nvidia-smi lists),
# PYTHON (default python), MEGARL_DEVICE=gpu|cpu to skip detection,
# MEGARL_PREPARE_WAIT_S (how long other nodes wait for node 0's conversion,
# default 21600), MEGARL_LAUNCH_DRY_RUN=1 to print the commands and exit.
set -euo pipefail

if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
    sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
CONFIG=$1
shift
PYTHON=${PYTHON:-python}
NNODES=${NNODES:-${NUM_NODES:-1}}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
DRY_RUN=${MEGARL_LAUNCH_DRY_RUN:-0}
cd "$(dirname "$0")/.."  # the repository root: configs/ and the megarl package resolve from here
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

fail() { echo "scripts/launch.sh: $*" >&2; exit 2; }

# -- the device ---------------------------------------------------------------------------------
DEVICE=${MEGARL_DEVICE:-}
if [[ -z "$DEVICE" ]]; then
    if command -v nvidia-smi >/dev/null 2>&1 && [[ $(nvidia-smi -L 2>/dev/null | grep -c '^GPU') -gt 0 ]]; then
        DEVICE=gpu
    else
        DEVICE=cpu
    fi
fi
[[ "$DEVICE" == gpu || "$DEVICE" == cpu ]] || fail "MEGARL_DEVICE=$DEVICE: expected gpu or cpu"
if [[ "$DEVICE" == gpu && -z "${GPUS_PER_NODE:-}" ]]; then
    GPUS_PER_NODE=$(nvidia-smi -L | grep -c '^GPU')
fi

# -- environment that matters at scale (each overridable: only unset variables are set) ----------
# Rank output reaches the torchrun / SLURM log as it is written, and a crash loses no buffered lines.
export PYTHONUNBUFFERED=1
# Megatron's tensor-parallel communication overlap relies on kernels running in the order they
# are issued; one hardware work queue per device guarantees it (Megatron checks this variable).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# A failed or timed-out NCCL collective aborts its communicator and the process, so torchrun ends
# the job -- instead of every other rank hanging on a peer that is gone.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
# InfiniBand: a longer retransmission timeout (4.096 us x 2^22, ~17 s) and more retries ride out
# congestion on a 1000-GPU fabric instead of failing a collective. Set NCCL_IB_HCA /
# NCCL_SOCKET_IFNAME for your cluster's NICs if NCCL does not pick them itself.
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
export NCCL_IB_RETRY_CNT=${NCCL_IB_RETRY_CNT:-10}
# NVLink SHARP buffers take GPU memory per communicator, and megarl builds many (TP, DP, PP,
# weight sync, control); off unless measured to pay for themselves on your nodes.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# Packed micro-batches vary in length every step: expandable segments keep the caching allocator
# from fragmenting into out-of-memory at the ~75 GB per GPU the large layouts plan for.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
# Tokenizers' own thread pool would be forked into reward workers (a deadlock hazard) and
# competes with the ranks for cores.
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}
# No NVTE_* is set: Transformer Engine picks its attention backend itself and megarl trains in
# bf16 (no fp8 amax settings apply); set them here if you pin a backend.

# -- world size, and the model converted before any rank starts ----------------------------------
if [[ "$DRY_RUN" == 1 ]]; then
    # no conversion: the world size from the config alone
    WORLD_SIZE=$("$PYTHON" -c 'import sys; from megarl.config import load_config
print(load_config(sys.argv[1], sys.argv[2:]).layout().world_size)' "$CONFIG" "$@")
    echo "+ $PYTHON -m megarl.cli train --config $CONFIG --prepare-only $*   # node 0 only"
elif [[ "$NODE_RANK" == 0 ]]; then
    PREPARED=$("$PYTHON" -m megarl.cli train --config "$CONFIG" --prepare-only "$@" | tee /dev/stderr | tail -n 1)
    WORLD_SIZE=$("$PYTHON" -c 'import json, sys; print(json.loads(sys.argv[1])["world_size"])' "$PREPARED") \
        || fail "--prepare-only printed no JSON line with world_size: $PREPARED"
else
    # node 0 converts; here wait until its checkpoint is in the shared cache, then read the world size
    WORLD_SIZE=$("$PYTHON" - "$CONFIG" "${MEGARL_PREPARE_WAIT_S:-21600}" "$@" <<'EOF'
import sys, time
from megarl.config import load_config
from megarl.errors import ConfigError
from megarl.model_source import prepare_model

cfg, deadline = load_config(sys.argv[1], sys.argv[3:]), time.monotonic() + float(sys.argv[2])
while True:
    try:
        prepare_model(cfg.model, convert=False)
        break
    except ConfigError as err:
        if "not converted yet" not in str(err) or time.monotonic() > deadline:
            raise SystemExit(f"scripts/launch.sh: {err}")
        time.sleep(20)
print(cfg.layout().world_size)
EOF
)
fi

if [[ "$DEVICE" == gpu ]]; then
    if [[ "$NNODES" == 1 && "$WORLD_SIZE" -lt "$GPUS_PER_NODE" ]]; then
        NPROC=$WORLD_SIZE  # a small job on part of one node
    else
        NPROC=$GPUS_PER_NODE
        (( NNODES * NPROC == WORLD_SIZE )) || fail "$CONFIG needs $WORLD_SIZE ranks, but NNODES=$NNODES x" \
            "GPUS_PER_NODE=$NPROC = $(( NNODES * NPROC )); set NNODES=$(( (WORLD_SIZE + NPROC - 1) / NPROC ))" \
            "or change trainer.dp / generator.replicas (megarl plan --config $CONFIG --dry-run-topology)"
    fi
    # the ranks of a node share its cores: dataloading, tokenizing and host-side work per rank
    CORES=$(nproc)
else
    (( NNODES == 1 )) || fail "no GPU found: a CPU run is one node (NNODES=$NNODES); set MEGARL_DEVICE=gpu on GPU nodes"
    NPROC=$WORLD_SIZE
    CORES=$(nproc)
fi
# torchrun would set 1; the ranks' CPU work (all of it on a CPU run) gets an equal share instead
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( CORES / NPROC > 0 ? CORES / NPROC : 1 ))}

if [[ -z "${MASTER_PORT:-}" ]]; then
    if (( NNODES > 1 )); then
        MASTER_PORT=6000  # every node must agree on it: set it explicitly (scripts/slurm.sbatch does)
    else
        # three free ports: torchrun's rendezvous takes MASTER_PORT, megarl's job store MASTER_PORT + 1,
        # the SGLang weight-sync rendezvous MASTER_PORT + 2
        MASTER_PORT=$("$PYTHON" - <<'EOF'
import socket
for port in range(29500, 30500, 3):
    try:
        with socket.socket() as a, socket.socket() as b, socket.socket() as c:
            a.bind(("", port)); b.bind(("", port + 1)); c.bind(("", port + 2))
        print(port)
        break
    except OSError:
        continue
EOF
)
    fi
fi

CMD=("$PYTHON" -m torch.distributed.run
     --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC"
     --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
     --max_restarts 0  # a failed rank ends the job; runs resume from run.output_dir's checkpoints
     -m megarl.cli train --config "$CONFIG" "$@")
echo "scripts/launch.sh: node $NODE_RANK of $NNODES, $NPROC ranks here ($DEVICE), world $WORLD_SIZE," \
     "master $MASTER_ADDR:$MASTER_PORT, OMP_NUM_THREADS=$OMP_NUM_THREADS" >&2
if [[ "$DRY_RUN" == 1 ]]; then
    echo "+ ${CMD[*]}"
    exit 0
fi
# Preemption (megarl/runtime/preemption.py): SIGTERM or SIGUSR1 here reaches the ranks as SIGUSR1,
# and the job checkpoints at the next step boundary and exits 0; a second signal ends it at once.
# torchrun itself ignores SIGUSR1 (inherited) and is not told: on SIGTERM it would kill its workers
# within 30 s, before a long step ends.
trap '' USR1
"${CMD[@]}" &
TORCHRUN=$!
SIGNALLED=0
preempt() {
    if [[ "$SIGNALLED" == 1 ]]; then
        echo "scripts/launch.sh: second signal: ending the job now" >&2
        kill -TERM "$TORCHRUN" 2>/dev/null
        return
    fi
    SIGNALLED=1
    echo "scripts/launch.sh: signal received: the ranks checkpoint at the next step boundary and exit" >&2
    pkill -USR1 -P "$TORCHRUN"
}
trap preempt USR1 TERM
set +e  # wait's status is the job's
while true; do
    wait "$TORCHRUN"
    STATUS=$?
    # wait returns > 128 when a trapped signal interrupts it: the job is still running
    kill -0 "$TORCHRUN" 2>/dev/null || exit "$STATUS"
done
