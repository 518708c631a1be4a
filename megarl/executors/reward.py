"""The reward executor: decodes responses and scores them with the configured reward function,
the remote reward service or the generative judge.

Runs on each generator replica's first rank, right after its groups finish,
so scoring overlaps the trainer's step in async mode. A function scores through
megarl.rewards.scoring (a worker process with a per-sample timeout), so a
pathological answer costs at most ``reward.timeout_s``, never the loop; a service
(``reward.url``, megarl.rewards.remote) is asked in batches with a timeout per request
and retries with backoff; a judge (``reward.judge.url``, megarl.rewards.judge) gets one chat
request per sample, ``reward.judge.concurrency`` at a time.

``reward.on_error`` says what a sample whose reward failed (timeout, error, service
down) becomes: ``zero`` scores it 0 and trains it (counted in ``reward_timeouts``);
``drop`` leaves its whole group out of the batch (counted in ``reward_dropped_groups``;
the batch maker generates more); ``fail`` ends the job with the reason, naming the
service's URL or the function.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import List

from megarl.errors import MegarlError
from megarl.generator.interface import Completion
from megarl.rewards.judge import DEFAULT_TEMPLATE, JudgeReward
from megarl.rewards.registry import reward_spec
from megarl.rewards.remote import RemoteReward
from megarl.rewards.scoring import OK, score_batch
from megarl.rollout import Sample


@dataclass
class ScoredSamples:
    samples: List[Sample]  # the groups' samples in order, each with its reward
    time_reward: float  # seconds of scoring
    reward_timeouts: int  # samples scored 0 because their reward timed out or failed (on_error zero)
    dropped_groups: int = 0  # groups left out because a sample's reward failed (on_error drop)


def final_turn_ids(output_ids: List[int], loss_mask) -> List[int]:
    """The ids generated after the last inserted (loss mask 0) id: an episode's final turn; all of a
    one-turn sample's."""
    if not loss_mask:
        return list(output_ids)
    last_inserted = max((i for i, m in enumerate(loss_mask) if not m), default=-1)
    return list(output_ids[last_inserted + 1 :])


class RewardExecutor:
    def __init__(self, cfg, tokenizer):
        w = cfg.reward
        self.on_error = w.on_error
        # the service or the judge: each scores (responses, answers, metas) -> RewardResults
        self.remote = None
        if w.url is not None:
            self.remote = RemoteReward(w.url, w.timeout_s, w.retries)
        elif w.judge.url is not None:
            j = w.judge
            template = Path(j.prompt_file).read_text() if j.prompt_file else DEFAULT_TEMPLATE
            self.remote = JudgeReward(j.url, j.model, template, j.score_pattern, j.max_tokens, j.temperature,
                                      j.concurrency, w.timeout_s, w.retries)  # fmt: skip
        # resolves now: a bad name fails at start
        self.fn = reward_spec(w.resolved_function) if self.remote is None else None
        self.timeout_s = w.timeout_s
        self.tokenizer = tokenizer
        self.final_turn = w.scored_text == "final_turn"

    def decode(self, c: Completion, scored: bool = False) -> str:
        """The response's text (what rollouts.jsonl records); ``scored``: the text the reward reads
        (with reward.scored_text: final_turn, the episode's final turn alone)."""
        ids = final_turn_ids(c.output_ids, c.loss_mask) if scored and self.final_turn else c.output_ids
        if self.tokenizer is None:  # model.tokenizer: none -- the reward sees the ids as text
            return " ".join(map(str, ids))
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def score(self, groups: List[List[Completion]], on_error: str = "") -> ScoredSamples:
        """``on_error``: this call's policy instead of reward.on_error (evaluation scores failures 0)."""
        on_error = on_error or self.on_error
        start = time.perf_counter()
        flat = [c for g in groups for c in g]
        texts = [self.decode(c) for c in flat]
        scored = [self.decode(c, scored=True) for c in flat] if self.final_turn else texts
        answers = [c.meta["answer"] for c in flat]
        if self.remote is not None:
            metas = [{k: v for k, v in c.meta.items() if k != "answer"} for c in flat]
            results = self.remote.score(scored, answers, metas)
        else:
            results = score_batch(scored, answers, self.fn, self.timeout_s)
        failed = [r.reason != OK for r in results]
        if on_error == "fail" and any(failed):
            reason = results[failed.index(True)].reason
            if isinstance(self.remote, JudgeReward):
                source = f"reward.judge.url {self.remote.url}"
            elif self.remote is not None:
                source = f"reward.url {self.remote.url}"
            else:
                source = f"reward.function {self.fn!r}"
            raise MegarlError(f"reward.on_error=fail: {source}: {sum(failed)} of {len(flat)} samples failed: {reason}")
        samples: List[Sample] = []
        for c, text, res in zip(flat, texts, results):
            s = c.to_sample(reward=res.score)
            s.response_text, s.reward_reason = text, res.reason
            samples.append(s)
        dropped = 0
        if on_error == "drop" and any(failed):
            kept, i = [], 0
            for g in groups:
                if any(failed[i : i + len(g)]):
                    dropped += 1
                else:
                    kept += samples[i : i + len(g)]
                i += len(g)
            samples = kept
        timeouts = sum(failed) if on_error == "zero" else 0
        return ScoredSamples(samples, time.perf_counter() - start, timeouts, dropped)
