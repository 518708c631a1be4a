#!/usr/bin/env bash
# The first minutes on a GPU machine: one prepared script, its steps ordered by value, each under
# its own time limit, each appending one JSON line to RESULTS_DIR/results.jsonl as it finishes --
# a step that fails, hangs or is cut off loses only its own line (docs/testing.md#the-gpu-smoke-script).
#
#   scripts/gpu_smoke.sh [RESULTS_DIR] [--part first|second|all] [--dry | --tiny]
#
# RESULTS_DIR defaults to ./gpu_results. --part first (the default) fits one 450-second command:
#   setup        megatron-core from $MEGARL_WHEELS (default ./wheels) when it does not import
#   probe        versions; bf16 matmul and copy peaks as measured here (megarl/bench/gpu_probe.py)
#   moe_micro    the engine's MoE decode step, Megatron's MoE layer fwd+bwd (megarl/bench/moe_micro.py)
#   moe_train    `megarl train` on a random Qwen3-MoE (qwen3-moe-mini), 2 small steps
#   llama_sync   the 1.5B Llama, sync (colocated) mode: trainer MFU, engine tokens/s alone, copy GB/s
#   llama_async  the same, async: the speed-up on one GPU is llama_sync's step_s / this one's
# --part second (optional, another command of up to 450 s): llama_trainer_heavy (long prompts,
# short answers: the trainer's MFU at its best shapes), moe_train_long (4 steps, full size) and
# engine_vs_hf (the torch engine against transformers' generate on one random Llama).
# Each step's stdout / stderr are kept as RESULTS_DIR/<step>.out / .log; the `megarl train` steps
# also write RESULTS_DIR/<step>.results.jsonl, a line per trained step as it is produced.
#
# --dry (or MEGARL_SMOKE_DRY=1): the same plan and bookkeeping with fake steps that print a JSON
# line at once, each under MEGARL_SMOKE_DRY_TIMEOUT seconds (default 5); MEGARL_SMOKE_DRY_FAIL=a,b
# makes those steps exit 3, MEGARL_SMOKE_DRY_HANG=a,b makes them hang (deaf to SIGTERM: the
# `timeout -k` kill ends them). tests/multiprocess/test_gpu_smoke.py runs it so.
# --tiny (or MEGARL_SMOKE_TINY=1): the real commands at the test suite's model sizes (presets tiny
# and tiny-moe, a few short sequences), on whatever device there is: the command lines checked on a
# CPU machine before a GPU window (a few minutes there; the limits are the plan's).
# The whole script is one brace group: bash parses it before running any of it, so an edit to this
# file (a pull) during a run cannot change what the running script does next.
{
set -uo pipefail
cd "$(dirname "$0")/.."

RESULTS=./gpu_results
PART=first
DRY=${MEGARL_SMOKE_DRY:-0}
TINY=${MEGARL_SMOKE_TINY:-0}
while [ $# -gt 0 ]; do
    case "$1" in
        --part) PART=${2:?--part needs first, second or all}; shift 2 ;;
        --dry) DRY=1; shift ;;
        --tiny) TINY=1; shift ;;
        -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
        -*) echo "gpu_smoke.sh: unknown flag $1" >&2; exit 2 ;;
        *) RESULTS=$1; shift ;;
    esac
done
case "$PART" in first|second|all) ;; *) echo "gpu_smoke.sh: --part $PART: first, second or all" >&2; exit 2 ;; esac
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
LINES="$RESULTS/results.jsonl"
PYTHON=${PYTHON:-python3}
KILL_AFTER=${MEGARL_SMOKE_KILL_AFTER:-5}   # seconds between timeout's SIGTERM and its SIGKILL
DRY_TIMEOUT=${MEGARL_SMOKE_DRY_TIMEOUT:-5}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONUNBUFFERED=1 MEGARL_LOG_ACTIVITY=1

# The plan: name, part, seconds. The first part's limits, each with its KILL_AFTER, add up to
# 445 s: one 450-second command, however its steps end. Setup, probe and the MoE steps come first,
# as the first GPU run (2026-12-04) lost its only MoE try to a limit that left no result.
PLAN=(
    "setup first 15"
    "probe first 30"
    "moe_micro first 70"
    "moe_train first 100"
    "llama_sync first 100"
    "llama_async first 100"
    "llama_trainer_heavy second 180"
    "moe_train_long second 180"
    "engine_vs_hf second 60"
)

