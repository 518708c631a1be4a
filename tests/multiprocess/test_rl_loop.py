"""The RL loop end to end: config, topology, and `megarl train` in async and sync modes.

The end-to-end runs use configs/tiny_cpu.yaml: a tiny random Llama with
SmolLM2's tokenizer, trainer TP2 (2 ranks) + 1 generator rank in async mode,
4 colocated ranks (trainer TP2 x PP2, each with its own engine) in sync mode,
arithmetic prompts scored by a test reward a random model earns about half of the time.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.config import load_config
from tests.unit.test_rl_loop import ROOT, TINY


def _train(out: Path, *overrides, timeout=900, config=TINY, env=None):
    verify = [] if "run.mode=sync" in overrides else ["generator.verify_sync=true"]
    cmd = [
        sys.executable,
        "-m",
        "megarl.cli",
        "train",
        "--config",
        config,
        f"run.output_dir={out}",
        *verify,
        *overrides,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # every trainer rank saves the same common state (rank 0's clock for the time budget): Megatron
    # warned on every multi-rank save while the ranks' train_seconds differed
    assert "common state dict differs" not in proc.stderr, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    return summary, metrics, rollouts


# earned by about half of a random model's responses: groups with both outcomes, so the loop's rewards
# can be checked against a recomputation (the math reward gives a random model 0 everywhere)
REWARD = "tests.rewards_for_tests:even_length_with_answer"


def _recomputed_rewards(rollouts: list) -> list:
    """The test reward recomputed from what was trained, independently of the reward executor: the response
    decoded from its recorded token ids, the answer looked up from the prompt's token ids in data.train."""
    from megarl.data.arithmetic import arithmetic_records
    from megarl.generator.tokenizer import load_tokenizer
    from megarl.model_source import _smollm2_tokenizer
    from tests.rewards_for_tests import even_length_with_answer

    cfg = load_config(TINY)
    tokenizer = load_tokenizer(_smollm2_tokenizer(ROOT / cfg.model.cache_dir))
    records = arithmetic_records(cfg.data.train)
    rewards = []
    for r in rollouts:
        response = tokenizer.decode(r["response_tokens"], skip_special_tokens=True)
        prompt = tokenizer.decode(r["prompt_tokens"])
        answers = {x["answer"] for x in records if x["prompt"] in prompt}
        assert len(answers) == 1, (prompt, answers)
        assert (response, r["answer"]) == (r["response"], answers.pop()), r  # the pair the loop scored
        rewards.append(even_length_with_answer(response, r["answer"]))
    return rewards


@pytest.mark.slow
def test_async_and_sync_loops(tmp_path):
    max_lag = 2
    results = {}
    for mode, layout in (("async", "trainer.pp=1"), ("sync", "trainer.pp=2")):
        # the reward and the entropy bonus move the policy, so the ratios of async's later (stale)
        # steps differ from 1 and the ESS check below has something to check
        summary, metrics, rollouts = _train(
            tmp_path / mode,
            f"run.mode={mode}",
            f"rollout.max_lag={max_lag}",
            layout,
            "trainer.entropy_coef=0.1",
            f"reward.function={REWARD}",
        )
        results[mode] = summary
        assert [m["step"] for m in metrics] == [1, 2, 3]
        # a step trains on samples of the very policy it holds -- async's step 1, and every step of sync
        # mode, whose engines take a copy of the trainer's weights (from the TP2 x PP2 shards of both
        # stages, on each rank) after each step: the engine's behaviour log-probs (SGLang layout) equal
        # Megatron's log-probs of the same tokens
        on_policy = metrics if mode == "sync" else metrics[:1]
        for m in on_policy:
            assert m["kl_mu_pi"] < 1e-5 and m["ess"] > 1 - 1e-5, m
        for m in metrics:
            # ESS = (sum r)^2 / (N sum r^2) recomputed from every trained token's recorded ratio
            # r = pi / mu (the trainer's log pi and the generator's log mu, both in rollouts.jsonl)
            ratios = [
                math.exp(lp - mu)
                for x in rollouts
                if x["step"] == m["step"]
                for lp, mu in zip(x["trainer_logprobs"], x["behaviour_logprobs"])
            ]
            assert len(ratios) == m["response_tokens"]
            ess = sum(ratios) ** 2 / (len(ratios) * sum(w * w for w in ratios))
            assert m["ess"] == pytest.approx(ess, rel=1e-5), (m, ess)
            assert m["lag_max"] <= (max_lag if mode == "async" else 0)
            assert m["samples"] == 8 and m["weight_sync_verified"] == (mode == "async")
        for r in rollouts:
            lags = [r["trained_version"] - v for v in r["versions"]]
            assert max(lags) <= max_lag and min(lags) >= 0
            assert r["versions"] == sorted(r["versions"])  # never decrease along a sequence
        rewards = [r["reward"] for r in rollouts]
        assert rewards == _recomputed_rewards(rollouts)
        assert set(rewards) == {0.0, 1.0}, rewards  # both outcomes: a check that can fail either way
        if mode == "async":  # batch k was made by policy k-1, plus sequences carried across syncs
            assert metrics[0]["lag_max"] == 0 and all(m["lag_max"] >= 1 for m in metrics[1:])
            assert all(m["ess"] < 1 - 1e-4 for m in metrics[1:])  # stale tokens: ratios away from 1
            assert [m["trained_version"] for m in metrics] == [0, 1, 2]
    assert results["async"]["samples"] == results["sync"]["samples"] == 24
    _check_plots(tmp_path)


def _check_plots(tmp_path):
    """`megarl plot` of the two runs: valid PNGs, and each figure's lines are the runs' own metrics."""
    import matplotlib.image

    from megarl.cli import main
    from megarl.plot import draw, read_run

    assert main(["plot", str(tmp_path / "async"), str(tmp_path / "sync"), "--out", str(tmp_path / "plots")]) == 0
    for name in ("reward", "kl", "lag", "ess", "time"):
        image = matplotlib.image.imread(tmp_path / "plots" / f"{name}.png")
        assert image.shape == (400, 700, 4) and image[..., :3].std() > 0.01, name
    figures = draw([read_run(tmp_path / "async"), read_run(tmp_path / "sync")])
    for i, mode in enumerate(("async", "sync")):
        metrics = [json.loads(x) for x in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
        metrics = [m for m in metrics if not m.get("eval")]
        reward = figures["reward"].axes[0].lines[i]
        assert list(reward.get_xdata()) == [1, 2, 3] and list(reward.get_ydata()) == [m["reward_mean"] for m in metrics]
        lag_mean, lag_max = figures["lag"].axes[0].lines[2 * i : 2 * i + 2]
        assert list(lag_max.get_ydata()) == [m["lag_max"] for m in metrics] and lag_max.get_linestyle() == "--"
        assert list(lag_mean.get_ydata()) == [m["lag_mean"] for m in metrics]


@pytest.mark.slow
def test_killed_rank_ends_the_job_with_its_name(tmp_path):
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", TINY, f"run.output_dir={out}", "run.steps=50"]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.time() + 600
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.time() < deadline
            time.sleep(1)
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        ranks = sorted(int(c) for c in children)
        # spawned ranks start in rank order; the last one is the generator (rank 2)
        victim = [p for p in ranks if "spawn" in Path(f"/proc/{p}/cmdline").read_text()][-1]
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=90)
        elapsed = time.time() - killed_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert elapsed < 60, elapsed
    assert "rank 2" in stderr and "SIGKILL" in stderr, stderr[-2000:]
