"""The reward executor: decodes responses and scores them with the configured reward function.

Runs on each generator replica's first rank, right after its groups finish,
so scoring overlaps the trainer's step in async mode. Scoring goes through
megarl.rewards.scoring (a worker process with a per-sample timeout), so a
pathological answer costs at most ``reward.timeout_s``, never the loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List

from megarl.generator.interface import Completion
from megarl.rewards.registry import reward_spec
from megarl.rewards.scoring import score_batch
from megarl.rollout import Sample


@dataclass
class ScoredSamples:
    samples: List[Sample]  # the groups' samples in order, each with its reward
    time_reward: float  # seconds of scoring
    reward_timeouts: int  # samples scored 0 because their reward timed out or failed


class RewardExecutor:
    def __init__(self, cfg, tokenizer):
        self.fn = reward_spec(cfg.reward.function)  # resolves now: a bad name fails at start
        self.timeout_s = cfg.reward.timeout_s
        self.tokenizer = tokenizer

    def decode(self, c: Completion) -> str:
        if self.tokenizer is None:  # model.tokenizer: none -- the reward sees the ids as text
            return " ".join(map(str, c.output_ids))
        return self.tokenizer.decode(c.output_ids, skip_special_tokens=True)

    def score(self, groups: List[List[Completion]]) -> ScoredSamples:
        start = time.perf_counter()
        flat = [c for g in groups for c in g]
        texts = [self.decode(c) for c in flat]
        results = score_batch(texts, [c.meta["answer"] for c in flat], self.fn, self.timeout_s)
        samples: List[Sample] = []
        for c, text, res in zip(flat, texts, results):
            s = c.to_sample(reward=res.score)
            s.response_text, s.reward_reason = text, res.reason
            samples.append(s)
        return ScoredSamples(samples, time.perf_counter() - start, sum(r.reason != "ok" for r in results))
