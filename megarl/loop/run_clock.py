"""The loop's clock and its evaluation plan: what the controller asks each iteration, decided here.

RunClock: run.time_budget_min counts the training loop's seconds from the loop's start (start-up
and conversion excluded), summed over the run's launches through the checkpoints; rank 0's clock
decides, and every rank stops at the same step boundary (preemption.agree_stop: a signal on any
rank, rank 0's budget, or the health watch). Checkpoint time is kept apart from the loop's wall
time. EvalPlan: the held-out evaluations of this launch (executors/evaluator.py), each at the top
of the iteration where step k's policy is in the generators; the last step's after the loop.
"""

from __future__ import annotations

import time
from typing import Dict, Optional

from megarl.executors.evaluator import eval_steps
from megarl.runtime import preemption


class RunClock:
    def __init__(self, cfg, resume, job):
        """Starts now: the loop's clock, continuing the ``resume.train_seconds`` of earlier launches."""
        self.budget_min, self.steps, self.job = cfg.run.time_budget_min, cfg.run.steps, job
        self.budget_s, self.spent_before = cfg.run.time_budget_min * 60.0, resume.train_seconds
        self.start = time.perf_counter()
        self.checkpoint_s = 0.0  # time spent saving: reported apart from the loop's wall time

    def already_spent(self, steps_done: int) -> bool:
        """An earlier launch spent the budget before the last step: this one trains nothing."""
        return bool(self.budget_s) and self.spent_before >= self.budget_s and steps_done < self.steps

    def spent(self, now: Optional[float] = None) -> float:
        """The run's training seconds, over its launches, at ``now`` (perf_counter; default: now)."""
        return self.spent_before + (time.perf_counter() if now is None else now) - self.start

    def over_budget(self, trains_now: bool, step_done: int) -> bool:
        """Rank 0's verdict: a step must have been trained in this iteration (async iteration 0 only
        generates), and the last step ends the run anyway."""
        return (
            self.job.rank == 0
            and self.budget_s > 0
            and trains_now
            and step_done < self.steps
            and self.spent() >= self.budget_s
        )

    def agree_stop(self, over_budget: bool, unhealthy: bool) -> Optional[str]:
        """Why every rank stops after this step ("preempted" | "time_budget" | "health"), or None."""
        return preemption.agree_stop(self.job.control, over_budget, unhealthy=unhealthy)

    def loop_seconds(self) -> float:
        """The loop's wall time so far, checkpoints excluded."""
        return time.perf_counter() - self.start - self.checkpoint_s


class EvalPlan:
    def __init__(self, cfg, schedule, steps_done: int):
        steps = eval_steps(cfg.data.eval_every, cfg.run.steps) if cfg.data.eval else []
        # a resumed run evaluates what it has not yet (step 0 only when it starts from scratch)
        self.steps = [k for k in steps if k > steps_done or k == 0 == steps_done]
        self.at: Dict[int, int] = {schedule.eval_iteration(k): k for k in self.steps if k < cfg.run.steps}
        self.after_loop = cfg.run.steps in self.steps
