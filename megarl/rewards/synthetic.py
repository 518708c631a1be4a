"""``synthetic_parity``: a reward with no task behind it, for system checks and tests.

The fraction of the response's characters whose code point is even. It needs
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
