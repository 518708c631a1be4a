"""When the loop generates, trains and syncs: run.mode's two schedules of the single controller.

    async   iteration i: generators make batch i  ||  trainer trains batch i-1 (the pending batch);
            steps + 1 iterations (iteration 0 only generates); weights of policy i go out after
            the trainer's step of iteration i, unless no batch follows
    sync    iteration i: generate batch i with policy i (drained: every sequence finishes under
            it), then train it; steps iterations; weights go out after every step

The controller (controller.py) runs one loop for both and never asks which mode it is in:
where they differ, it asks its Schedule, picked once by the wiring (wiring.py). A schedule
drives only what ``StepParts`` holds: this rank's trainer and batch maker (None where the
rank has none), the batch's transfer, and the signals between them.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Optional

from megarl.executors.generator import GeneratorExecutor
from megarl.executors.trainer import TrainerExecutor
from megarl.loop.batch import Batch, BatchMaker


class TrainerDone:
    """The trainer's first rank says when its step of an iteration is over; generator ranks that
    keep generating meanwhile ask (through the job's TCP store: no collective)."""

    def __init__(self, store, setter: bool):
        self.store, self.setter = store, setter

    @staticmethod
    def _key(iteration: int) -> str:
        return f"megarl/trained/{iteration}"

    def set(self, iteration: int) -> None:
        if self.setter:
            self.store.set(self._key(iteration), "1")

    def is_set(self, iteration: int) -> bool:
        return self.store.check([self._key(iteration)])


@dataclass
class StepParts:
    """What a schedule drives on this rank."""

    trainer: Optional[TrainerExecutor]  # trainer ranks
    batch_maker: Optional[BatchMaker]  # generator ranks
    generator: Optional[GeneratorExecutor]  # generator ranks (generating ahead)
    groups_per_replica: int  # each replica's share of a batch
    transfer: Callable[[int, Optional[Batch]], Optional[Batch]]  # rollouts GATHER + batch BROADCAST
    trainer_done: TrainerDone
    beat: Callable[[str], None]  # the heartbeat: what this rank does now
    sync_weights: Callable[[], float]


@dataclass
class IterationWork:
    batch: Optional[Batch]  # the batch made in this iteration (every trainer rank; None where none was made)
    train_metrics: Optional[dict]  # the trainer's step of this iteration (trainer ranks; None if it trained none)
    trained: Optional[Batch]  # the batch that step trained on


class Schedule(ABC):
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
    def work(self, parts: StepParts, iteration: int, make_batch: bool, pending: Optional[Batch]) -> IterationWork:
        """Generate, transfer and train (``pending``: the batch carried over)."""

    @abstractmethod
    def carry(self, work: IterationWork, make_batch: bool, trainer_rank: bool) -> tuple:
        """(pending, has_pending) for the next iteration: the batch it trains, saved with a checkpoint."""

    def before_final_eval(self, parts: StepParts) -> None:
        """Bring the last step's policy to the generators before the evaluation after the loop."""


class AsyncSchedule(Schedule):
    verifies_sync = True

    def __init__(self, generate_while_waiting: bool = True):
        # generator.generate_while_waiting: once its batch is ready, a replica keeps decoding for the
        # next one until the trainer's step ends
        self.generate_while_waiting = generate_while_waiting

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

    def work(self, parts: StepParts, iteration: int, make_batch: bool, pending: Optional[Batch]) -> IterationWork:
        share, train_metrics = None, None
        if parts.batch_maker is not None and make_batch:
            parts.beat(f"iteration {iteration}: generating batch {iteration}")
            share = parts.batch_maker.make(iteration, parts.groups_per_replica, False)
            if self.generate_while_waiting:
                ahead = time.perf_counter()
                parts.generator.generate_until(lambda: parts.trainer_done.is_set(iteration), iteration + 1)
                if share is not None:
                    share.time_generate += time.perf_counter() - ahead
        if parts.trainer is not None and pending is not None:
            parts.beat(f"iteration {iteration}: training step {iteration}")
            train_metrics = parts.trainer.step(pending.samples)
        parts.trainer_done.set(iteration)  # the generators may stop generating ahead
        batch = parts.transfer(iteration, share) if make_batch else None
        return IterationWork(batch, train_metrics, pending)

    def carry(self, work: IterationWork, make_batch: bool, trainer_rank: bool) -> tuple:
        return (work.batch if trainer_rank else None), make_batch

    def before_final_eval(self, parts: StepParts) -> None:
        parts.sync_weights()  # the last step's policy has not reached the generators yet


class SyncSchedule(Schedule):
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

    def work(self, parts: StepParts, iteration: int, make_batch: bool, pending: Optional[Batch]) -> IterationWork:
        parts.beat(f"iteration {iteration}: generating batch {iteration}")
        share = parts.batch_maker.make(iteration, parts.groups_per_replica, True)
        batch = parts.transfer(iteration, share)
        train_metrics = None
        if parts.trainer is not None:
            parts.beat(f"iteration {iteration}: training step {iteration + 1}")
            train_metrics = parts.trainer.step(batch.samples)
        return IterationWork(batch, train_metrics, batch)

    def carry(self, work: IterationWork, make_batch: bool, trainer_rank: bool) -> tuple:
        return None, False  # nothing waits between iterations
