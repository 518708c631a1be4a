"""When the loop generates, trains and syncs: run.mode's two schedules of the single controller.

    async   iteration i: generators make batch i  ||  trainer trains batch i-1 (the pending batch);
            steps + 1 iterations (iteration 0 only generates); weights of policy i go out after
            the trainer's step of iteration i, unless no batch follows
            (generator.inflight_updates=false: first every sequence in flight runs to its end)
    sync    iteration i: generate batch i with policy i (drained: every sequence finishes under
            it), then train it; steps iterations; weights go out after every step. With
            trainer.updates_per_batch = G, every G-th iteration generates G batches' prompts at
            once and the G iterations train its slices in turn (PipelineRL's baseline: slice k
            is k versions old); the slices not trained yet are the pending batch

The controller (controller.py) runs one loop for both and never asks which mode it is in:
where they differ, it asks its Schedule, picked once by the wiring (wiring.py). A schedule
drives only what ``StepParts`` holds: this rank's trainer and batch maker (None where the
rank has none), the batch's transfer, and the signals between them.
"""

from __future__ import annotations

import dataclasses
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
    rest: Optional[Batch] = None  # sync, trainer.updates_per_batch > 1: the slices still to train


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

    def before_sync(self, parts: StepParts) -> None:
        """What the generators do before new weights land (on every rank, before the sync collective)."""


class AsyncSchedule(Schedule):
    verifies_sync = True

    def __init__(self, generate_while_waiting: bool = True, inflight_updates: bool = True):
        # generator.generate_while_waiting: once its batch is ready, a replica keeps decoding for the
        # next one until the trainer's step ends
        self.generate_while_waiting = generate_while_waiting
        # generator.inflight_updates=false: no sequence sees two policies (before_sync drains them)
        self.inflight_updates = inflight_updates

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
        self.before_sync(parts)
        parts.sync_weights()  # the last step's policy has not reached the generators yet

    def before_sync(self, parts: StepParts) -> None:
        if not self.inflight_updates and parts.generator is not None:
            parts.beat("finishing the sequences in flight before the weight update")
            parts.generator.finish_in_flight()


class SyncSchedule(Schedule):
    verifies_sync = False

    def __init__(self, updates_per_batch: int = 1, samples_per_step: int = 0):
        self.updates_per_batch = updates_per_batch  # trainer.updates_per_batch (G)
        self.samples_per_step = samples_per_step  # rollout.prompts_per_step x samples_per_prompt

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
        generated = None
        if pending is None or not pending.samples:  # a new batch of updates_per_batch slices
            parts.beat(f"iteration {iteration}: generating batch {iteration}")
            share = parts.batch_maker.make(iteration, parts.groups_per_replica * self.updates_per_batch, True)
            generated = parts.transfer(iteration, share)
            pending = generated
        batch, rest = self._slice(pending) if parts.trainer is not None else (None, None)
        train_metrics = None
        if parts.trainer is not None:
            parts.beat(f"iteration {iteration}: training step {iteration + 1}")
            train_metrics = parts.trainer.step(batch.samples)
            if generated is None:  # this slice's generation was counted with the first slice
                batch = dataclasses.replace(batch, time_generate=0.0, time_reward=0.0)
        return IterationWork(batch, train_metrics, batch, rest)

    def _slice(self, pending: Batch) -> tuple:
        """The next step's slice (its first samples_per_step samples: whole groups, in group order)
        and the rest. A batch short of groups (reward.on_error=drop) has a short last slice."""
        if self.updates_per_batch == 1:
            return pending, None
        n = self.samples_per_step
        return (
            dataclasses.replace(pending, samples=pending.samples[:n]),
            dataclasses.replace(pending, samples=pending.samples[n:]),
        )

    def carry(self, work: IterationWork, make_batch: bool, trainer_rank: bool) -> tuple:
        if work.rest is None or not work.rest.samples:
            return None, False  # nothing waits between iterations
        return work.rest, True
