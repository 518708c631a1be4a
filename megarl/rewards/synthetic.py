"""Rewards with no task behind them: ``synthetic_parity`` for system checks and tests, and
``synthetic_low_ids`` for the learning bench (below).

``synthetic_parity``: the fraction of the response's characters whose code point is even. It needs
no tokenizer, no answer and no math library, varies from sample to sample (so
group advantages are non-zero and the policy really changes between syncs),
and costs nothing: what `scripts/gpu_check.sh` and the SGLang loop tests need
to exercise training, weight sync and lag without a task. A model trained on
it learns nothing worth having.
"""

from __future__ import annotations

from megarl.rewards.registry import register_reward


@register_reward("synthetic_parity")
def synthetic_parity(response_text: str, answer: str = "", **meta) -> float:
    if not response_text:
        return 0.0
    return sum(ord(c) % 2 == 0 for c in response_text) / len(response_text)


LOW_ID_BOUND = 30  # a tenth of the tiny presets' 300-token vocabulary


@register_reward("synthetic_low_ids")
def synthetic_low_ids(response_text: str, answer: str = "", **meta) -> float:
    """For token-id runs (model.tokenizer: none, where the response text is its ids joined by spaces):
    the fraction of response tokens whose id is below ``LOW_ID_BOUND``. A random policy scores about
    0.1 and the best policy 1.0, every token moves it a little (so groups always have an advantage
    signal), and a tiny model climbs it within a minute on 2 CPU cores: the task of `megarl bench
    learning` (megarl/bench/learning.py), whose comparisons need many short runs, not a useful skill."""
    ids = response_text.split()
    if not ids:
        return 0.0
    try:
        return sum(int(t) < LOW_ID_BOUND for t in ids) / len(ids)
    except ValueError:
        raise ValueError("synthetic_low_ids: the response is not token ids; it is for model.tokenizer: none") from None
