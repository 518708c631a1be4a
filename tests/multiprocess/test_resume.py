"""Preemption and exact resume: SIGTERM, checkpoint at the step boundary, exit 0, relaunch, continue.

A sync run of 4 steps in one go and the same run stopped by SIGTERM after its
first step and relaunched must train on the same prompts, sample the same
responses, earn the same rewards and compute the same losses, bitwise. The
tokenizer-free tiny model with the synthetic parity reward is used because it
earns reward (a random model earns none on arithmetic), so the policy moves
and the losses differ from step to step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ARGS = [
    "--config",
    str(ROOT / "configs" / "tiny_cpu.yaml"),
    "run.mode=sync",
    "run.steps=4",
    "model.tokenizer=none",
    "data.train=random:64:1:12",
    "reward.function=synthetic_parity",
]


def train_cmd(out: Path):
    return [sys.executable, "-m", "megarl.cli", "train", *ARGS, f"run.output_dir={out}"]


def records(out: Path, name: str):
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight") / "run"
    subprocess.run(train_cmd(out), cwd=ROOT, check=True, capture_output=True, timeout=900)
    return out


def test_sigterm_saves_at_the_step_boundary_and_the_relaunch_continues_bitwise(straight, tmp_path):
    preempted = tmp_path / "preempted"

    proc = subprocess.Popen(train_cmd(preempted), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = preempted / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    stopped_at = len(records(preempted, "metrics.jsonl"))
    assert 1 <= stopped_at < 4  # it stopped early, at a step boundary
    assert f"checkpoint of step {stopped_at} saved in {preempted / 'checkpoints'}" in err
    assert json.loads(out.strip().splitlines()[-1])["preempted"] is True

    relaunch = subprocess.run(train_cmd(preempted), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]
    a, b = records(straight, "metrics.jsonl"), records(preempted, "metrics.jsonl")
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", "reward_mean", "kl_mu_pi", "lr", "response_tokens"):
        assert [m[key] for m in a] == [m[key] for m in b], key
    assert len({m["loss"] for m in a}) == 4  # the policy moved: equal losses are not four zeros
    # the same prompts, sampled tokens, behaviour log-probs and rewards, sample by sample
    assert records(straight, "rollouts.jsonl") == records(preempted, "rollouts.jsonl")


def test_a_second_signal_exits_at_once(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        train_cmd(out) + ["run.steps=50"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not metrics.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    time.sleep(1)  # two signals at the same instant reach a Python handler as one
    proc.send_signal(signal.SIGTERM)
    start = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - start < 10
    assert proc.returncode == 128 + signal.SIGTERM
    assert "second signal (SIGTERM)" in err


def test_replay_reproduces_the_recorded_losses(straight, tmp_path):
    """`megarl train --replay`: the trainer ranks alone, on the recorded token ids, reproduce each step's loss."""
    out = tmp_path / "replay"
    cmd = [
        sys.executable,
        "-m",
        "megarl.cli",
        "train",
        "--config",
        str(straight / "config.json"),
        "--replay",
        str(straight / "rollouts.jsonl"),
        f"run.output_dir={out}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recorded = [m["loss"] for m in records(straight, "metrics.jsonl")]
    replayed = [m["loss"] for m in records(out, "metrics.jsonl")]
    assert len(replayed) == 4 and len(set(recorded)) == 4
    assert max(abs(a - b) for a, b in zip(recorded, replayed)) <= 1e-6
    assert json.loads(proc.stdout.strip().splitlines()[-1])["max_abs_loss_diff"] <= 1e-6
    # replaying into the recorded run's own directory would append to its metrics: refused
    cmd[-1] = f"run.output_dir={straight}"
    refused = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "is the run being replayed" in refused.stderr


@pytest.mark.parametrize("rank, role", [(2, "generator replica 0, TP rank 0"), (0, "trainer")])
def test_a_stopped_rank_ends_the_job_naming_it(tmp_path, rank, role):
    """SIGSTOP a rank (no crash, no exit: it just stops moving): the hang watchers end the job within
    run.hang_timeout_s + 30 s with a message naming that rank. Rank 2 is the generator; rank 0 a
    trainer rank that also hosts the job's store, which the watchers read: its peers' reads of the
    store then never return, and the last rank's store watch names it."""
    hang_timeout = 15
    out, scratch = tmp_path / "run", tmp_path / "tmp"
    scratch.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "megarl.cli",
        "train",
        "--config",
        str(ROOT / "configs" / "tiny_cpu.yaml"),
        "run.steps=200",
        f"run.hang_timeout_s={hang_timeout}",
        "model.tokenizer=none",
        "data.train=random:64:1:12",
        "reward.function=synthetic_parity",
        f"run.output_dir={out}",
    ]
    # TMPDIR: the launcher's rank directory (runtime/launch.py) lands where this test finds it
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(scratch)},
    )
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # the loop is running
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    # the rank (trainer TP2 = ranks 0, 1) by the role file it wrote for the launcher, not by pid order:
    # pids wrap (pid_max is 32768 on many machines) and the suite starts thousands of processes
    (role_file,) = scratch.glob(f"megarl_ranks_*/rank{rank}.role")
    assert role_file.read_text().startswith(f"{role}, pid ")
    stopped = int(role_file.read_text().rsplit(" ", 1)[1])
    os.kill(stopped, signal.SIGSTOP)
    start = time.monotonic()
    try:
        _, err = proc.communicate(timeout=hang_timeout + 30)
    except subprocess.TimeoutExpired:
        tree = subprocess.run(["ps", "-eo", "pid,ppid,stat,etimes,args"], capture_output=True, text=True).stdout
        for pid in (stopped, proc.pid):  # the stopped rank holds the job's stderr open too
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            err = proc.communicate(timeout=60)[1]
        except subprocess.TimeoutExpired as late:  # (its output so far comes as bytes)
            err = late.stderr.decode(errors="replace") if isinstance(late.stderr, bytes) else (late.stderr or "")
        raise AssertionError(
            f"the job did not end; stopped pid {stopped}; its stderr:\n{err[-4000:]}\n"
            + "\n".join(line[:160] for line in tree.splitlines() if "python" in line)
        ) from None
    finally:
        if proc.poll() is None:
            proc.kill()
        try:
            os.kill(stopped, signal.SIGKILL)
        except OSError:
            pass
    assert time.monotonic() - start <= hang_timeout + 30
    assert proc.returncode != 0
    assert f"rank {rank} ({role}, pid {stopped}" in err and "made no progress for" in err, err[-3000:]
    assert ("its process stopped running too" if rank else "it hosts the job's store") in err, err[-3000:]


def test_ctrl_c_saves_a_checkpoint_like_sigterm(tmp_path):
    """Ctrl-C at a terminal: SIGINT to the launcher and every rank of its process group at once (an async
    run: a trainer and a generator rank beside the launcher). The job saves at the step boundary and
    exits 0, no traceback; before, it exited 130 with one traceback per process and no checkpoint."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        train_cmd(out) + ["run.mode=async", "run.steps=50"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    stopped_at = len(records(out, "metrics.jsonl"))
    assert 1 <= stopped_at < 50
    assert f"checkpoint of step {stopped_at} saved in {out / 'checkpoints'}" in err