CURRENT=""          # the step running now (the trap reports it)
CURRENT_PID=""
CURRENT_START=0
CURRENT_LIMIT=0
DONE=()
MEASURED_PEAK=""

now() { date +%s%N; }
since() {  # seconds (to the millisecond) since a now() reading; no bc on a bare machine
    local ms=$((($(now) - $1) / 1000000))
    printf '%d.%03d' $((ms / 1000)) $((ms % 1000))
}

# One JSON line per step: step, status (ok | failed | timeout | interrupted | not_run), seconds,
# exit code, the limit planned and the one applied, and "figures": the last JSON line the step
# printed on stdout (null if none). Python assembles it; if even that fails, a line without figures.
emit() {  # name status seconds rc limit applied
    local out="$RESULTS/$1.out"
    "$PYTHON" - "$@" "$out" "$DRY" "$KILL_AFTER" >>"$LINES" <<'EOF' || printf '{"step": "%s", "status": "%s", "seconds": %s, "exit_code": %s, "figures": null}\n' "$1" "$2" "$3" "$4" >>"$LINES"
import json, sys
name, status, seconds, rc, limit, applied, out, dry, kill_after = sys.argv[1:]
figures = None
try:
    for line in open(out).read().splitlines():
        try:
            parsed = json.loads(line)
        except ValueError:
            continue
        if isinstance(parsed, dict):
            figures = parsed
except OSError:
    pass
print(json.dumps({"step": name, "status": status, "seconds": round(float(seconds), 3), "exit_code": int(rc),
                  "limit_s": int(limit), "applied_limit_s": int(applied), "kill_after_s": int(kill_after),
                  "dry": dry == "1", "figures": figures}))
EOF
}

on_exit() {
    local rc=$?
    trap - EXIT INT TERM
    if [ -n "$CURRENT" ]; then  # cut off mid-step: stop it, keep what it printed
        # `timeout` leads its own process group (the step and all it started): signal the group
        kill -TERM -- "-$CURRENT_PID" 2>/dev/null
        sleep 2
        kill -KILL -- "-$CURRENT_PID" 2>/dev/null
        emit "$CURRENT" interrupted "$(since "$CURRENT_START")" "$rc" "$CURRENT_LIMIT" "$CURRENT_LIMIT"
    fi
    "$PYTHON" - "$LINES" "$PART" "${DONE[*]:-}" "$CURRENT" >>"$LINES" <<'EOF' || true
import json, sys
lines, part, done, cut = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4]
print(json.dumps({"step": "_end", "part": part, "steps_done": done, "cut_off": cut or None}))
EOF
    exit "$rc"
}
trap on_exit EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

in_part() {  # step_part
    [ "$PART" = all ] || [ "$PART" = "$1" ]
}

is_listed() {  # name comma-list
    case ",$2," in *",$1,"*) return 0 ;; esac
    return 1
}

# A fake step for --dry: prints its JSON line (hangs or fails where asked)
fake_step() {  # name
    if is_listed "$1" "${MEGARL_SMOKE_DRY_HANG:-}"; then
        exec "$PYTHON" -c "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('{\"fake\": \"$1\", \"hanging\": true}', flush=True); time.sleep(3600)"
    fi
    echo "{\"fake\": \"$1\"}"
    if is_listed "$1" "${MEGARL_SMOKE_DRY_FAIL:-}"; then
        echo "fake step $1 failing as asked" >&2
        return 3
    fi
}

gpu_check() {  # name, then gpu_check flags
    local name=$1; shift
    local extra=()
    [ -n "$MEASURED_PEAK" ] && extra+=(--measured-peak-tflops "$MEASURED_PEAK")
    if [ "$TINY" = 1 ]; then  # the last of a repeated flag wins: these replace the step's sizes
        local preset=tiny
        case " $* " in *" qwen3-moe-mini "*) preset=tiny-moe ;; esac
        extra+=(--preset $preset --prompts-per-step 4 --samples 2 --prompt-len 8 --max-new-tokens 24
            --max-running 8 --microbatch-tokens 64)
    fi
    "$PYTHON" -m megarl.bench.gpu_check --results "$RESULTS/$name.results.jsonl" --workdir "$RESULTS/$name.work" \
        --no-final-checkpoint "$@" "${extra[@]}"
}

