"""When the loop generates, trains and syncs: run.mode's two schedules of the single controller.

    async   iteration i: generators make batch i  ||  trainer trains batch i-1 (the pending batch);
            steps + 1 iterations (iteration 0 only generates); weights of policy i go out after
            the trainer's step of iteration i, unless no batch follows
    sync    iteration i: generate batch i with policy i (drained: every sequence finishes under
            it), then train it; steps iterations; weights go out after every step

The controller (controller.py) runs one loop for both and never asks which mode it is in:
where they differ, it asks its Schedule, picked once by ``make_schedule(run.mode)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional


@dataclass
class IterationWork:
    batch: Optional[dict]  # the batch made in this iteration (every trainer rank; None where none was made)
    train_metrics: Optional[dict]  # the trainer's step of this iteration (trainer ranks; None if it trained none)
    trained: Optional[dict]  # the batch that step trained on


class Schedule(ABC):
    mode: str
    # the generators' copy of the policy is checked against the trainer's after each sync
    # (generator.verify_sync): in async mode only, where the two are different processes
    verifies_sync: bool

    @abstractmethod
    def iterations(self, start: int, steps: int) -> range:
        """The loop's iterations for a run of ``steps`` steps resumed at iteration ``start``."""

    @abstractmethod
    def step_of(self, iteration: int) -> int:
        """The training step an iteration completes (the step number its metrics and checkpoint carry)."""

    @abstractmethod
    def eval_iteration(self, step: int) -> int:
        """The iteration at whose top step ``step``'s policy is in the generators."""

    @abstractmethod
    def trains(self, has_pending: bool) -> bool:
        """Whether this iteration trains a step (``has_pending``: a batch waits from the last one)."""

    @abstractmethod
    def syncs_after(self, iteration: int, steps: int, trains: bool) -> bool:
        """Whether the weights go to the generators at the end of this iteration."""

    @abstractmethod
    def work(self, loop, iteration: int, make_batch: bool, pending: Optional[dict]) -> IterationWork:
        """Generate, transfer and train (``loop``: the Controller; ``pending``: the batch carried over)."""

    @abstractmethod
    def carry(self, work: IterationWork, make_batch: bool, trainer_rank: bool) -> tuple:
        """(pending, has_pending) for the next iteration: the batch it trains, saved with a checkpoint."""

    def before_final_eval(self, loop) -> None:
        """Bring the last step's policy to the generators before the evaluation after the loop."""


class AsyncSchedule(Schedule):
    mode = "async"
    verifies_sync = True

    def iterations(self, start: int, steps: int) -> range:
        return range(start, steps + 1)

    def step_of(self, iteration: int) -> int:
        return iteration

    def eval_iteration(self, step: int) -> int:
        return step + 1 if step > 0 else step

    def trains(self, has_pending: bool) -> bool:
        return has_pending

    def syncs_after(self, iteration: int, steps: int, trains: bool) -> bool:
        return trains and iteration < steps  # no batch follows the last step

    def work(self, loop, iteration: int, make_batch: bool, pending: Optional[dict]) -> IterationWork:
        import time

        trained_key = f"megarl/trained/{iteration}"
        gen_out, train_metrics = None, None
        if loop.generator is not None and make_batch:
            loop.heartbeat.beat(f"iteration {iteration}: generating batch {iteration}", force=True)
            gen_out = loop.batch_maker.make(iteration, loop.per_replica, False)
            if loop.cfg.generator.generate_while_waiting:
                ahead = time.perf_counter()
                loop.generator.generate_until(lambda: loop.job.store.check([trained_key]), iteration + 1)
                if gen_out is not None:
                    gen_out["time_generate"] += time.perf_counter() - ahead
        if loop.trainer is not None and pending is not None:
            loop.heartbeat.beat(f"iteration {iteration}: training step {iteration}", force=True)
            train_metrics = loop.trainer.step(pending["samples"])
        if loop.job.rank == loop.topo.executors["trainer"][0]:
            loop.job.store.set(trained_key, "1")  # the generators may stop generating ahead
        batch = loop.transfer_batch(iteration, gen_out) if make_batch else None
        return IterationWork(batch, train_metrics, pending)

    def carry(self, work: IterationWork, make_batch: bool, trainer_rank: bool) -> tuple:
        return (work.batch if trainer_rank else None), make_batch

    def before_final_eval(self, loop) -> None:
        loop.sync_weights()  # the last step's policy has not reached the generators yet


class SyncSchedule(Schedule):
    mode = "sync"
    verifies_sync = False

    def iterations(self, start: int, steps: int) -> range:
        return range(start, steps)

    def step_of(self, iteration: int) -> int:
        return iteration + 1

    def eval_iteration(self, step: int) -> int:
        return step

    def trains(self, has_pending: bool) -> bool:
        return True

    def syncs_after(self, iteration: int, steps: int, trains: bool) -> bool:
        return True

    def work(self, loop, iteration: int, make_batch: bool, pending: Optional[dict]) -> IterationWork:
        loop.heartbeat.beat(f"iteration {iteration}: generating batch {iteration}", force=True)
        gen_out = loop.batch_maker.make(iteration, loop.per_replica, True)
        batch = loop.transfer_batch(iteration, gen_out)
        train_metrics = None
        if loop.trainer is not None:
            loop.heartbeat.beat(f"iteration {iteration}: training step {iteration + 1}", force=True)
            train_metrics = loop.trainer.step(batch["samples"])
        return IterationWork(batch, train_metrics, batch)

    def carry(self, work: IterationWork, make_batch: bool, trainer_rank: bool) -> tuple:
        return None, False  # nothing waits between iterations


SCHEDULES = {"async": AsyncSchedule, "sync": SyncSchedule}


def make_schedule(mode: str) -> Schedule:
    """run.mode -> its schedule (config.py has already refused any other mode)."""
    return SCHEDULES[mode]()
