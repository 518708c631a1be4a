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

The mixture-of-experts variant is ``--preset qwen3-moe-mini`` (a random 1.98B Qwen3-MoE, 32
experts top 8, the trainer at EP1 on the one GPU: Megatron's MoE layers in its Transformer Engine
spec, the engine's experts in SGLang's FusedMoE layout, their sync through CUDA IPC; block fp8 in
SGLang, experts included); CI runs ``--preset tiny-moe`` on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from megarl.models.presets import preset_spec

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "B200": 2250e12, "A100": 312e12}


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
    return {
        "model": {"source": f"random:{a.preset}", "tokenizer": "none", "dtype": dtype},
        "trainer": trainer,
        "optimizer": {"lr": 1e-5},
        "generator": generator,
        "rollout": {
            "prompts_per_step": a.prompts_per_step,
            "samples_per_prompt": a.samples,
            "temperature": 1.0,
            "max_new_tokens": a.max_new_tokens,
            "max_lag": 2,
        },
        "reward": {"function": "synthetic_parity"},
        "data": {"train": f"random:4096:1:{a.prompt_len}", "max_prompt_tokens": a.prompt_len},
        "run": {"mode": "async", "steps": a.steps, "output_dir": out_dir, "progress": False},
    }


def _median(values):
    values = [v for v in values if v]
    return statistics.median(values) if values else None


def summarize(run_dir: Path, device_name: str, parameters: int, active_parameters: int | None = None) -> dict:
    """``active_parameters``: those one token goes through (a MoE model's top-k experts), for MFU."""
    active = active_parameters or parameters
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rollouts = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    timed = metrics[1:] or metrics  # the first step includes warm-up
    train_tps = _median(m["train_tokens_per_s"] for m in timed)
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in device_name), None)
    synced = [m for m in metrics if m["weight_sync_bytes"]]
    sync_s = _median(m["weight_sync_transfer_s"] for m in synced)
    sync_bytes = synced[0]["weight_sync_bytes"] if synced else 0
    return {
        "device": device_name,
        "parameters_B": float(f"{parameters / 1e9:.4g}"),
        "active_parameters_B": float(f"{active / 1e9:.4g}"),
        "steps": len(metrics),
        "trainer_tokens_per_s": train_tps,
        "trainer_mfu": 6 * active * train_tps / peak if peak and train_tps else None,
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
        "samples_per_s": summary["samples_per_s"],
        # the trainer rank's peak allocated memory over a step (weights, grads, optimizer, activations)
        "trainer_peak_memory_GB": max((m.get("peak_memory_gb") or 0.0) for m in metrics) or None,
    }


def main(argv=None, backend: str = "torch") -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--backend", default=backend, choices=["torch", "sglang"])
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
    p.add_argument("--workdir", help="keep the run here (default: a temporary directory)")
    a = p.parse_args(argv)
    spec = preset_spec(a.preset)
    device_name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    with tempfile.TemporaryDirectory(prefix="megarl_gpu_check_") as tmp:
        work = Path(a.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        run_dir = work / "run"
        config = work / "gpu_check.json"
        config.write_text(json.dumps(check_config(a, str(run_dir)), indent=1))
        # every rank prints what it does as it changes (and every 30 s while it lasts): a slow
        # first step (the MoE check's) can be told from a hang
        env = {"MEGARL_LOG_ACTIVITY": "1", **os.environ}
        if a.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        # the user's command: its output goes to stderr so that stdout carries the one JSON line
        proc = subprocess.run(
            [sys.executable, "-m", "megarl.cli", "train", "--config", str(config)], stdout=sys.stderr, env=env
        )
        if proc.returncode != 0:
            raise SystemExit(f"gpu_check: `megarl train --config {config}` failed with exit code {proc.returncode}")
        parameters = (spec.num_parameters(), spec.num_active_parameters())
        result = {"backend": a.backend, "preset": a.preset, **summarize(run_dir, device_name, *parameters)}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
