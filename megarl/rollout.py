"""A finished rollout sample, as the trainer receives it.

Produced by the generators (one per sampled completion), scored by the reward
executor, consumed by the trainer. Per-token fields are aligned with
``response_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Sequence

from megarl.errors import ConfigError


@dataclass
class Sample:
    prompt_tokens: List[int]
    response_tokens: List[int]
    # log mu(token): the behaviour policy's log-prob of each response token, under
    # the sampling distribution actually used (temperature applied). Never recomputed.
    behaviour_logprobs: List[float]
    # The policy version that produced each response token (in-flight weight
    # updates can change it in the middle of a sequence).
    policy_versions: List[int]
    reward: float = 0.0
    # Samples of the same prompt share a group id (the group baseline's group).
    group_id: int = 0
    # Free-form: the generator's "finish_reason" ("length": cut by max_new_tokens), the reward's
    # "answer"/"reward_reason", and after a train step the trainer's "trainer_logprobs" (log pi
    # of each response token as the loss saw it; the other side of each importance ratio).
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        """Model positions this sample occupies: all tokens but the last (no next token)."""
        return len(self.prompt_tokens) + len(self.response_tokens) - 1

    def validate(self, index: int = 0) -> None:
        name = f"sample {index} (group {self.group_id})"
        if not self.prompt_tokens:
            raise ConfigError(f"{name}: prompt_tokens is empty")
        if not self.response_tokens:
            raise ConfigError(f"{name}: response_tokens is empty")
        n = len(self.response_tokens)
        for field_name in ("behaviour_logprobs", "policy_versions"):
            if len(getattr(self, field_name)) != n:
                raise ConfigError(
                    f"{name}: {field_name} has {len(getattr(self, field_name))} entries for {n} response tokens"
                )


def validate_samples(samples: Sequence[Sample]) -> None:
    if not samples:
        raise ConfigError("the batch holds no samples")
    for i, sample in enumerate(samples):
        sample.validate(i)
