"""A training batch: its samples and what making it cost; and how one replica makes its share.

``Batch`` is what travels from the generator replicas to the trainer (the rollouts GATHER
and batch BROADCAST channels) and what a checkpoint keeps as the pending batch of an
asynchronous run: the samples in replica order and the counters the metrics report.
``Batch.merge`` joins the replicas' shares into one.

``BatchMaker.make`` is one replica's share: generate, score, and (rollout.filter_groups)
keep only informative groups. Dynamic sampling (DAPO): a group whose samples all got the
same reward has zero advantage under the group baseline -- it costs a trainer pass and
teaches nothing. With ``rollout.filter_groups`` such groups are not handed to the trainer;
the replica generates more groups until its share is full, through the same admission
control as any group (async: still within ``rollout.max_lag``). The counts of filtered
groups and of the extra samples they cost go to the metrics.

Only the replica's first rank scores; with a torch engine over TP ranks the others follow
its decision on how many groups are still missing (a broadcast over the replica's TP group),
so every rank runs the same engine steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megarl.errors import MegarlError
from megarl.executors.generator import GeneratedGroups, GeneratorExecutor, empty_lag_counts
from megarl.executors.reward import RewardExecutor, ScoredSamples
from megarl.rollout import Sample

MAX_ROUNDS = 64  # a share that stays uniform this many rounds means a reward that never varies


@dataclass
class Batch:
    samples: List[Sample] = field(default_factory=list)
    time_generate: float = 0.0  # seconds the replicas generated (the slowest's, once merged)
    time_reward: float = 0.0  # seconds they scored (the slowest's)
    stale_dropped: int = 0  # groups dropped as past rollout.max_lag (max_lag_policy=drop; running total)
    reward_timeouts: int = 0  # samples whose reward timed out or failed, scored 0 (reward.on_error zero)
    reward_dropped_groups: int = 0  # groups left out because a reward failed (reward.on_error drop)
    filtered_groups: int = 0  # rollout.filter_groups: groups of one reward not trained ...
    filter_extra_samples: int = 0  # ... and the samples refilling them cost
    in_flight: int = 0  # samples still in the generators when the batch was handed over
    # what the lag bound cost while the batch was made (executors/generator.py's LAG_COUNT_KEYS)
    lag_counts: Dict[str, int] = field(default_factory=empty_lag_counts)

    @property
    def generated_tokens(self) -> int:
        return sum(len(s.response_tokens) for s in self.samples)

    @classmethod
    def merge(cls, parts: Sequence["Batch"]) -> "Batch":
        """The replicas' shares -> one batch: samples in replica order, the slowest replica's
        times (they ran concurrently), counters summed."""
        return cls(
            samples=[s for p in parts for s in p.samples],
            time_generate=max(p.time_generate for p in parts),
            time_reward=max(p.time_reward for p in parts),
            stale_dropped=sum(p.stale_dropped for p in parts),
            reward_timeouts=sum(p.reward_timeouts for p in parts),
            reward_dropped_groups=sum(p.reward_dropped_groups for p in parts),
            filtered_groups=sum(p.filtered_groups for p in parts),
            filter_extra_samples=sum(p.filter_extra_samples for p in parts),
            in_flight=sum(p.in_flight for p in parts),
            lag_counts={k: sum(p.lag_counts.get(k, 0) for p in parts) for k in empty_lag_counts()},
        )


class BatchMaker:
    def __init__(
        self,
        generator: GeneratorExecutor,
        reward: Optional[RewardExecutor],
        filter_groups: bool,
        samples_per_prompt: int,
        tp_group=None,
    ):
        self.generator, self.reward = generator, reward
        self.filter, self.n = filter_groups, samples_per_prompt
        self.tp_group = tp_group

    def make(self, train_version: int, n_groups: int, drain: bool) -> Optional[Batch]:
        """This replica's ``n_groups`` groups (None on ranks that do not score: TP ranks > 0)."""
        kept: List[List[Sample]] = []
        batch: Optional[Batch] = None
        missing = n_groups
        for _ in range(MAX_ROUNDS):
            out = self.generator.generate(train_version, missing, drain)
            if self.reward is not None:
                scored = self.reward.score(out.groups)
                groups = [scored.samples[i : i + self.n] for i in range(0, len(scored.samples), self.n)]
                informative = [g for g in groups if not self.filter or len({s.reward for s in g}) > 1]
                extra = len(groups) * self.n if batch is not None else 0
                batch = self._accumulate(batch, out, scored)
                batch.filtered_groups += len(groups) - len(informative)
                batch.reward_dropped_groups += scored.dropped_groups
                batch.filter_extra_samples += extra
                kept += informative
            missing = self._broadcast(n_groups - len(kept) if self.reward is not None else 0)
            if missing == 0:
                break
        else:
            if batch is not None and batch.reward_dropped_groups:
                raise MegarlError(
                    f"reward.on_error=drop: after {MAX_ROUNDS} rounds groups still failed their reward "
                    f"({batch.reward_dropped_groups} dropped); is the reward service or function working?"
                )
            raise MegarlError(
                f"rollout.filter_groups: after {MAX_ROUNDS} rounds every new group still had one reward "
                f"for all its samples; the reward does not vary (turn filter_groups off?)"
            )
        if batch is None:
            return None
        batch.samples = [s for g in kept for s in g]
        return batch

    @staticmethod
    def _accumulate(batch: Optional[Batch], out: GeneratedGroups, scored: ScoredSamples) -> Batch:
        if batch is None:
            batch = Batch()
        batch.time_generate += out.time_generate
        batch.time_reward += scored.time_reward
        batch.reward_timeouts += scored.reward_timeouts
        # the replica's running total and latest state; the lag counts of every round (since the last hand-over)
        batch.stale_dropped, batch.in_flight = out.stale_dropped, out.in_flight
        for key, count in out.lag_counts.items():
            batch.lag_counts[key] += count
        return batch

    def _broadcast(self, missing: int) -> int:
        if self.tp_group is None:
            return max(missing, 0)
        box = torch.tensor([max(missing, 0)])
        dist.broadcast(box, group=self.tp_group, group_src=0)
        return int(box.item())
