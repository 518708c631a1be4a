"""Evaluation during training: records at step 0, every eval_every steps and at the end, equal to `megarl eval`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
HELD_OUT = "arithmetic:8:5:heldout:64:1"  # disjoint from the training set arithmetic:64:1


def test_eval_records_match_megarl_eval_on_the_same_checkpoint(tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "megarl.cli",
        "train",
        "--config",
        str(ROOT / "configs" / "tiny_cpu.yaml"),
        "run.steps=4",
        "data.train=arithmetic:64:1",
        "reward.function=tests.rewards_for_tests:even_length",
        f"data.eval={HELD_OUT}",
        "data.eval_every=2",
        "data.eval_samples=2",
        "run.save_every=1",
        "run.keep_checkpoints=3",
        f"run.output_dir={out}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # run.keep_checkpoints=3: of the four saves the newest three remain
    assert sorted(p.name for p in (out / "checkpoints").glob("iter_*")) == [f"iter_000000{i}" for i in (2, 3, 4)]
    evals = [r for r in records if r.get("eval")]
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert [r["step"] for r in records if not r.get("eval")] == [1, 2, 3, 4]
    for r in evals:
        assert r["eval_n"] == 8 and {"eval_accuracy", "eval_pass@2", "eval_reward_mean@2"} <= set(r)
    # step 2's greedy answers are `megarl eval`'s on the checkpoint of step 2, answer for answer
    dump = tmp_path / "dump.jsonl"
    ev = subprocess.run(
        [
            sys.executable,
            "-m",
            "megarl.cli",
            "eval",
            "--checkpoint",
            str(out / "checkpoints" / "iter_0000002"),
            "--data",
            HELD_OUT,
            "--max-new-tokens",
            "64",
            "--reward",
            "tests.rewards_for_tests:even_length",
            "--dump",
            str(dump),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert ev.returncode == 0, ev.stderr[-3000:]
    ours = [json.loads(line) for line in (out / "eval" / "step_2.jsonl").read_text().splitlines()]
    theirs = [json.loads(line) for line in dump.read_text().splitlines()]
    assert [o["response"] for o in ours] == [t["response"] for t in theirs]
    assert evals[1]["eval_accuracy"] == json.loads(ev.stdout.strip().splitlines()[-1])["accuracy"]
    # --samples 2: the sampled answers of the run's own evaluation too (its temperature, top_p and
    # seeds, read from the run's config.json), so the same mean reward and pass@2
    sampled = subprocess.run(
        [
            sys.executable,
            "-m",
            "megarl.cli",
            "eval",
            "--checkpoint",
            str(out / "checkpoints" / "iter_0000002"),
            "--data",
            HELD_OUT,
            "--max-new-tokens",
            "64",
            "--reward",
            "tests.rewards_for_tests:even_length",
            "--samples",
            "2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    result = json.loads(sampled.stdout.strip().splitlines()[-1])
    print({k: v for k, v in evals[1].items() if k.startswith("eval_")}, result)
    assert result["accuracy"] == evals[1]["eval_accuracy"]
    assert result["reward_mean@2"] == pytest.approx(evals[1]["eval_reward_mean@2"], abs=1e-12)
    assert result["pass@2"] == evals[1]["eval_pass@2"]
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "megarl.cli",
            "eval",
            "--checkpoint",
            str(out),
            "--data",
            HELD_OUT,
            "--samples",
            "2",
            "--temperature",
            "0",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode != 0 and "--temperature" in refused.stderr
    # the policy moved between the evaluations: the answers are not one fixed model's
    step0 = [json.loads(line)["response"] for line in (out / "eval" / "step_0.jsonl").read_text().splitlines()]
    assert step0 != [o["response"] for o in ours]


def test_named_eval_sets_are_evaluated_and_recorded_each_under_its_name(tmp_path):
    """data.eval of two named sets (the held-out arithmetic set and the off-distribution one): every
    evaluation record has each set's metrics under its name, over its own prompts, and the responses
    file tags each answer with its set: 6 and 5 prompts, the texts those of each set's records."""
    from megarl.data.datasets import load_records

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", str(ROOT / "configs" / "tiny_cpu.yaml"),
           "run.steps=1", "data.train=arithmetic:64:1", "reward.function=tests.rewards_for_tests:even_length",
           "data.eval=[heldout=arithmetic:6:5:heldout:64:1,ood=arithmetic-ood:5:3]", f"run.output_dir={out}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("eval")]
    assert [r["step"] for r in evals] == [0, 1]
    for r in evals:
        assert (r["eval_heldout_n"], r["eval_ood_n"]) == (6, 5) and "eval_accuracy" not in r
        lines = [json.loads(x) for x in (out / "eval" / f"step_{r['step']}.jsonl").read_text().splitlines()]
        for name, spec in (("heldout", "arithmetic:6:5:heldout:64:1"), ("ood", "arithmetic-ood:5:3")):
            mine = [x for x in lines if x["set"] == name]
            assert sorted(x["answer"] for x in mine) == sorted(rec.answer for rec in load_records(spec))
            # the test reward: 1 for an even-length response, so the accuracy is recomputable from the file
            assert r[f"eval_{name}_accuracy"] == sum(x["reward"] >= 1 for x in mine) / len(mine)


def _cli(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "megarl.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_megarl_eval_with_tools_runs_the_episodes_training_evaluates(tmp_path):
    """`megarl eval --tools` renders the prompts with the tools and runs episodes as rollout.tools
    does: its greedy answers are the in-training evaluation's, answer for answer, and without
    --tools (no tools in the prompt) they are not."""
    out = tmp_path / "run"
    tools = ["rollout.tools=[calculator]", "rollout.max_turns=3", "reward.scored_text=final_turn"]
    proc = _cli("train", "--config", str(ROOT / "configs" / "tiny_cpu.yaml"), "run.steps=2", *tools,
                "data.max_prompt_tokens=320", "generator.max_seq_len=448", "trainer.max_tokens_per_microbatch=512",
                f"data.eval={HELD_OUT}", "data.eval_max_new_tokens=16", f"run.output_dir={out}")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = [json.loads(line) for line in (out / "eval" / "step_2.jsonl").read_text().splitlines()]
    dumps, results = {}, {}
    for name, flags in (("tools", ["--tools", "calculator", "--max-turns", "3"]), ("plain", [])):
        dumps[name] = tmp_path / f"{name}.jsonl"
        ev = _cli("eval", "--checkpoint", str(out), "--data", HELD_OUT, "--max-new-tokens", "16",
                  "--dump", str(dumps[name]), *flags)  # fmt: skip
        assert ev.returncode == 0, ev.stderr[-3000:]
        results[name] = json.loads(ev.stdout.strip().splitlines()[-1])
    theirs = [json.loads(line) for line in dumps["tools"].read_text().splitlines()]
    plain = [json.loads(line) for line in dumps["plain"].read_text().splitlines()]
    assert [o["response"] for o in ours] == [t["response"] for t in theirs]
    assert [t["episode"]["turns"] for t in theirs] == [1] * len(theirs)  # a random model calls no tool
    assert results["tools"]["tool_calls_mean"] == 0 and results["tools"]["turns_mean"] == 1
    assert [p["response"] for p in plain] != [t["response"] for t in theirs]
    refused = _cli("eval", "--checkpoint", str(out), "--data", HELD_OUT, "--max-turns", "3", timeout=300)
    assert refused.returncode != 0 and "--max-turns: > 1 needs --tools" in refused.stderr
