"""Sampling a next token, and its log-probability under the distribution actually used.

temperature -> top-k -> top-p (nucleus) -> renormalise -> draw with the
sequence's own generator (seeded per request and sample index, so a sample
does not depend on what else is in the batch). The behaviour log-prob recorded
for AIPO is log of the drawn token's probability under that final,
renormalised distribution. Greedy (temperature 0) takes the argmax and records
its log-probability under the unscaled model distribution.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from megarl.generator.interface import SamplingParams


def _filtered_log_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    x = logits.float() / p.temperature
    if p.top_k and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always the top token)
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return torch.log_softmax(x, dim=-1)


def sample(logits: torch.Tensor, params: List[SamplingParams], generators: List[Optional[torch.Generator]]
           ) -> Tuple[List[int], List[float]]:
    """One token per row of ``logits`` [B, V]; returns (tokens, behaviour log-probs)."""
    tokens, logprobs = [], []
    greedy_logp = None
    for row, (p, g) in enumerate(zip(params, generators)):
        if p.temperature == 0:
            if greedy_logp is None:
                greedy_logp = torch.log_softmax(logits.float(), dim=-1)
            token = int(torch.argmax(logits[row]))
            tokens.append(token)
            logprobs.append(float(greedy_logp[row, token]))
            continue
        logp = _filtered_log_probs(logits[row], p)
        token = int(torch.multinomial(logp.exp(), 1, generator=g))
        tokens.append(token)
        logprobs.append(float(logp[token]))
    return tokens, logprobs
