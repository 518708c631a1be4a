"""A finished rollout sample, as the trainer receives it.

Produced by the generators (one per sampled completion), scored by the reward
executor, consumed by the trainer. Per-token fields are aligned with
``response_tokens``.

``loss_mask`` says which response tokens the loss trains on (1) and which it
leaves out (0): all ones for a single-turn completion; a multi-turn episode
marks the tokens its environment inserted (tool output, user turns, template
glue) 0. A masked token contributes nothing to any loss, aggregation, token
count or metric, so its behaviour log-prob and policy version are placeholders
(``MASKED_LOGPROB``, ``MASKED_VERSION``) that nothing reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

from megarl.errors import ConfigError

MASKED_LOGPROB = math.nan  # a masked token's behaviour log-prob: NaN, so a sum that read it would show
MASKED_VERSION = -1  # a masked token's policy version: older than any real one, so a check that read it would fail

# the response-length buckets of the lag metrics (executors/generator.py, executors/trainer.py): quarters
# of rollout.max_new_tokens, so a policy that excludes by length shows in the last ones
LENGTH_BUCKETS = ("len_q1", "len_q2", "len_q3", "len_q4")


def length_bucket(response_tokens: int, max_new_tokens: int) -> str:
    """len_q1: up to max_new_tokens / 4 response tokens, len_q2: up to 1/2, len_q3: up to 3/4,
    len_q4: longer (an episode's response, several turns long, may exceed max_new_tokens: len_q4)."""
    quarter = -(-4 * response_tokens // max_new_tokens)  # ceil(4 n / max_new_tokens)
    return LENGTH_BUCKETS[min(max(quarter, 1), len(LENGTH_BUCKETS)) - 1]


@dataclass(frozen=True)
class EpisodeStats:
    """A multi-turn sample's episode (megarl/environments): its turns, tool calls, the tool calls
    that failed, seconds its environment stepped, and why it ended (done | max_turns | length |
    max_context | env_timeout | env_error | aborted | history_edited); over its turns, the prompt
    ids the generator prefilled and those whose keys and values a cache kept (a parked session or
    SGLang's radix cache); the ids sampled in each turn, in order (each turn has its own
    rollout.max_new_tokens: the overlong penalty judges them one by one)."""

    turns: int
    tool_calls: int = 0
    tool_errors: int = 0
    env_seconds: float = 0.0
    finish: str = ""
    prefill_tokens: int = 0
    cached_tokens: int = 0
    turn_tokens: Tuple[int, ...] = ()  # empty in rollouts recorded before it was kept

    def __post_init__(self) -> None:
        # a tuple however it came (JSON gives a list), so episodes compare and hash alike
        object.__setattr__(self, "turn_tokens", tuple(int(n) for n in self.turn_tokens))


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
    # 1: a token the loss trains on; 0: left out (see the module doc). Empty: all ones.
    loss_mask: List[int] = field(default_factory=list)
    # why generation ended: "stop", "length" (cut by rollout.max_new_tokens), ...
    finish_reason: Optional[str] = None
    answer: Optional[str] = None  # the prompt's reference answer, as the reward saw it
    response_text: Optional[str] = None  # the response as the reward read it
    reward_reason: Optional[str] = None  # "ok", or why the reward scored 0 (timeout, error)
    # after a train step: log pi of each response token as the loss saw it (the other side of
    # each importance ratio); None for masked tokens and before training
    trainer_logprobs: Optional[List[Optional[float]]] = None
    # mixture-of-experts models: the experts the generator routed each position to, an int16 tensor
    # [len(self), num_layers, top_k] (-1 on dense layers; Completion.routed_experts); None: not
    # recorded. The trainer replays them (trainer.moe_enable_routing_replay, trainer/router_replay.py)
    routed_experts: Optional[Any] = None
    episode: Optional[EpisodeStats] = None  # multi-turn samples: their episode; None for one completion

    def __post_init__(self) -> None:
        if isinstance(self.episode, dict):  # read back from a checkpoint (dataclasses.asdict)
            self.episode = EpisodeStats(**self.episode)
        if not self.loss_mask:
            self.loss_mask = [1] * len(self.response_tokens)

    def __len__(self) -> int:
        """Model positions this sample occupies: all tokens but the last (no next token)."""
        return len(self.prompt_tokens) + len(self.response_tokens) - 1

    @property
    def trained_tokens(self) -> int:
        """Response tokens the loss trains on (loss_mask 1)."""
        return sum(self.loss_mask)

    def trained(self, values: Sequence) -> list:
        """The entries of a per-token list at the tokens the loss trains on."""
        return [v for v, m in zip(values, self.loss_mask) if m]

    def validate(self, index: int = 0) -> None:
        name = f"sample {index} (group {self.group_id})"
        if not self.prompt_tokens:
            raise ConfigError(f"{name}: prompt_tokens is empty")
        if not self.response_tokens:
            raise ConfigError(f"{name}: response_tokens is empty")
        n = len(self.response_tokens)
        for field_name in ("behaviour_logprobs", "policy_versions", "loss_mask"):
            if len(getattr(self, field_name)) != n:
                raise ConfigError(
                    f"{name}: {field_name} has {len(getattr(self, field_name))} entries for {n} response tokens"
                )
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ConfigError(f"{name}: loss_mask holds values other than 0 and 1")
        if self.routed_experts is not None and self.routed_experts.shape[0] != len(self):
            raise ConfigError(
                f"{name}: routed_experts has {self.routed_experts.shape[0]} positions for the {len(self)} the "
                f"trainer feeds (prompt + response - 1)"
            )


def sampled_turn_lengths(sample: Sample) -> List[int]:
    """The ids the policy sampled in each turn of ``sample``: its whole response for one completion;
    for an episode, each turn's (``EpisodeStats.turn_tokens``; in rollouts recorded before it was
    kept, the runs of trained ids of its loss mask, which merge two turns only where an environment
    inserted nothing between them)."""
    if sample.episode is None:
        return [len(sample.response_tokens)]
    if sample.episode.turn_tokens:
        return list(sample.episode.turn_tokens)
    runs, n = [], 0
    for m in sample.loss_mask + [0]:
        if m:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


def episode_metrics(samples: Sequence[Sample]) -> dict:
    """Per-step metrics of a batch's multi-turn samples (none when it has none): means per episode of
    turns, tool calls, failed tool calls and environment seconds; the fractions ended by
    rollout.max_turns, by a failed or timed-out environment step and by an edited history; the
    fraction of the turns' prompt ids that a cache kept."""
    episodes = [s.episode for s in samples if s.episode is not None]
    if not episodes:
        return {}
    n = len(episodes)
    cached = sum(e.cached_tokens for e in episodes)
    fed = cached + sum(e.prefill_tokens for e in episodes)
    return {
        "episode_turns": sum(e.turns for e in episodes) / n,
        "episode_tool_calls": sum(e.tool_calls for e in episodes) / n,
        "episode_tool_errors": sum(e.tool_errors for e in episodes) / n,
        "episode_env_s": sum(e.env_seconds for e in episodes) / n,
        "episode_turn_limit_frac": sum(e.finish == "max_turns" for e in episodes) / n,
        "episode_env_failed_frac": sum(e.finish in ("env_error", "env_timeout") for e in episodes) / n,
        # an agent behind the OpenAI endpoint that edited its earlier history: the trajectory ends there
        "episode_history_edited_frac": sum(e.finish == "history_edited" for e in episodes) / n,
        # the turns' prompt ids a cache kept, of all they held (0 with no cache reuse)
        "episode_prompt_cached_frac": cached / fed if fed else 0.0,
    }


def validate_samples(samples: Sequence[Sample]) -> None:
    if not samples:
        raise ConfigError("the batch holds no samples")
    for i, sample in enumerate(samples):
        sample.validate(i)


# Sample.meta of checkpoints and rollouts written before the fields were typed
_LEGACY_META_FIELDS = ("finish_reason", "answer", "response_text", "reward_reason", "trainer_logprobs")


def sample_from_dict(data: dict) -> Sample:
    """A Sample from ``dataclasses.asdict`` output, also that of older checkpoints (a free-form
    ``meta`` dict then held finish_reason, answer, ... ; other keys in it were never read)."""
    data = dict(data)
    meta = data.pop("meta", None) or {}
    for key in _LEGACY_META_FIELDS:
        if key in meta and key not in data:
            data[key] = meta[key]
    return Sample(**data)
