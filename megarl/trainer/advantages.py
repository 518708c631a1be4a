"""Advantage estimators over groups of samples of the same prompt.

    group_mean   A_i = r_i - mean_j r_j                (GRPO's baseline; LlamaRL's AIPO)
    rloo         A_i = r_i - mean_{j != i} r_j         (leave-one-out, unbiased)

Optionally divided by the group's reward standard deviation (GRPO's
normalisation). A group of one sample gets advantage 0 under both: there is
nothing to compare it with.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Dict, List, Optional, Sequence

import torch

from megarl.errors import ConfigError
from megarl.rollout import Sample


def _group_mean(rewards: torch.Tensor) -> torch.Tensor:
    return rewards - rewards.mean()


def _rloo(rewards: torch.Tensor) -> torch.Tensor:
    n = rewards.numel()
    if n < 2:
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean()) * (n / (n - 1))


ESTIMATORS: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"group_mean": _group_mean, "rloo": _rloo}


def compute_advantages(
    samples: Sequence[Sample],
    estimator: str = "group_mean",
    normalize_std: bool = False,
    eps: float = 1e-6,
    rewards: Optional[Sequence[float]] = None,
) -> List[float]:
    """One advantage per sample, in the order given. ``rewards``: instead of each sample's own
    (the trainer's shaped rewards, e.g. with the overlong penalty)."""
    rewards_of = [float(s.reward) for s in samples] if rewards is None else [float(r) for r in rewards]
    if estimator not in ESTIMATORS:
        raise ConfigError(f"advantage estimator {estimator!r} is unknown; choose one of {sorted(ESTIMATORS)}")
    groups: Dict[int, List[int]] = defaultdict(list)
    for i, sample in enumerate(samples):
        groups[sample.group_id].append(i)
    advantages = [0.0] * len(samples)
    for members in groups.values():
        group = torch.tensor([rewards_of[i] for i in members], dtype=torch.float64)
        adv = ESTIMATORS[estimator](group)
        if normalize_std and group.numel() > 1:
            adv = adv / (group.std(unbiased=False) + eps)
        for i, a in zip(members, adv.tolist()):
            advantages[i] = a
    return advantages
