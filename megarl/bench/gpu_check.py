"""The one-GPU checks (scripts/gpu_check.sh, scripts/gpu_check_sglang.sh): `megarl train` itself,
a few asynchronous steps, trainer and generator sharing one device, and the figures that matter.

What runs is the product's own path, started as a user starts it
(``python -m megarl.cli train --config FILE``): a Megatron trainer rank and a
generator rank -- megarl's torch engine (``--backend torch``) or an SGLang
server the job launches (``--backend sglang``, block fp8) -- on the same GPU,
their weight sync through CUDA IPC (NCCL refuses two ranks on one device).
The model is a random Llama of a preset shape (default ``llama3-1b``: Llama
3.2 1B's, ~1.5B parameters with its untied head), the prompts are random token
ids and the reward is ``synthetic_parity``: nothing needs transformers, a
tokenizer, math-verify, TensorBoard or PyYAML (the config is JSON), so the
check runs where only PyTorch with CUDA and megatron-core are installed.

Prints one JSON line: trainer tokens/s and MFU, generator tokens/s, weight-sync
seconds, bytes and GB/s, token lag, KL(mu || pi) and ESS at step 1 (exact weights
give KL ~ 0), and how many trained sequences carry two policy versions.
Runs on CPU too (``--device cpu --preset tiny``), which is how CI checks it.

Made for a short GPU window (scripts/gpu_smoke.sh runs it), so nothing measured is lost to a
cut-off: with ``--results FILE`` every step's figures are appended to FILE as the trainer writes
them, a ``startup`` line once the first step is in (start-up -- processes, model build, first
sync, and in async mode the first batch's generation -- apart from the first step's own time),
and the summary last; a SIGTERM (``timeout``) ends the run and still writes the summary of the
steps done (``"complete": false``). ``--report-only --workdir DIR`` remakes the summary from a
kept run. ``--mode sync`` runs the colocated baseline (the engine alone on the GPU while it
generates, the weights copied on the rank); ``--no-final-checkpoint`` skips the last step's
checkpoint (``run.save_final=false``: ~20 GB of Adam state, 30-40 s on the first H200 run).
MFU is the trainer's model FLOPs (megarl/bench/mfu.py: no input embedding, causal attention, the
logits layer on the positions the loss reads) over its own step time, against both the
datasheet's bf16 peak and the one measured on this card (``--measured-peak-tflops``, from
scripts/gpu_smoke.sh's probe).

The mixture-of-experts variant is ``--preset qwen3-moe-mini`` (a random 1.98B Qwen3-MoE, 32
experts top 8, the trainer at EP1 on the one GPU: Megatron's MoE layers in its Transformer Engine
spec, the engine's experts in SGLang's FusedMoE layout, their sync through CUDA IPC; block fp8 in
SGLang, experts included); CI runs ``--preset tiny-moe`` on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from megarl.bench import mfu
from megarl.models.presets import preset_spec


def check_config(a, out_dir: str) -> dict:
    cuda = a.device == "cuda"
    dtype = "bf16" if cuda else "fp32"
    generator = {
        "backend": a.backend,
        "tp": 1,
        "replicas": 1,
        "max_running": a.max_running,
        "max_seq_len": a.prompt_len + a.max_new_tokens,
        "dtype": dtype,
        # block fp8 in SGLang, as production serves (experts too: per-expert 128 x 128 block scales)
        "fp8": a.backend == "sglang",
    }
    if a.backend == "sglang":
        generator.update(
            sglang_port=a.sglang_port, sglang_mem_fraction=a.sglang_mem_fraction, sglang_startup_timeout_s=600
        )
        if a.sglang_launcher:
            generator["sglang_launcher"] = a.sglang_launcher
    trainer = {"tp": 1, "max_tokens_per_microbatch": max(a.microbatch_tokens, a.prompt_len + a.max_new_tokens)}
    if a.sequence_parallel:
        trainer["sequence_parallel"] = True
    if a.recompute == "selective":
        trainer["recompute_granularity"] = "selective"
    elif a.recompute == "full":
        trainer.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    rollout = {
        "prompts_per_step": a.prompts_per_step,
        "samples_per_prompt": a.samples,
        "temperature": 1.0,
        "max_new_tokens": a.max_new_tokens,
    }
    if a.mode == "async":
        rollout["max_lag"] = 2
    return {
        "model": {"source": f"random:{a.preset}", "tokenizer": "none", "dtype": dtype},
        "trainer": trainer,
        "optimizer": {"lr": 1e-5},
        "generator": generator,
        "rollout": rollout,
        "reward": {"function": "synthetic_parity"},
        "data": {"train": f"random:4096:1:{a.prompt_len}", "max_prompt_tokens": a.prompt_len},
        "run": {
            "mode": a.mode,
            "steps": a.steps,
            "output_dir": out_dir,
            "progress": False,
            "save_final": not a.no_final_checkpoint,
        },
    }


def _median(values):
    values = [v for v in values if v]
    return statistics.median(values) if values else None


def _jsonl(path: Path) -> list:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # the line being written when the run was stopped
            break
    return out


def step_sequences(rollouts: list) -> dict:
    """step -> [(positions, logit positions)] of the sequences it trained (rollouts.jsonl): a
    sample occupies prompt + response - 1 positions; the output layer runs where loss_mask is 1."""
    out: dict = {}
    for r in rollouts:
        positions = len(r["prompt_tokens"]) + len(r["response_tokens"]) - 1
        read = sum(r["loss_mask"]) if r.get("loss_mask") else len(r["response_tokens"])
        out.setdefault(r["step"], []).append((positions, read))
    return out


def step_figures(record: dict, spec, sequences: Optional[list], peaks: dict) -> dict:
    """One step's line: its times, rates, and the trainer's model FLOP/s and MFU (None where the
    step's sequences are not known)."""
    line = {
        k: record.get(k)
        for k in (
            "step",
            "time_step",
            "time_train",
            "time_generate",
            "time_weight_sync",
            "train_tokens_per_s",
            "generator_tokens_per_s",
            "weight_sync_bytes",
            "weight_sync_bytes_copied",
            "weight_sync_transfer_s",
            "peak_memory_gb",
            "kl_mu_pi",
            "ess",
            "lag_mean",
            "lag_max",
        )
    }
    flops = mfu.train_step_flops(spec, sequences) if sequences else None
    seconds = record.get("time_train")
    line["trainer_tflops"] = flops / seconds / 1e12 if flops and seconds else None
    for name, peak in peaks.items():
        line[f"trainer_mfu_{name}"] = mfu.mfu(flops, seconds, peak) if flops else None
    return line


def summarize(
    run_dir: Path,
    device_name: str,
    spec,
    measured_peak: Optional[float] = None,
    first_record_s: Optional[float] = None,
) -> dict:
    """The run's figures from its metrics.jsonl and rollouts.jsonl (a run cut off mid-way too).
    ``first_record_s``: seconds from the launch to step 1's record, for the start-up time."""
    metrics = [m for m in _jsonl(run_dir / "metrics.jsonl") if not m.get("eval")]
    rollouts = _jsonl(run_dir / "rollouts.jsonl")
    summary_file = run_dir / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    parameters, active = spec.num_parameters(), spec.num_active_parameters()
    peaks = {"datasheet": mfu.datasheet_peak(device_name), "measured": measured_peak}
    out = {
        "device": device_name,
        "parameters_B": float(f"{parameters / 1e9:.4g}"),
        "active_parameters_B": float(f"{active / 1e9:.4g}"),
        "steps": len(metrics),
        "complete": bool(summary),
        "peak_tflops_datasheet": peaks["datasheet"] / 1e12 if peaks["datasheet"] else None,
        "peak_tflops_measured": measured_peak / 1e12 if measured_peak else None,
    }
    if not metrics:
        return out
    sequences = step_sequences(rollouts)
    timed = metrics[1:] or metrics  # the first step includes warm-up
    # the trainer's model FLOPs over its own time (not the step's: generation and sync excluded)
    flops = [mfu.train_step_flops(spec, sequences[m["step"]]) for m in timed if m["step"] in sequences]
    train_s = sum(m["time_train"] for m in timed if m["step"] in sequences)
    # async: the bytes the trainer rank sent; sync (colocated): the bytes its copy wrote into the engine
    moved = [(m, m["weight_sync_bytes"] or m.get("weight_sync_bytes_copied", 0)) for m in metrics]
    synced = [m for m, nbytes in moved if nbytes]
    sync_s = _median(m["weight_sync_transfer_s"] for m in synced)
    sync_bytes = next((nbytes for _, nbytes in moved if nbytes), 0)
    first_step_s = metrics[0]["time_step"]
    out.update(
        {
            "startup_s": first_record_s - first_step_s if first_record_s else None,
            "first_step_s": first_step_s,
            "step_s": _median(m["time_step"] for m in timed),
            "trainer_step_s": _median(m["time_train"] for m in timed),
            "trainer_tokens_per_s": _median(m["train_tokens_per_s"] for m in timed),
            "trainer_tflops": sum(flops) / train_s / 1e12 if flops and train_s else None,
            **{
                f"trainer_mfu_{name}": mfu.mfu(sum(flops), train_s, peak) if flops else None
                for name, peak in peaks.items()
            },
            "generator_tokens_per_s": _median(m["generator_tokens_per_s"] for m in timed),
            "sync_seconds": sync_s,
            "sync_GB": sync_bytes / 1e9,
            "sync_GB_per_s": sync_bytes / 1e9 / sync_s if sync_s else None,
            "sync_step_seconds": _median(m["time_weight_sync"] for m in synced),
            "lag_mean": statistics.mean(m["lag_mean"] for m in metrics),
            "lag_max": max(m["lag_max"] for m in metrics),
            "kl_step1": metrics[0]["kl_mu_pi"],
            "ess_step1": metrics[0]["ess"],
            "sequences_with_two_versions": sum(len(set(r["versions"])) > 1 for r in rollouts),
            "samples_per_s": summary.get("samples_per_s"),
            "checkpoint_s": summary.get("time_checkpoint_s"),
            # the trainer rank's peak allocated memory over a step (weights, grads, optimizer, activations)
            "trainer_peak_memory_GB": max((m.get("peak_memory_gb") or 0.0) for m in metrics) or None,
        }
    )
    return out


class Results:
    """``--results FILE``: JSON lines appended (and flushed) as each is known; none without a file."""

    def __init__(self, path: Optional[str], **tags):
        self.path, self.tags = Path(path) if path else None, tags

    def write(self, kind: str, figures: dict) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps({"kind": kind, **self.tags, **figures}) + "\n")
            f.flush()
            os.fsync(f.fileno())


