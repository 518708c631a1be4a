"""The one evaluation path (executors/evaluation.py): the requests and seeds it makes, the answers it
reads back in prompt order whichever way a backend finishes them, alone (`megarl eval`) or
alongside training groups in flight (the in-training evaluation), and its sums and metrics."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megarl.config import RolloutConfig
from megarl.data.datasets import PromptRecord, TokenizedPrompt
from megarl.executors.evaluation import (
    EvalSettings,
    eval_metrics,
    eval_requests,
    eval_sums,
    evaluate_prompts,
    run_alone,
    sampling_seed,
)
from megarl.executors.generator import GeneratorExecutor
from megarl.generator.interface import Completion, GeneratorBackend

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [
    TokenizedPrompt([1] * (i + 2), PromptRecord([{"role": "user", "content": f"q{i}"}], str(i))) for i in range(3)
]


class SeededBackend(GeneratorBackend):
    """Answers from what a request asks alone: each sample's ids are its seed (0 when greedy), its
    sample index and its prompt's length; a sample takes (prompt length + sample index) % 3 + 1 steps,
    so samples finish out of the order they were submitted in."""

    def __init__(self):
        self.running = []  # [steps left, request, sample index]

    def submit(self, requests):
        self.running += [[(len(r.prompt_ids) + j) % 3 + 1, r, j] for r in requests for j in range(r.n)]

    def step(self):
        out = []
        for s in self.running:
            s[0] -= 1
        for _, r, j in [s for s in self.running if s[0] == 0]:
            ids = [r.params.seed or 0, j, len(r.prompt_ids)]
            out.append(
                Completion(r.request_id, j, r.group_id, r.prompt_ids, ids, [0.0] * 3, [0] * 3, "stop", dict(r.meta))
            )
        self.running = [s for s in self.running if s[0] > 0]
        return out

    def abort(self, request_ids):
        raise AssertionError("an evaluation aborts nothing")

    def update_weights(self, apply):
        raise AssertionError("no weights here")

    def stats(self):
        return {"queue_depth": 0, "running": len(self.running), "version": 0}


SETTINGS = EvalSettings(max_new_tokens=5, samples=2, temperature=0.7, top_p=0.9, seed=1234)


def test_requests_are_greedy_then_k_sampled_per_prompt_with_seeds_by_prompt():
    reqs = eval_requests("7", PROMPTS, SETTINGS, stop_ids=[0])
    assert [(r.request_id, r.n, r.group_id) for r in reqs] == [
        ("eval7-0", 1, -1), ("eval7-0s", 2, -2), ("eval7-1", 1, -3), ("eval7-1s", 2, -4), ("eval7-2", 1, -5),
        ("eval7-2s", 2, -6)]  # fmt: skip
    greedy, sampled = reqs[0].params, reqs[5].params
    assert (greedy.temperature, greedy.seed, greedy.max_new_tokens) == (0.0, None, 5)
    assert (sampled.temperature, sampled.top_p, sampled.stop_token_ids) == (0.7, 0.9, (0,))
    # (1234 * 7919 + 104729 * i) mod 2^31, by hand: i = 0 -> 9772046, i = 2 -> 9981504
    assert (reqs[1].params.seed, sampled.seed) == (9772046, 9981504)
    assert reqs[2].meta == {"answer": "1", "messages": [{"role": "user", "content": "q1"}]}
    assert [r.group_id for r in eval_requests("", PROMPTS, EvalSettings(5, 1, 1.0, 1.0, 0), [0])] == [-1, -3, -5]


def test_training_groups_draw_with_the_same_seed_function():
    # group 5001 (step 5, replica 1) of a run seeded 7: 7 * 7919 + 5001, by hand
    assert sampling_seed(7, 5001) == 60434
    assert sampling_seed(2**20, 0) == (2**20 * 7919) % 2**31 != 2**20 * 7919  # kept below 2^31


def test_the_seed_formula_is_written_once():
    hits = [p for p in (ROOT / "megarl").rglob("*.py") if re.search(r"\b7919\b", p.read_text())]
    assert [p.relative_to(ROOT).as_posix() for p in hits] == ["megarl/executors/evaluation.py"]


def _ids(groups):
    return [[c.output_ids for c in g] for g in groups]


def test_answers_come_back_in_prompt_order_alone_and_alongside_training():
    alone = evaluate_prompts(run_alone(SeededBackend()), "", PROMPTS, SETTINGS, [0])
    # per prompt: greedy (seed 0), then sample 0 and 1 with the prompt's seed
    assert _ids(alone) == [
        [[0, 0, 2], [9772046, 0, 2], [9772046, 1, 2]],
        [[0, 0, 3], [9876775, 0, 3], [9876775, 1, 3]],
        [[0, 0, 4], [9981504, 0, 4], [9981504, 1, 4]],
    ]
    backend = SeededBackend()
    rollout = RolloutConfig(prompts_per_step=2, samples_per_prompt=2, max_new_tokens=5, temperature=0.7, top_p=0.9)
    executor = GeneratorExecutor(rollout, 4, 1234, backend, PROMPTS, (0,), replica=0, groups_per_step=2)
    executor._keep_full()  # training groups in flight
    in_flight = executor.in_flight
    assert in_flight > 0
    beside = evaluate_prompts(executor.run_alongside, "3", PROMPTS, SETTINGS, [0])
    assert _ids(beside) == _ids(alone)
    # the training samples went on: those that finished meanwhile wait for the next batch
    finished = sum(len(g) for g in executor.ready) + sum(len(g) for g in executor.groups.values())
    assert executor.in_flight == in_flight - finished and executor.eval_done == []


def test_sums_and_metrics_of_one_replica_and_of_several():
    # per prompt: greedy reward, then 2 sampled
    rewards = [[1.0, 0.0, 1.0], [0.5, 0.0, 0.0], [1.0, 1.0, 1.0]]
    sums = eval_sums(rewards)
    assert sums == {"n": 3, "correct": 2, "greedy_reward": 2.5, "sampled_reward": 3.0, "pass": 2}
    assert eval_metrics([sums], 2) == {
        "n": 3,
        "accuracy": 2 / 3,
        "greedy_reward_mean": 2.5 / 3,
        "reward_mean@2": 3.0 / 6,
        "pass@2": 2 / 3,
    }
    other = {**eval_sums([[0.0, 0.0, 0.0]]), "seconds": 2.0}
    merged = eval_metrics([{**sums, "seconds": 5.0}, other], 2, "eval_")
    assert (merged["eval_n"], merged["eval_accuracy"], merged["eval_pass@2"], merged["eval_time_s"]) == (
        4,
        pytest.approx(2 / 4),
        pytest.approx(2 / 4),
        5.0,
    )
    assert set(eval_metrics([sums], 1)) == {"n", "accuracy", "greedy_reward_mean"}  # greedy alone: no sampled keys
