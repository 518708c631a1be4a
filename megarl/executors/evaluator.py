"""Evaluation during training (data.eval): held-out accuracy measured by the generator replicas,
on one set or several named ones (metrics keyed by the set's name).

At step 0, every ``data.eval_every`` steps and after the last one, each replica
answers its share of the held-out prompts with the policy of that step -- greedy
(accuracy: reward >= 1), and ``data.eval_samples`` sampled answers when above 1
(mean reward, pass@k) -- decoding alongside the training groups in flight. The
trainer does not wait for it: in async mode only the replica's next batch is late
by the evaluation's time. Each replica posts its sums to the job's store; the
trainer's first rank writes one record per evaluation to metrics.jsonl (and
TensorBoard) once every replica has posted, and the responses to
RUN_DIR/eval/step_<k>.jsonl. The requests, seeds, sums and metrics are
executors/evaluation.py's, which `megarl eval` runs too: its answers on the checkpoint of the
same step are these (the same engine and dtype).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Dict, List, Optional

from megarl.executors.evaluation import EvalSettings, eval_metrics, eval_sums, evaluate_prompts

KEY = "megarl/eval/{}/{}"


def eval_steps(every: int, last: int) -> List[int]:
    """The steps evaluated: 0, every ``every`` (0: none between), and the last."""
    steps = {0, last}
    if every:
        steps.update(range(every, last, every))
    return sorted(steps)


class ReplicaEvaluator:
    """One replica's share of each held-out set (``sets``: name -> prompts; "" for one unnamed set);
    ``report``: this rank scores and posts (first TP rank)."""

    def __init__(self, data_cfg, generator, reward, sets: Dict[str, list], replica: int, replicas: int, store,
                 report: bool):  # fmt: skip
        self.cfg, self.generator, self.reward, self.store = data_cfg, generator, reward, store
        self.sets = {name: prompts[replica::replicas] for name, prompts in sets.items()}
        self.replica, self.report = replica, report

    def run(self, step: int) -> None:
        posts = {name: self._run_set(step, name, prompts) for name, prompts in self.sets.items()}
        if self.report:
            self.store.set(KEY.format(step, self.replica), json.dumps(posts))

    def _run_set(self, step: int, name: str, prompts) -> Optional[dict]:
        start = time.perf_counter()
        tag = f"{step}-{name}" if name else str(step)
        g = self.generator
        settings = EvalSettings(
            self.cfg.eval_max_new_tokens, self.cfg.eval_samples, g.rollout.temperature, g.rollout.top_p, g.seed
        )
        groups = evaluate_prompts(g.run_alongside, tag, prompts, settings, g.stop_ids)
        if not self.report:
            return None
        scored = self.reward.score(groups, on_error="zero").samples  # every prompt scored, failures as 0
        per_prompt, at = [], 0
        for group in groups:
            per_prompt.append(scored[at : at + len(group)])
            at += len(group)
        sums = eval_sums([[s.reward for s in answers] for answers in per_prompt])
        sums["responses"] = [
            {
                "prompt_index": i,
                "answer": prompt.record.answer,
                "response": answers[0].response_text,
                "reward": answers[0].reward,
                "response_tokens": answers[0].response_tokens,
            }
            for i, (prompt, answers) in enumerate(zip(prompts, per_prompt))
        ]
        sums["seconds"] = time.perf_counter() - start
        return sums


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
        """``posts``: per replica, {set name: its sums}. One set without a name gives eval_accuracy,
        eval_n, ...; named sets eval_<name>_accuracy, eval_<name>_n, ..."""
        record = {"step": step, "eval": True}
        for name in posts[0]:
            record.update(eval_metrics([p[name] for p in posts], self.samples, f"eval_{name}_" if name else "eval_"))
        folder = self.out / "eval"
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"step_{step}.jsonl", "w") as f:
            for name in posts[0]:
                for replica, p in enumerate(posts):
                    for r in p[name]["responses"]:
                        f.write(json.dumps({**({"set": name} if name else {}), "replica": replica, **r}) + "\n")
        return record