def add_args(p: argparse.ArgumentParser, backend: str = "torch") -> None:
    """The check's flags (also `megarl bench gpu-check`'s; no torch imported)."""
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="auto: cuda when available")
    p.add_argument("--backend", default=backend, choices=["torch", "sglang"])
    p.add_argument("--mode", default="async", choices=["async", "sync"], help="run.mode (sync: colocated baseline)")
    p.add_argument("--preset", default="llama3-1b")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--max-running", type=int, default=128, help="generator sequences in flight")
    p.add_argument("--microbatch-tokens", type=int, default=4096)
    p.add_argument("--sglang-port", type=int, default=30000)
    p.add_argument("--sglang-mem-fraction", type=float, default=0.35, help="SGLang's share: the trainer shares the GPU")
    p.add_argument("--sglang-launcher", default="", help="the server command (default: python -m sglang.launch_server)")
    p.add_argument(
        "--recompute",
        default="none",
        choices=["none", "selective", "full"],
        help="trainer activation recomputation (full: uniform, 1 layer per group)",
    )
    p.add_argument("--sequence-parallel", action="store_true", help="trainer.sequence_parallel (needs TE)")
    p.add_argument(
        "--no-final-checkpoint", action="store_true", help="run.save_final=false: no checkpoint after the last step"
    )
    p.add_argument("--results", help="append each step's figures, the start-up time and the summary here as they come")
    p.add_argument(
        "--measured-peak-tflops", type=float, help="this card's measured bf16 matmul peak (gpu_smoke.sh's probe)"
    )
    p.add_argument("--report-only", action="store_true", help="summarize the run kept in --workdir; start nothing")
    p.add_argument("--workdir", help="keep the run here (default: a temporary directory)")


