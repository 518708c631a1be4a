"""Multi-turn episodes, token in and token out.

A :class:`Trajectory` is the episode's prompt followed by segments: *generated* ones (the exact
ids the sampler produced, with their behaviour log-probs and per-token policy versions; loss
mask 1) and *environment* ones (ids the environment inserted: tool results, user turns, chat
template glue; loss mask 0). Nothing is ever re-encoded: each turn's context is the previous
context plus the new ids, so the trainer sees exactly the ids that were sampled and inserted and
the importance ratio compares the behaviour log-prob of the very token the trainer scores.

An :class:`Environment` is token-native: ``reset(episode)`` may insert ids before the first turn
(or set the episode's ``prompt_ids``, as an agent with its own system prompt does), ``step(turn)``
gets the turn's sampled ids (and their text, decoded once, for parsing tool calls) and returns the
ids to insert, a reward and whether the episode is done. Both run in the environment pool; an
optional ``close()`` is called when the episode ends, however it ends.

:class:`EpisodeRunner` drives many episodes at once on any ``GeneratorBackend``: each turn is a
``GenerationRequest`` of the episode's session whose prompt is the whole context so far (SGLang's
radix cache reuses the prefix; megarl's torch engine keeps the session's slot parked and prefills
only the new ids, multi_turn.py states the policy), environment steps
run in a bounded thread pool beside generation with a timeout, and in-flight weight updates may
land between or within turns (the versions travel with every token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Protocol

from megarl.errors import ConfigError, MegarlError
from megarl.generator.interface import Completion, GenerationRequest, GeneratorBackend, SamplingParams
from megarl.rollout import MASKED_LOGPROB, MASKED_VERSION, EpisodeStats, Sample

GENERATED, INSERTED = "generated", "environment"
# Sample.finish_reason of an episode's end: "length" where the last turn was cut by a token limit
# (trainer.overlong treats it as DAPO does a truncated completion), "stop" otherwise; the episode's
# own reason is in Sample.episode.finish
FINISH_REASONS = {"length": "length", "max_context": "length"}


@dataclass
class Segment:
    kind: str  # GENERATED | INSERTED
    token_ids: List[int]
    logprobs: List[float] = field(default_factory=list)  # generated: log mu of each token as sampled
    versions: List[int] = field(default_factory=list)  # generated: the policy version of each token


@dataclass
class Trajectory:
    episode_id: str
    prompt_ids: List[int]
    segments: List[Segment] = field(default_factory=list)
    group_id: int = 0
    reward: float = 0.0
    # done | max_turns | length | max_context | aborted | env_error | env_timeout | history_edited
    finish: Optional[str] = None
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    env_seconds: float = 0.0
    prefill_tokens: int = 0  # the turns' prompt ids the generator prefilled
    cached_tokens: int = 0  # and those a cache kept (Completion.cached_tokens)
    meta: dict = field(default_factory=dict)

    def context(self) -> List[int]:
        """Every id so far: the prompt, then each segment's ids as they were sampled or inserted."""
        ids = list(self.prompt_ids)
        for s in self.segments:
            ids += s.token_ids
        return ids

    def add_generated(self, completion: Completion) -> None:
        if completion.prompt_ids != self.context():
            # a backend that re-encoded or trimmed the context would break every importance ratio
            raise MegarlError(
                f"episode {self.episode_id}: the turn was generated from a context other than the "
                f"episode's ({len(completion.prompt_ids)} ids vs {len(self.context())})"
            )
        n = len(completion.output_ids)
        if len(completion.logprobs) != n or len(completion.versions) != n:
            raise MegarlError(f"episode {self.episode_id}: a turn of {n} tokens came with other log-prob counts")
        self.segments.append(
            Segment(GENERATED, list(completion.output_ids), list(completion.logprobs), list(completion.versions))
        )
        self.cached_tokens += completion.cached_tokens
        self.prefill_tokens += len(completion.prompt_ids) - completion.cached_tokens

    def add_inserted(self, ids: List[int]) -> None:
        if ids:
            self.segments.append(Segment(INSERTED, [int(i) for i in ids]))

    @property
    def oldest_version(self) -> Optional[int]:
        """The policy version of the oldest trained token: what max_lag judges the episode by."""
        versions = [v for s in self.segments if s.kind == GENERATED for v in s.versions]
        return min(versions) if versions else None

    def to_sample(self) -> Sample:
        """The trainer's sample: response = every segment in order, environment ids masked out."""
        response, logprobs, versions, mask = [], [], [], []
        for s in self.segments:
            response += s.token_ids
            if s.kind == GENERATED:
                logprobs += s.logprobs
                versions += s.versions
                mask += [1] * len(s.token_ids)
            else:
                logprobs += [MASKED_LOGPROB] * len(s.token_ids)
                versions += [MASKED_VERSION] * len(s.token_ids)
                mask += [0] * len(s.token_ids)
        return Sample(
            prompt_tokens=list(self.prompt_ids),
            response_tokens=response,
            behaviour_logprobs=logprobs,
            policy_versions=versions,
            reward=self.reward,
            group_id=self.group_id,
            loss_mask=mask,
            finish_reason=FINISH_REASONS.get(self.finish, "stop"),
            episode=self.stats(),
        )

    def stats(self) -> EpisodeStats:
        return EpisodeStats(
            self.turns,
            self.tool_calls,
            self.tool_errors,
            self.env_seconds,
            self.finish or "",
            self.prefill_tokens,
            self.cached_tokens,
            tuple(len(s.token_ids) for s in self.segments if s.kind == GENERATED),
        )


