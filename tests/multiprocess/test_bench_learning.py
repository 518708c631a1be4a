"""The learning bench's arms, end to end with `megarl train` and `megarl bench learning` on the
learning task (configs/learning_cpu.yaml: the tiny model on token ids, a few seconds a run here).

- G optimizer steps per generated batch (sync, trainer.updates_per_batch): the slices of one batch
  are disjoint groups, trained 0, 1, ... versions after they were sampled, and the first slice's
  behaviour log-probs are the trainer's own policy (KL ~ 0) while the later ones' are not.
- generator.inflight_updates=false: no trained sample holds tokens of two policies; with it on,
  the same run does have such samples (so the test fails if the knob is silently ignored).
- a small grid (two arms, two seeds, four steps): runs.csv against each run's own metrics.jsonl (the
  final policy's held-out scores are its last evaluation), the table and plots written, remade from
  the CSVs alone, and a rerun keeps finished runs.
- the repeat task (the demo's regime, SmolLM2's tokenizer): two arms, two seeds from one warm start.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "learning_cpu.yaml")


def _megarl(*args, timeout=900):
    proc = subprocess.run(
        [sys.executable, "-m", "megarl.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _train(out: Path, *overrides):
    _megarl("train", "--config", CONFIG, f"run.output_dir={out}", "run.log_rollouts=true", *overrides)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    return [m for m in metrics if not m.get("eval")], rollouts


def test_g_optimizer_steps_per_batch_train_disjoint_slices_of_one_generation(tmp_path):
    metrics, rollouts = _train(tmp_path, "run.mode=sync", "trainer.dp=2", "trainer.updates_per_batch=2", "run.steps=4")
    assert [m["lag_max"] for m in metrics] == [0, 1, 0, 1]
    assert all(m["samples"] == 32 for m in metrics)
    groups = {k: {r["group"] for r in rollouts if r["step"] == k} for k in (1, 2, 3, 4)}
    assert all(len(g) == 8 for g in groups.values())
    assert not groups[1] & groups[2] and not groups[3] & groups[4]
    # every sample of slices 1 and 2 was sampled by policy 0, of slices 3 and 4 by policy 2
    assert {v for r in rollouts if r["step"] in (1, 2) for v in r["versions"]} == {0}
    assert {v for r in rollouts if r["step"] in (3, 4) for v in r["versions"]} == {2}
    # the first slice of each batch is on-policy; the second is trained by a policy one step on
    assert metrics[0]["kl_mu_pi"] < 1e-6 and metrics[2]["kl_mu_pi"] < 1e-6
    assert metrics[1]["kl_mu_pi"] > 1e-5 and metrics[3]["kl_mu_pi"] > 1e-5
    assert metrics[1]["time_generate"] == 0.0 < metrics[0]["time_generate"]


def test_inflight_updates_off_keeps_every_sample_to_one_policy_version(tmp_path):
    common = ("run.mode=async", "rollout.max_lag=8", "run.steps=10")
    on_metrics, on_rollouts = _train(tmp_path / "on", *common)
    off_metrics, off_rollouts = _train(tmp_path / "off", *common, "generator.inflight_updates=false")
    mixed = lambda rollouts: sum(len(set(r["versions"])) > 1 for r in rollouts)  # noqa: E731
    assert mixed(on_rollouts) > 0 and max(m["mixed_version_frac"] for m in on_metrics) > 0
    assert mixed(off_rollouts) == 0 and all(m["mixed_version_frac"] == 0 for m in off_metrics)
    # both still train off-policy: the generator runs ahead of the trainer by up to max_lag
    assert max(m["lag_max"] for m in off_metrics) >= 2


def _csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_a_small_grid_scores_final_policies_writes_csv_and_resumes(tmp_path):
    args = ("bench", "learning", "--arms", "sync,async_lag2", "--seeds", "2", "--last", "2")
    args += ("--workdir", str(tmp_path), "run.steps=4")
    summary = json.loads(_megarl(*args).stdout.strip().splitlines()[-1])
    rows = {(r["arm"], int(r["seed"])): r for r in _csv(tmp_path / "runs.csv")}
    assert sorted(rows) == [("async_lag2", 0), ("async_lag2", 1), ("sync", 0), ("sync", 1)]
    for (arm, seed), row in rows.items():
        records = [
            json.loads(line) for line in (tmp_path / arm / f"seed{seed}" / "metrics.jsonl").read_text().splitlines()
        ]
        steps = [r for r in records if not r.get("eval")]
        final = next(r for r in records if r.get("eval") and r["step"] == 4)
        start = next(r for r in records if r.get("eval") and r["step"] == 0)
        # the final policy's held-out scores are its run's last evaluation, not its training reward
        assert float(row["heldout_greedy_reward"]) == final["eval_greedy_reward_mean"]
        assert float(row["heldout_sampled_reward"]) == final["eval_reward_mean@4"]
        assert float(row["start_sampled_reward"]) == start["eval_reward_mean@4"]
        assert int(row["heldout_n"]) == final["eval_n"] == 64 and int(row["eval_samples"]) == 4
        assert float(row["train_reward_last"]) == pytest.approx(sum(r["reward_mean"] for r in steps[-2:]) / 2)
        assert int(row["steps"]) == 4 and int(row["samples"]) == 128
        tokens = {b: sum(r.get(f"tokens_lag{b}", 0) for r in steps) for b in range(3)}
        lag = sum(b * k for b, k in tokens.items()) / sum(tokens.values())
        assert float(row["lag_mean"]) == pytest.approx(lag)
    assert all(float(rows[("sync", s)]["lag_mean"]) == 0.0 for s in (0, 1))
    assert all(float(rows[("async_lag2", s)]["lag_mean"]) > 0.5 for s in (0, 1))  # the generator runs ahead
    a = [float(rows[("async_lag2", s)]["heldout_sampled_reward"]) for s in (0, 1)]
    b = [float(rows[("sync", s)]["heldout_sampled_reward"]) for s in (0, 1)]
    diff = summary["arms"]["async_lag2"]["heldout_sampled_reward"]["vs_sync"]
    assert diff["diff"] == pytest.approx(sum(a) / 2 - sum(b) / 2)
    # curves: every trained sample counted once, under the version that generated it
    curves = _csv(tmp_path / "curves.csv")
    assert sum(int(c["samples"]) for c in curves if c["arm"] == "sync") == 256
    assert {int(c["version"]) for c in curves if c["arm"] == "sync"} == {0, 1, 2, 3}
    table = (tmp_path / "table.md").read_text()
    assert table.count("\n| sync | 2 |") == 1 and table.count("\n| async_lag2 | 2 |") == 1
    for png in ("reward_by_version.png", "heldout.png", "ess_kl_lag.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    # everything is remade from the CSVs alone
    (tmp_path / "table.md").unlink()
    _megarl("bench", "learning", "--workdir", str(tmp_path), "--report-only", "--no-plots")
    assert (tmp_path / "table.md").read_text() == table
    # a rerun keeps the finished runs; a run cut short (no summary.json) is run again
    (tmp_path / "sync" / "seed1" / "summary.json").unlink()
    again = _megarl(*args)
    assert again.stdout.count("done before, kept") == 3
    assert _csv(tmp_path / "runs.csv")[2:] == [rows[("async_lag2", 0)], rows[("async_lag2", 1)]]


def test_the_repeat_task_two_arms_two_seeds_from_one_warm_start(tmp_path):
    """The demo's regime end to end: the warm start built once by `megarl sft`, every run starting from it,
    answers ending at SmolLM2's stop token, each final policy scored on held-out pairs. Two sft steps and
    two RL steps: the mechanics, not the learning (a policy that random rewards nothing, so filter_groups,
    which would wait for a group with two rewards, is off here)."""
    args = ("bench", "learning", "--task", "repeat", "--arms", "sync,async", "--seeds", "2", "--last", "1")
    args += ("--warm-start-records", "64", "--workdir", str(tmp_path))
    args += ("run.steps=2", "data.eval=repeat:8:0:heldout", "rollout.filter_groups=false")
    out = _megarl(*args).stdout
    assert out.count("sft steps") == 1
    assert json.loads((tmp_path / "warm_start" / "warm_start.json").read_text())["steps"] == 2
    warm = tmp_path / "warm_start" / "checkpoints"
    rows = _csv(tmp_path / "runs.csv")
    assert [(r["arm"], r["seed"]) for r in rows] == [("sync", "0"), ("sync", "1"), ("async", "0"), ("async", "1")]
    starts = set()
    for r in rows:
        run = tmp_path / r["arm"] / f"seed{r['seed']}"
        assert json.loads((run / "config.json").read_text())["model"]["source"] == str(warm)
        rollouts = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
        # each answer ends at the stop token or at rollout.max_new_tokens
        assert all(s["finish_reason"] in ("stop", "length") for s in rollouts)
        assert all(len(s["response_tokens"]) == 48 for s in rollouts if s["finish_reason"] == "length")
        assert int(r["heldout_n"]) == 8 and int(r["samples"]) == 64
        assert float(r["train_tokens_max"]) <= 48
        starts.add(r["start_greedy_reward"])
    assert len(starts) == 1  # one warm start, one greedy held-out score at step 0 whatever the arm and seed
    assert "| async | 2 |" in (tmp_path / "table.md").read_text()
    # a second call keeps the warm start and every run
    again = _megarl(*args).stdout
    assert "warm start" in again and "done before, kept" in again and "sft steps" not in again
