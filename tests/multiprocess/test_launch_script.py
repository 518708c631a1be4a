"""scripts/launch.sh: the torchrun launcher, on one CPU node for real and many GPU nodes as a dry run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "scripts" / "launch.sh"


def _launch(args, timeout=900, **env_vars) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "NODE_RANK",
            "NNODES",
            "GPUS_PER_NODE",
            "MEGARL_DEVICE",
            "MEGARL_LAUNCH_DRY_RUN",
        )
    }
    env.update(PYTHON=sys.executable, **env_vars)
    return subprocess.run(
        ["bash", str(LAUNCH), *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_scripts_parse():
    for script in ("launch.sh", "slurm.sbatch"):
        subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], check=True)


def test_many_nodes_command_line():
    proc = _launch(
        ["configs/llama3_405b.yaml", "run.steps=3"],
        MEGARL_LAUNCH_DRY_RUN="1",
        MEGARL_DEVICE="gpu",
        NNODES="128",
        NODE_RANK="5",
        GPUS_PER_NODE="8",
        MASTER_ADDR="node000",
        MASTER_PORT="6000",
    )
    assert proc.returncode == 0, proc.stderr
    torchrun = proc.stdout.strip().splitlines()[-1]
    assert "-m torch.distributed.run --nnodes 128 --node_rank 5 --nproc_per_node 8" in torchrun
    assert "--master_addr node000 --master_port 6000" in torchrun
    assert torchrun.endswith("-m megarl.cli train --config configs/llama3_405b.yaml run.steps=3")
    assert "world 1024" in proc.stderr


def test_node_count_that_does_not_make_the_world_is_refused():
    proc = _launch(
        ["configs/llama3_405b.yaml"], MEGARL_LAUNCH_DRY_RUN="1", MEGARL_DEVICE="gpu", NNODES="64", GPUS_PER_NODE="8"
    )
    assert proc.returncode == 2
    assert "needs 1024 ranks, but NNODES=64 x GPUS_PER_NODE=8 = 512; set NNODES=128" in proc.stderr


@pytest.mark.slow
def test_cpu_demo_world_through_torchrun(tmp_path):
    out = tmp_path / "run"
    proc = _launch(
        ["configs/tiny_cpu.yaml", "run.steps=2", f"run.output_dir={out}", "run.progress=false"], MEGARL_DEVICE="cpu"
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert '"world_size": 3' in proc.stderr  # --prepare-only's JSON line, echoed
    assert "3 ranks here (cpu), world 3" in proc.stderr
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2


def test_sigterm_to_launch_sh_checkpoints_and_exits_zero(tmp_path):
    """Preemption under torchrun: launch.sh passes the signal to the ranks (not to torchrun, which
    would kill them), they save at the next step boundary and the job exits 0."""
    import signal
    import time

    out = tmp_path / "run"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "NNODES")
    }
    env.update(PYTHON=sys.executable, MEGARL_DEVICE="cpu")
    proc = subprocess.Popen(
        [
            "bash",
            str(LAUNCH),
            "configs/tiny_cpu.yaml",
            "run.steps=200",
            f"run.output_dir={out}",
            "model.tokenizer=none",
            "data.train=random:64:1:12",
            "reward.function=synthetic_parity",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]
    steps = len(metrics.read_text().splitlines())
    assert steps < 200 and f"checkpoint of step {steps} saved in {out / 'checkpoints'}" in err
    assert (out / "checkpoints" / f"iter_{steps:07d}").is_dir()