@dataclass(frozen=True)
class Turn:
    """What the environment sees of one generated turn."""

    token_ids: List[int]  # exactly as sampled
    text: str  # the same ids decoded once (for parsing tool calls; never encoded back)
    finish_reason: str  # "stop" | "length"


@dataclass
class StepResult:
    insert_ids: List[int] = field(default_factory=list)  # appended to the context, loss mask 0
    reward: float = 0.0  # the episode's reward when done (intermediate rewards are summed)
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0
    finish: str = "done"  # why a done episode ended (an agent's edited history: "history_edited")
    max_new_tokens: Optional[int] = None  # the next turn's limit, below the rollout's (an agent's max_tokens)


class Environment(Protocol):
    def reset(self, trajectory: Trajectory) -> List[int]:
        """Ids to insert before the first turn (often none: the prompt is the first observation).
        Runs in the environment pool, under ``rollout.env_timeout_s`` like a step; it may replace
        ``trajectory.prompt_ids`` (nothing else has been generated yet)."""

    def step(self, turn: Turn) -> StepResult: ...


@dataclass
class EpisodeSettings:
    max_turns: int = 4
    max_context: int = 4096  # prompt + every segment; past it the episode ends (finish "max_context")
    env_timeout_s: float = 60.0  # one environment step; past it the episode ends (finish "env_timeout")
    env_workers: int = 4  # environment steps in flight beside generation

    def validate(self) -> None:
        for name in ("max_turns", "max_context", "env_workers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"rollout.{name}: must be >= 1, got {getattr(self, name)}")
        if self.env_timeout_s <= 0:
            raise ConfigError(f"rollout.env_timeout_s: must be > 0, got {self.env_timeout_s}")


class EpisodeRunner:
    """Runs episodes to their end on ``backend``: ``run(prompts)`` -> finished trajectories (the
    loop's generator executor uses :class:`megarl.environments.multi_turn.MultiTurnBackend`, this
    on top of it, directly). ``make_env(episode_index)`` builds each episode's environment;
    ``decode(ids)`` turns a turn's ids into text for the environment."""

    def __init__(
        self,
        backend: GeneratorBackend,
        make_env: Callable[[int], Environment],
        decode: Callable[[List[int]], str],
        params: SamplingParams,
        settings: EpisodeSettings = EpisodeSettings(),
    ):
        from megarl.environments.multi_turn import MultiTurnBackend

        self.params = params
        self.episodes = MultiTurnBackend(backend, make_env, decode, settings, keep_trajectories=True)

    @property
    def counters(self) -> Dict[str, int]:
        return self.episodes.counters

    def run(self, prompts: List[List[int]]) -> List[Trajectory]:
        requests = [GenerationRequest(f"p{i}", list(p), self.params, group_id=i) for i, p in enumerate(prompts)]
        self.episodes.submit(requests)
        done = self.episodes.run_until_idle()
        return [self.episodes.trajectory_of(c) for c in done]
