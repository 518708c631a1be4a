"""The learning bench's arms, end to end with `megarl train` and `megarl bench learning` on the
learning task (configs/learning_cpu.yaml: the tiny model on token ids, a few seconds a run here).

- G optimizer steps per generated batch (sync, trainer.updates_per_batch): the slices of one batch
  are disjoint groups, trained 0, 1, ... versions after they were sampled, and the first slice's
  behaviour log-probs are the trainer's own policy (KL ~ 0) while the later ones' are not.
- generator.inflight_updates=false: no trained sample holds tokens of two policies; with it on,
  the same run does have such samples (so the test fails if the knob is silently ignored).
- a small grid (two variants, two seeds, four steps): the printed summary's arithmetic against
  each run's own metrics.jsonl, the table and plots written, and a rerun keeps finished runs.
"""

from __future__ import annotations

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


def test_a_small_grid_summarises_its_runs_and_resumes(tmp_path):
    args = ("bench", "learning", "--config", CONFIG, "--variants", "sync,async_lag2", "--seeds", "2", "--last", "2")
    args += ("--workdir", str(tmp_path), "run.steps=4")
    summary = json.loads(_megarl(*args).stdout.strip().splitlines()[-1])
    finals = {}
    for name in ("sync", "async_lag2"):
        v = summary["variants"][name]
        runs = []
        for seed in (0, 1):
            lines = (tmp_path / name / f"seed{seed}" / "metrics.jsonl").read_text().splitlines()
            runs.append([json.loads(line) for line in lines if not json.loads(line).get("eval")])
        finals[name] = [sum(r["reward_mean"] for r in steps[-2:]) / 2 for steps in runs]
        assert v["n_seeds"] == 2 and v["final_rewards"] == pytest.approx(finals[name])
        assert v["final_reward"] == pytest.approx(sum(finals[name]) / 2)
        lo, hi = v["final_reward_ci95"]
        assert min(finals[name]) - 1e-12 <= lo <= hi <= max(finals[name]) + 1e-12
        tokens = {}
        for steps in runs:
            for r in steps:
                for b in range(3):
                    tokens[b] = tokens.get(b, 0) + r.get(f"tokens_lag{b}", 0)
        assert v["lag_mean"] == pytest.approx(sum(b * k for b, k in tokens.items()) / sum(tokens.values()))
    assert summary["variants"]["sync"]["lag_mean"] == 0.0
    assert summary["variants"]["async_lag2"]["lag_mean"] > 0.5  # the generator runs ahead
    diff = summary["variants"]["async_lag2"]["vs_sync"]
    assert diff == pytest.approx(sum(finals["async_lag2"]) / 2 - sum(finals["sync"]) / 2)
    table = (tmp_path / "table.md").read_text()
    assert table.count("\n| sync |") == 1 and table.count("\n| async_lag2 |") == 1
    for png in ("reward.png", "ess_kl_lag.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    # a rerun keeps the finished runs; a run cut short (no summary.json) is run again
    (tmp_path / "sync" / "seed1" / "summary.json").unlink()
    again = _megarl(*args)
    assert again.stdout.count("done before, kept") == 3
    assert json.loads(again.stdout.strip().splitlines()[-1])["variants"]["async_lag2"]["final_rewards"] == (
        pytest.approx(finals["async_lag2"])
    )
