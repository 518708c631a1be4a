"""Sampling a next token, and its log-probability under the distribution actually used.

temperature -> top-k -> top-p (nucleus) -> renormalise -> draw with the
sequence's own generator (seeded per request and sample index, so a sample
does not depend on what else is in the batch). The behaviour log-prob recorded
for AIPO is log of the drawn token's probability under that final,
renormalised distribution. Greedy (temperature 0) takes the argmax and records
its log-probability under the unscaled model distribution.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

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
    """One token per row of ``logits`` [B, V]; returns (tokens, behaviour log-probs).

    Rows are batched where the math is row-wise anyway (greedy rows; rows with only a
    temperature), so a row's result does not depend on the others; each sampled row
    still draws with its own generator."""
    tokens, logprobs = [0] * len(params), [0.0] * len(params)
    plain: Dict[float, List[int]] = {}  # temperature -> rows with no top-k / top-p
    for row, p in enumerate(params):
        if p.temperature == 0 or not ((p.top_k and p.top_k < logits.shape[-1]) or p.top_p < 1.0):
            plain.setdefault(p.temperature, []).append(row)
            continue
        logp = _filtered_log_probs(logits[row], p)
        tokens[row] = int(torch.multinomial(logp.exp(), 1, generator=generators[row]))
        logprobs[row] = float(logp[tokens[row]])
    for temperature, rows in plain.items():
        x = logits[rows].float()
        if temperature == 0:
            chosen = torch.argmax(x, dim=-1)
            logp = torch.log_softmax(x, dim=-1)
        else:
            logp = torch.log_softmax(x / temperature, dim=-1)
            probs = logp.exp()
            chosen = torch.cat([torch.multinomial(probs[j], 1, generator=generators[row]) for j, row in enumerate(rows)])
        picked = logp.gather(1, chosen[:, None])[:, 0]
        for row, token, lp in zip(rows, chosen.tolist(), picked.tolist()):
            tokens[row], logprobs[row] = token, lp
    return tokens, logprobs
