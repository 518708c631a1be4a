"""The loop's part of a checkpoint: where a resumed run continues, exactly.

A checkpoint holds, next to the weights, the distributed optimizer and the LR
schedule (executors/trainer.py):

    step             optimizer steps taken (= the policy version, unless steps were skipped)
    next_iteration   the controller's next loop iteration
    generators       per replica: its prompt stream's position, its group counter (group ids
                     seed the sampling, so the same group draws the same random numbers), and
                     the groups it had started but not handed over, to generate again first
    pending          async: the batch already generated, not yet trained on (its samples,
                     with versions and behaviour log-probs), trained first after a resume;
                     sync with trainer.updates_per_batch > 1: the batch's slices not trained yet
    train_seconds    seconds this run has spent in its training loop up to this checkpoint, over
                     all its launches (run.time_budget_min counts them; 0 in older checkpoints)

So a sync run resumed from step k is the run that never stopped: the same
prompts, samples, rewards and losses. An async run resumes with the same
pending batch and prompt order; the groups that were in flight continue from
scratch under the checkpoint's policy instead of from their partial sequences
(the engine's KV cache is not saved), so later samples can differ.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional

from megarl.loop.batch import Batch
from megarl.rollout import sample_from_dict


@dataclass
class ResumePoint:
    next_iteration: int = 0
    steps_done: int = 0
    generators: List[dict] = field(default_factory=list)  # by replica; empty: fresh streams
    has_pending: bool = False
    train_seconds: float = 0.0  # the training loop's seconds of the launches before (run.time_budget_min)


def resume_point(loop_state: dict) -> ResumePoint:
    """From a checkpoint's loop state ({} for a fresh run). Checkpoints from before exact
    resume hold only "step": the stream restarts and the step's batch is made again."""
    if not loop_state:
        return ResumePoint()
    step = int(loop_state.get("step", 0))
    return ResumePoint(
        next_iteration=int(loop_state.get("next_iteration", step)),
        steps_done=step,
        generators=list(loop_state.get("generators", [])),
        has_pending=loop_state.get("pending") is not None,
        train_seconds=float(loop_state.get("train_seconds", 0.0)),
    )


def generator_states(gathered: list, topology) -> List[dict]:
    """Every rank's gathered state (None but on each replica's first generator rank), by replica."""
    by_replica = {}
    for rank, state in enumerate(gathered):
        if state is not None:
            by_replica[topology.replica_of(rank)[0]] = state
    return [by_replica[r] for r in sorted(by_replica)]


def checkpoint_loop_state(
    step: int, next_iteration: int, generators: List[dict], pending: Optional[Batch], train_seconds: float = 0.0
) -> dict:
    return {
        "step": step,
        "next_iteration": next_iteration,
        "generators": generators,
        "pending": pending_to_state(pending) if pending is not None else None,
        "train_seconds": train_seconds,
    }


def pending_to_state(pending: Batch) -> dict:
    return dataclasses.asdict(pending)


def pending_from_state(state: Optional[dict]) -> Optional[Batch]:
    """The pending batch of a checkpoint (older checkpoints saved a dict with more keys: the ones
    Batch has are read, the rest were never used on resume)."""
    if state is None:
        return None
    known = {f.name for f in dataclasses.fields(Batch)} - {"samples"}
    return Batch(samples=[sample_from_dict(s) for s in state["samples"]], **{k: state[k] for k in known if k in state})
