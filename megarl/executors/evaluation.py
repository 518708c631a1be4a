"""One evaluation of held-out prompts through a generator backend, for both of its callers.

The in-training evaluation (executors/evaluator.py: each replica's share, decoded alongside the
training groups in flight) and `megarl eval` (megarl/evaluate.py: a checkpoint's engine alone)
build the same requests, read the answers back the same way, and sum and name the same metrics
here, so that on the same policy and prompts they agree answer for answer (held by
tests/multiprocess/test_eval_during_training.py):

    per prompt i    its greedy answer, and with ``samples`` = k > 1 k answers sampled at the
                    run's temperature and top_p, seeded by the prompt (``sampling_seed(seed,
                    EVAL_SEED_STRIDE * i)``): every evaluation of the same prompts -- at any step,
                    on any replica, or by `megarl eval` -- draws the same random numbers
    scored          by the reward executor, a failed reward as 0 (``on_error="zero"``)
    sums            what one replica posts (``eval_sums``); ``eval_metrics`` merges posts into
                    accuracy (greedy reward >= 1), greedy_reward_mean, reward_mean@k and pass@k
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence

from megarl.generator.interface import Completion, GenerationRequest, GeneratorBackend, SamplingParams

# a run's seeds: group g of the training stream draws with sampling_seed(seed, g) (group ids are
# step * 1000 + replica); evaluation prompt i with the key EVAL_SEED_STRIDE * i, a prime stride
EVAL_SEED_STRIDE = 104729

RunRequests = Callable[[List[GenerationRequest]], List[Completion]]


def sampling_seed(seed: int, key: int) -> int:
    """The seed of one request's samples (sample j draws with seed + j): run.seed and the request's key."""
    return (seed * 7919 + key) % (2**31)


@dataclass(frozen=True)
class EvalSettings:
    """How prompts are answered: in training data.eval_* and the rollout's sampling, in `megarl eval` its flags."""

    max_new_tokens: int
    samples: int  # k: sampled answers per prompt besides the greedy one (1: greedy alone)
    temperature: float
    top_p: float
    seed: int  # run.seed


def eval_requests(tag: str, prompts, settings: EvalSettings, stop_ids: Sequence[int]) -> List[GenerationRequest]:
    """Per prompt its greedy request, then (k > 1) one request of its k sampled answers; their group
    ids (-1 - 2i, -2 - 2i) are negative, which is how a generator tells them from training groups."""
    s, stops, requests = settings, tuple(stop_ids), []
    for i, prompt in enumerate(prompts):
        meta = {"answer": prompt.record.answer, **prompt.record.meta, "messages": prompt.record.messages}
        greedy = SamplingParams(temperature=0.0, max_new_tokens=s.max_new_tokens, stop_token_ids=stops)
        requests.append(
            GenerationRequest(f"eval{tag}-{i}", list(prompt.ids), greedy, n=1, group_id=-1 - 2 * i, meta=meta)
        )
        if s.samples > 1:
            sampled = SamplingParams(
                temperature=s.temperature,
                top_p=s.top_p,
                max_new_tokens=s.max_new_tokens,
                stop_token_ids=stops,
                seed=sampling_seed(s.seed, EVAL_SEED_STRIDE * i),
            )
            requests.append(
                GenerationRequest(
                    f"eval{tag}-{i}s", list(prompt.ids), sampled, n=s.samples, group_id=-2 - 2 * i, meta=meta
                )
            )
    return requests


def evaluate_prompts(
    run: RunRequests, tag: str, prompts, settings: EvalSettings, stop_ids: Sequence[int]
) -> List[List[Completion]]:
    """Per prompt, in order: its greedy answer, then its sampled ones by sample index. ``run``
    decodes the requests and returns every completion of them: ``run_alone(backend)``, or a
    generator executor's ``run_alongside`` (the training groups in flight go on)."""
    by_group: Dict[int, List[Completion]] = {}
    for c in run(eval_requests(tag, prompts, settings, stop_ids)):
        by_group.setdefault(c.group_id, []).append(c)
    return [
        by_group[-1 - 2 * i] + sorted(by_group.get(-2 - 2 * i, []), key=lambda c: c.sample_index)
        for i in range(len(prompts))
    ]


def run_alone(backend: GeneratorBackend) -> RunRequests:
    """Requests decoded by a backend that serves nothing else (`megarl eval`)."""

    def run(requests: List[GenerationRequest]) -> List[Completion]:
        backend.submit(requests)
        return backend.run_until_idle()

    return run


def eval_sums(rewards: Sequence[Sequence[float]]) -> dict:
    """One replica's sums over its prompts; ``rewards``: per prompt, the greedy answer's reward then
    the sampled ones' (added in that order, one after another)."""
    sums = {"n": len(rewards), "correct": 0, "greedy_reward": 0.0, "sampled_reward": 0.0, "pass": 0}
    for greedy, *sampled in rewards:
        sums["correct"] += greedy >= 1.0
        sums["greedy_reward"] += greedy
        for r in sampled:
            sums["sampled_reward"] += r
        sums["pass"] += any(r >= 1.0 for r in sampled)
    return sums


def eval_metrics(posts: Sequence[dict], samples: int, prefix: str = "") -> dict:
    """The metrics of one prompt set from its replicas' sums (``eval_sums``; a post's ``seconds``,
    where there, gives ``time_s``: the slowest replica's)."""
    n = sum(p["n"] for p in posts)
    out = {
        f"{prefix}n": n,
        f"{prefix}accuracy": sum(p["correct"] for p in posts) / n,
        f"{prefix}greedy_reward_mean": sum(p["greedy_reward"] for p in posts) / n,
    }
    if all("seconds" in p for p in posts):
        out[f"{prefix}time_s"] = max(p["seconds"] for p in posts)
    if samples > 1:
        out[f"{prefix}reward_mean@{samples}"] = sum(p["sampled_reward"] for p in posts) / (n * samples)
        out[f"{prefix}pass@{samples}"] = sum(p["pass"] for p in posts) / n
    return out