def _device(a) -> tuple:
    import torch

    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    return device, (torch.cuda.get_device_name() if device == "cuda" else "cpu")


def _follow(proc: subprocess.Popen, run_dir: Path, launched: float, emit) -> Optional[float]:
    """Wait for the run, passing each new metrics record to ``emit`` as it appears; returns the
    seconds from the launch to step 1's record (None if none came)."""
    seen, first = 0, None
    while True:
        done = proc.poll() is not None
        records = [m for m in _jsonl(run_dir / "metrics.jsonl") if not m.get("eval")]
        for record in records[seen:]:
            if first is None:
                first = time.perf_counter() - launched
            emit(record, first)
        seen = len(records)
        if done:
            return first
        time.sleep(0.25)


def run(a, parser_error=None) -> dict:
    if a.report_only and not a.workdir:
        (parser_error or _fail)("--report-only needs --workdir (the kept run to summarize)")
    if a.mode == "sync" and a.backend != "torch":
        (parser_error or _fail)("--mode sync colocates the torch engine with the trainer; use --backend torch")
    spec = preset_spec(a.preset)
    device, device_name = _device(a)
    a.device = device
    measured = a.measured_peak_tflops * 1e12 if a.measured_peak_tflops else None
    tags = {"backend": a.backend, "mode": a.mode, "preset": a.preset}
    results = Results(a.results, **tags)
    with tempfile.TemporaryDirectory(prefix="megarl_gpu_check_") as tmp:
        work = Path(a.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        run_dir = work / "run"
        first_record_s = None
        if a.report_only:
            timing = work / "gpu_check_timing.json"
            first_record_s = json.loads(timing.read_text()).get("first_record_s") if timing.exists() else None
            rc = 0
        else:
            first_record_s, rc = _launch(a, work, run_dir, spec, device_name, measured, results)
        result = {**tags, **summarize(run_dir, device_name, spec, measured, first_record_s)}
        result["exit_code"] = rc
        results.write("result", result)
    print(json.dumps(result), flush=True)
    if rc != 0:
        raise SystemExit(f"gpu_check: `megarl train` ended with exit code {rc} after {result['steps']} steps")
    return result


def _fail(message: str):
    raise SystemExit(f"gpu_check: {message}")


def _launch(a, work: Path, run_dir: Path, spec, device_name: str, measured, results: Results) -> tuple:
    config = work / "gpu_check.json"
    config.write_text(json.dumps(check_config(a, str(run_dir)), indent=1))
    # every rank prints what it does as it changes (and every 30 s while it lasts): a slow
    # first step (the MoE check's) can be told from a hang
    env = {"MEGARL_LOG_ACTIVITY": "1", **os.environ}
    if a.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    peaks = {"datasheet": mfu.datasheet_peak(device_name), "measured": measured}
    sequences, emitted = {}, []

    def emit(record: dict, first: float) -> None:
        if not emitted:  # the launch's first step: start-up apart from the step itself
            emitted.append(record["step"])
            results.write("startup", {"startup_s": first - record["time_step"], "first_step_s": record["time_step"]})
            (work / "gpu_check_timing.json").write_text(json.dumps({"first_record_s": first}))
        # rollouts.jsonl is written after metrics.jsonl's record: wait for the step's lines briefly
        for _ in range(20):
            sequences.update(step_sequences(_jsonl(run_dir / "rollouts.jsonl")))
            if record["step"] in sequences:
                break
            time.sleep(0.05)
        results.write("step", step_figures(record, spec, sequences.get(record["step"]), peaks))

    launched = time.perf_counter()
    # the user's command: its output goes to stderr so that stdout carries the one JSON line
    proc = subprocess.Popen(
        [sys.executable, "-m", "megarl.cli", "train", "--config", str(config)],
        stdout=sys.stderr,
        env=env,
        start_new_session=True,
    )
    stopped = []

    def stop(signum, frame):  # timeout's SIGTERM: end the job now, then report what it did
        stopped.append(signum)
        # SIGKILL, not SIGTERM: a rank takes SIGTERM as preemption and would first save a checkpoint
        os.killpg(proc.pid, signal.SIGKILL)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        first = _follow(proc, run_dir, launched, emit)
    finally:
        signal.signal(signal.SIGTERM, previous)
    rc = proc.returncode if not stopped else 128 + signal.SIGTERM
    return first, rc


def main(argv=None, backend: str = "torch") -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(p, backend)
    a = p.parse_args(argv)
    return run(a, p.error)


if __name__ == "__main__":
    main()
