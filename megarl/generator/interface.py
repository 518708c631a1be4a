"""What every generator backend offers (the reference torch engine and SGLang alike).

Nothing above this interface knows which backend runs:

    backend.submit([GenerationRequest(...)])       prompts, sampling parameters, n samples each
    backend.step()                                 finished Completions (tokens, behaviour
                                                   log-probs, policy version of every token)
    backend.abort([request_id, ...])               drop those requests' samples; each comes back
                                                   from step() as a Completion with
                                                   finish_reason "abort"
    backend.update_weights(apply)                  between decode steps: ``apply()`` lands new
                                                   weights and returns their SyncStats; tokens
                                                   sampled afterwards carry ``stats.version``
    backend.release_sessions([session_id, ...])    a session's later requests will not come: drop
                                                   what the backend kept of it (the torch engine's
                                                   parked KV cache; SGLang's radix cache evicts
                                                   by itself)
    backend.stats()                                queue depth, running, tokens/s
    backend.close()                                release threads, servers, memory

The executor above (executors/generator.py) owns prompts, groups, admission
control and partial rollouts; a backend only generates.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

from megarl.errors import ConfigError
from megarl.rollout import Sample

if TYPE_CHECKING:
    # annotations only: the interface itself needs no torch (weight_sync.transport imports it)
    from megarl.weight_sync.transport import SyncStats

ABORTED = "abort"  # finish_reason of a sample stopped by GeneratorBackend.abort


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 256
    stop_token_ids: Tuple[int, ...] = ()
    seed: Optional[int] = None  # per request: sample i uses seed + i, independent of batching

    def validate(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"sampling.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: List[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    n: int = 1  # samples of this prompt (one group for the group baseline)
    group_id: int = 0
    meta: dict = field(default_factory=dict)
    # the turns of one episode: a backend may keep this request's KV cache when it finishes, for a
    # later request of the session whose prompt extends it (the torch engine parks the slot; SGLang's
    # radix cache finds any prefix without it). One sample per request (n = 1).
    session_id: Optional[str] = None


@dataclass
class Completion:
    request_id: str
    sample_index: int
    group_id: int
    prompt_ids: List[int]
    output_ids: List[int]
    logprobs: List[float]  # behaviour log-prob of each output token, as sampled
    versions: List[int]  # policy version that produced each output token
    finish_reason: str  # "stop" | "length" | "abort" (asked for by ``abort``: not a sample)
    meta: dict = field(default_factory=dict)
    # mixture-of-experts models: the experts each fed position was routed to, int16
    # [len(prompt_ids) + len(output_ids) - 1, num_layers, top_k] (-1 on dense layers), as SGLang's
    # --enable-return-routed-experts returns them from routed_experts_start_len = 0; None otherwise
    routed_experts: Optional[Any] = None
    # multi-turn episodes (environments/multi_turn.py): 1 on sampled ids, 0 on the ids the environment
    # inserted (their logprobs / versions are rollout.MASKED_LOGPROB / MASKED_VERSION); None: all sampled
    loss_mask: Optional[List[int]] = None
    episode: Optional[Any] = None  # rollout.EpisodeStats of a multi-turn sample
    # prompt ids whose keys and values came from a cache rather than this request's prefill
    # (SGLang's meta_info.cached_tokens; the torch engine's parked session)
    cached_tokens: int = 0

    def trained_versions(self) -> List[int]:
        """The policy versions of the tokens the loss trains on (what max_lag judges)."""
        if self.loss_mask is None:
            return self.versions
        return [v for v, m in zip(self.versions, self.loss_mask) if m]

    def version_spans(self) -> List[Tuple[int, int, int]]:
        """(version, first token, end) runs, e.g. [(0, 0, 17), (1, 17, 40)]."""
        spans: List[Tuple[int, int, int]] = []
        for i, v in enumerate(self.versions):
            if spans and spans[-1][0] == v:
                spans[-1] = (v, spans[-1][1], i + 1)
            else:
                spans.append((v, i, i + 1))
        return spans

    def to_sample(self, reward: float = 0.0) -> Sample:
        return Sample(
            list(self.prompt_ids),
            list(self.output_ids),
            list(self.logprobs),
            list(self.versions),
            reward=reward,
            group_id=self.group_id,
            finish_reason=self.finish_reason,
            answer=self.meta.get("answer"),
            routed_experts=self.routed_experts,
            loss_mask=list(self.loss_mask) if self.loss_mask is not None else [],
            episode=self.episode,
        )


class GeneratorBackend(abc.ABC):
    @abc.abstractmethod
    def submit(self, requests: List[GenerationRequest]) -> None: ...

    @abc.abstractmethod
    def step(self) -> List[Completion]:
        """Advance generation a little (one decode step for the torch engine); return what finished."""

    @abc.abstractmethod
    def abort(self, request_ids: Sequence[str]) -> None:
        """Stop every sample of these requests (queued or running); each is returned by a later
        ``step()`` as a Completion with finish_reason ``ABORTED`` and the tokens it had."""

    @abc.abstractmethod
    def update_weights(self, apply: Callable[[], "SyncStats"]) -> "SyncStats":
        """Between decode steps: ``apply()`` writes the new weights (a weight synchronizer's
        receiving end) and returns their SyncStats; tokens sampled afterwards carry
        ``stats.version`` -- the version that landed, never one set from outside."""

    @abc.abstractmethod
    def stats(self) -> Dict[str, float]: ...

    def release_sessions(self, session_ids: Sequence[str]) -> None:
        """These sessions' episodes ended: free what was kept for their next request (nothing by
        default; a cache that evicts by itself, as SGLang's radix cache does, needs no call)."""

    def close(self) -> None:
        """Release what the backend holds (threads, server processes); idempotent."""

    def run_until_idle(self, max_steps: int = 1_000_000) -> List[Completion]:
        done: List[Completion] = []
        for _ in range(max_steps):
            done += self.step()
            if not self.stats()["queue_depth"] and not self.stats()["running"]:
                break
        return done