setup_step() {
    # found, not imported: megatron.core's import (torch's with it) takes seconds on a busy machine
    if "$PYTHON" -c "import importlib.util as u, sys; sys.exit(u.find_spec('megatron.core') is None)" 2>/dev/null; then
        echo '{"megatron_core": "found"}'
        return 0
    fi
    local wheel
    wheel=$(ls "${MEGARL_WHEELS:-wheels}"/megatron_core-0.16.1-*.whl 2>/dev/null | head -1)
    if [ -z "$wheel" ]; then
        echo "gpu_smoke.sh: megatron-core does not import and no wheel in ${MEGARL_WHEELS:-wheels}/ (docs/testing.md)" >&2
        return 2
    fi
    "$PYTHON" -m pip install -q --no-index --no-deps --target "$RESULTS/site" "$wheel" >&2 || return 2
    echo "{\"megatron_core\": \"installed from $wheel\"}"
}

command_of() {  # the real command of a step
    case "$1" in
        setup) setup_step ;;
        probe) "$PYTHON" -m megarl.bench.gpu_probe $([ "$TINY" = 1 ] && echo --sizes 256 --copy-mb 16) ;;
        moe_micro) "$PYTHON" -m megarl.bench.moe_micro $([ "$TINY" = 1 ] && echo --preset tiny-moe --batch 8 --tokens 64) ;;
        moe_train) gpu_check moe_train --preset qwen3-moe-mini --steps 2 --prompts-per-step 8 --samples 2 \
            --prompt-len 64 --max-new-tokens 64 --max-running 16 ;;
        llama_sync) gpu_check llama_sync --preset llama3-1b --mode sync --steps 3 ;;
        llama_async) gpu_check llama_async --preset llama3-1b --mode async --steps 3 ;;
        llama_trainer_heavy) gpu_check llama_trainer_heavy --preset llama3-1b --mode sync --steps 3 \
            --prompt-len 2048 --max-new-tokens 64 --microbatch-tokens 8192 ;;
        moe_train_long) gpu_check moe_train_long --preset qwen3-moe-mini --steps 4 ;;
        engine_vs_hf) "$PYTHON" -m megarl.bench.engine_vs_hf \
            $([ "$TINY" = 1 ] && echo --preset tiny --batch 4 --prompt 16 --max-new-tokens 16) ;;
        *) echo "gpu_smoke.sh: no step $1" >&2; return 2 ;;
    esac
}

run_step() {  # name limit
    local name=$1 limit=$2 applied=$2 rc status
    [ "$DRY" = 1 ] && applied=$DRY_TIMEOUT
    CURRENT=$name CURRENT_START=$(now) CURRENT_LIMIT=$limit
    if [ "$DRY" = 1 ]; then
        timeout -k "$KILL_AFTER" "$applied" bash -c "$(declare -f is_listed fake_step); PYTHON='$PYTHON' fake_step $name" \
            >"$RESULTS/$name.out" 2>"$RESULTS/$name.log" &
    else
        # exported so that `timeout` can run the shell function's command in a child bash
        timeout -k "$KILL_AFTER" "$applied" bash -c "$(declare -f gpu_check setup_step command_of); \
            RESULTS='$RESULTS' MEASURED_PEAK='$MEASURED_PEAK' PYTHON='$PYTHON' TINY='$TINY' command_of $name" \
            >"$RESULTS/$name.out" 2>"$RESULTS/$name.log" &
    fi
    CURRENT_PID=$!
    wait "$CURRENT_PID"  # returns at once on a trapped signal, unlike a foreground command
    rc=$?
    case $rc in
        0) status=ok ;;
        124|137) status=timeout ;;
        *) status=failed ;;
    esac
    emit "$name" "$status" "$(since "$CURRENT_START")" "$rc" "$limit" "$applied"
    CURRENT=""
    DONE+=("$name")
    if [ "$name" = setup ] && [ -d "$RESULTS/site" ]; then
        export PYTHONPATH="$PYTHONPATH:$RESULTS/site"
    fi
    if [ "$name" = probe ] && [ $status = ok ] && [ "$DRY" != 1 ]; then
        MEASURED_PEAK=$("$PYTHON" -c "import json,sys; print(json.load(open(sys.argv[1]))['matmul_tflops'])" \
            <(tail -1 "$RESULTS/probe.out") 2>/dev/null || true)
    fi
}

command -v nvidia-smi >/dev/null && [ "$DRY" != 1 ] && nvidia-smi -L >&2
for entry in "${PLAN[@]}"; do
    read -r name part limit <<<"$entry"
    in_part "$part" && run_step "$name" "$limit"
done
exit 0
}
