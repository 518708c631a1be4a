"""One replica's share of a batch: generate, score, and (rollout.filter_groups) keep only informative groups.

Dynamic sampling (DAPO): a group whose samples all got the same reward has zero
advantage under the group baseline -- it costs a trainer pass and teaches
nothing. With ``rollout.filter_groups`` such groups are not handed to the trainer;
the replica generates more groups until its share is full, through the same
admission control as any group (async: still within ``rollout.max_lag``). The
counts of filtered groups and of the extra samples they cost go to the metrics.

Only the replica's first rank scores; with a torch engine over TP ranks the
others follow its decision on how many groups are still missing (a broadcast
over the replica's TP group), so every rank runs the same engine steps.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

MAX_ROUNDS = 64  # a share that stays uniform this many rounds means a reward that never varies


class BatchMaker:
    def __init__(self, generator, reward, filter_groups: bool, samples_per_prompt: int, tp_group=None):
        self.generator, self.reward = generator, reward
        self.filter, self.n = filter_groups, samples_per_prompt
        self.tp_group = tp_group

    def make(self, train_version: int, n_groups: int, drain: bool) -> Optional[dict]:
        kept: List = []
        merged: Optional[dict] = None
        filtered = extra_samples = 0
        missing = n_groups
        for _ in range(MAX_ROUNDS):
            out = self.generator.generate(train_version, missing, drain)
            if self.reward is not None:
                scored = self.reward.score(out.pop("groups"))
                groups = [scored["samples"][i : i + self.n] for i in range(0, len(scored["samples"]), self.n)]
                informative = [g for g in groups if not self.filter or len({s.reward for s in g}) > 1]
                filtered += len(groups) - len(informative)
                if merged is not None:
                    extra_samples += len(groups) * self.n
                kept += informative
                merged = self._accumulate(merged, out, scored)
            missing = self._broadcast(n_groups - len(kept) if self.reward is not None else 0)
            if missing == 0:
                break
        else:
            from megarl.errors import MegarlError

            raise MegarlError(
                f"rollout.filter_groups: after {MAX_ROUNDS} rounds every new group still had one reward "
                f"for all its samples; the reward does not vary (turn filter_groups off?)"
            )
        if self.reward is None:
            return None
        merged["samples"] = [s for g in kept for s in g]
        merged.update(filtered_groups=filtered, filter_extra_samples=extra_samples)
        return merged

    @staticmethod
    def _accumulate(merged: Optional[dict], out: dict, scored: dict) -> dict:
        if merged is None:
            return {**out, **{k: v for k, v in scored.items() if k != "samples"}}
        merged["time_generate"] += out["time_generate"]
        merged["time_reward"] += scored["time_reward"]
        merged["reward_timeouts"] += scored["reward_timeouts"]
        for key in ("stale_dropped", "stale_aborted", "in_flight", "engine_version"):
            merged[key] = out[key]  # running totals / the latest state
        return merged

    def _broadcast(self, missing: int) -> int:
        if self.tp_group is None:
            return max(missing, 0)
        box = torch.tensor([max(missing, 0)])
        dist.broadcast(box, group=self.tp_group, group_src=0)
        return int(box.item())
