"""Evaluation during training (data.eval): held-out accuracy measured by the generator replicas.

At step 0, every ``data.eval_every`` steps and after the last one, each replica
answers its share of the held-out prompts with the policy of that step -- greedy
(accuracy: reward >= 1), and ``data.eval_samples`` sampled answers when above 1
(mean reward, pass@k) -- decoding alongside the training groups in flight. The
trainer does not wait for it: in async mode only the replica's next batch is late
by the evaluation's time. Each replica posts its sums to the job's store; the
trainer's first rank writes one record per evaluation to metrics.jsonl (and
TensorBoard) once every replica has posted, and the responses to
RUN_DIR/eval/step_<k>.jsonl. The greedy answers are those of `megarl eval` on the
checkpoint of the same step (the same engine and dtype, greedy decoding).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Dict, List

KEY = "megarl/eval/{}/{}"


def eval_steps(every: int, last: int) -> List[int]:
    """The steps evaluated: 0, every ``every`` (0: none between), and the last."""
    steps = {0, last}
    if every:
        steps.update(range(every, last, every))
    return sorted(steps)


class ReplicaEvaluator:
    """One replica's share of the held-out set; ``report``: this rank scores and posts (first TP rank)."""

    def __init__(self, data_cfg, generator, reward, prompts, replica: int, replicas: int, store, report: bool):
        self.cfg, self.generator, self.reward, self.store = data_cfg, generator, reward, store
        self.prompts = prompts[replica::replicas]
        self.replica, self.report = replica, report

    def run(self, step: int) -> None:
        start = time.perf_counter()
        groups = self.generator.evaluate(str(step), self.prompts, self.cfg.eval_max_new_tokens, self.cfg.eval_samples)
        if not self.report:
            return
        scored = self.reward.score(groups, on_error="zero").samples  # every prompt scored, failures as 0
        k = self.cfg.eval_samples
        per = 1 + (k if k > 1 else 0)
        sums = {
            "n": len(groups),
            "correct": 0,
            "greedy_reward": 0.0,
            "sampled_reward": 0.0,
            "pass": 0,
            "seconds": 0.0,
            "responses": [],
        }
        for i, prompt in enumerate(self.prompts):
            greedy, sampled = scored[i * per], scored[i * per + 1 : (i + 1) * per]
            sums["correct"] += greedy.reward >= 1.0
            sums["greedy_reward"] += greedy.reward
            sums["sampled_reward"] += sum(s.reward for s in sampled)
            sums["pass"] += any(s.reward >= 1.0 for s in sampled)
            sums["responses"].append(
                {
                    "prompt_index": i,
                    "answer": prompt.record.answer,
                    "response": greedy.response_text,
                    "reward": greedy.reward,
                    "response_tokens": greedy.response_tokens,
                }
            )
        sums["seconds"] = time.perf_counter() - start
        self.store.set(KEY.format(step, self.replica), json.dumps(sums))


class EvalCollector:
    """The trainer's first rank: merges the replicas' posts into one record per evaluated step."""

    def __init__(self, store, replicas: int, samples: int, out: Path):
        self.store, self.replicas, self.samples, self.out = store, replicas, samples, out
        self.waiting: List[int] = []

    def expect(self, step: int) -> None:
        self.waiting.append(step)

    def collect(self, writer, block: bool = False) -> None:
        for step in list(self.waiting):
            keys = [KEY.format(step, r) for r in range(self.replicas)]
            if not block and not self.store.check(keys):
                continue
            posts = [json.loads(self.store.get(key)) for key in keys]
            writer.write(self._record(step, posts))
            self.waiting.remove(step)

    def _record(self, step: int, posts: List[Dict]) -> dict:
        n = sum(p["n"] for p in posts)
        record = {
            "step": step,
            "eval": True,
            "eval_n": n,
            "eval_accuracy": sum(p["correct"] for p in posts) / n,
            "eval_greedy_reward_mean": sum(p["greedy_reward"] for p in posts) / n,
            "eval_time_s": max(p["seconds"] for p in posts),
        }
        if self.samples > 1:
            record[f"eval_reward_mean@{self.samples}"] = sum(p["sampled_reward"] for p in posts) / (n * self.samples)
            record[f"eval_pass@{self.samples}"] = sum(p["pass"] for p in posts) / n
        folder = self.out / "eval"
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"step_{step}.jsonl", "w") as f:
            for replica, p in enumerate(posts):
                for r in p["responses"]:
                    f.write(json.dumps({"replica": replica, **r}) + "\n")
        return record
