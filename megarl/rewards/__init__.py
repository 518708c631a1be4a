"""Reward functions (built-in ``math`` via math-verify, or user dotted paths) and batch scoring.

from megarl.rewards import score_batch
results = score_batch(responses, answers, "math", timeout_s=10.0)
rewards = [r.score for r in results]
"""

from megarl.rewards.math_verify_reward import boxed_format_reward, has_boxed_answer, math_reward  # registers built-ins
from megarl.rewards.registry import (
    RewardFn,
    register_reward,
    registered_rewards,
    resolve_reward,
    reward_spec,
)
from megarl.rewards.scoring import OK, TIMEOUT, RewardPool, RewardResult, close_pools, score_batch

__all__ = [
    "OK",
    "TIMEOUT",
    "RewardFn",
    "RewardPool",
    "RewardResult",
    "boxed_format_reward",
    "close_pools",
    "has_boxed_answer",
    "math_reward",
    "register_reward",
    "registered_rewards",
    "resolve_reward",
    "reward_spec",
    "score_batch",
]
