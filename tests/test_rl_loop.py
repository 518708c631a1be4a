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
from megarl.errors import ConfigError
from megarl.loop.wiring import topology

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")


# -- config and topology (fast) ---------------------------------------------------------------


def test_config_errors_name_the_field(tmp_path):
    cfg = load_config(
        TINY,
        [
            "optimizer.lr=3e-4",
            "generator.backend=sglang",
            "generator.replicas=2",
            "generator.sglang_urls=http://a:1,http://b:2",
        ],
    )
    assert cfg.optimizer.lr == 3e-4 and cfg.generator.sglang_urls == ["http://a:1", "http://b:2"]
    cases = {
        "trainer.tp=two": "trainer.tp: expected an integer",
        "trainer.tpp=2": "trainer.tpp: unknown field",
        "run.mode=fast": "run.mode: 'fast' is not one of",
        "rollout.prompts_per_step=0": "rollout.prompts_per_step: must be >= 1",
        "rollout.temperature=0": "rollout.temperature: RL needs sampling",
        "generator.max_seq_len=64": "generator.max_seq_len=64 <",
        "reward=3": "reward: expected a section",
        # a field is used or refused: SGLang's settings with the torch engine, a URL per replica
        "generator.sglang_urls=http://a:1": "generator.sglang_urls: used only with generator.backend=sglang",
        "generator.sglang_mem_fraction=0.5": "generator.sglang_mem_fraction: used only with",
        "model.tokenizer=none": "model.tokenizer: none is for random:<preset> models|data.train: with model.tokenizer",
    }
    sglang = ["generator.backend=sglang"]
    sglang_cases = {
        "generator.sglang_urls=http://a:1,http://b:2": "2 URLs for generator.replicas=1",
        "generator.sglang_urls=a:1": "generator.sglang_urls\\[0\\]: 'a:1' is not an http",
        "generator.recompute_kv_on_update=true": "generator.recompute_kv_on_update: SGLang keeps the KV cache",
        "run.mode=sync": "run.mode: sync \\(colocated\\) runs the torch engine",
    }
    with pytest.raises(ConfigError, match="generator.verify_sync: sync mode copies"):
        load_config(TINY, ["run.mode=sync", "generator.verify_sync=true"])
    for override, message in sglang_cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(TINY, [*sglang, override])
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            load_config(TINY, [override])
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))


def test_topology_assigns_every_rank_once():
    cfg = load_config(TINY, ["trainer.dp=2", "generator.tp=2", "generator.replicas=2"])
    topo = topology(cfg)
    assert topo.world_size == 8
    assert topo.executors == {"trainer": (0, 1, 2, 3), "generator": (4, 5, 6, 7), "reward": (4, 6)}
    assert topo.trainer_groups()["tp"] == [[0, 1], [2, 3]] and topo.trainer_groups()["dp"] == [[0, 2], [1, 3]]
    assert topo.generator_tp_groups() == [[4, 5], [6, 7]] and topo.replica_of(7) == (1, 1)
    assert len(topo.check(gpus_per_node=4)) == 4
    # ranks 0-1 trainer, [2, 3] and [4, 5] generator replicas: [2, 3] straddles nodes of 3 GPUs
    with pytest.raises(ConfigError, match="generator TP group \\[2, 3\\] spans nodes"):
        topology(load_config(TINY, ["generator.tp=2", "generator.replicas=2"])).check(gpus_per_node=3)
    sync = topology(load_config(TINY, ["run.mode=sync"]))
    assert sync.executors == {"trainer": (0, 1), "generator": (0, 1), "reward": (0, 1)}
    assert [c.name for c in sync.channels] == ["rollouts", "batch", "weights"]


# -- end to end (slow) ------------------------------------------------------------------------


def _train(out: Path, *overrides, timeout=900):
    verify = [] if "run.mode=sync" in overrides else ["generator.verify_sync=true"]
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", TINY, f"run.output_dir={out}", *verify, *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
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
