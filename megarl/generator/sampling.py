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


def sample(
    logits: torch.Tensor, params: List[SamplingParams], generators: List[Optional[torch.Generator]]
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
        tokens[row] = int(draw(logp.exp()[None], [generators[row]])[0])
        logprobs[row] = float(logp[tokens[row]])
    for temperature, rows in plain.items():
        # every row (the common case: one request's settings): the logits themselves, no copy
        x = logits if len(rows) == logits.shape[0] else logits[rows]
        logp = torch.log_softmax(x.float() if temperature == 0 else x.float() / temperature, dim=-1)
        if temperature == 0:
            chosen = torch.argmax(x, dim=-1)
        else:
            chosen = draw(logp.exp(), [generators[row] for row in rows])
        picked = logp.gather(1, chosen[:, None])[:, 0]
        # one host read for the step: token ids are exact in float64, as float32 log-probs are
        chosen_host, picked_host = torch.stack((chosen.double(), picked.double())).tolist()
        for row, token, lp in zip(rows, chosen_host, picked_host):
            tokens[row], logprobs[row] = int(token), lp
    return tokens, logprobs


def draw(probs: torch.Tensor, generators: List[Optional[torch.Generator]]) -> torch.Tensor:
    """One index per row of ``probs`` [B, V] (rows need not sum to 1), drawn with probability
    proportional to its entry: the inverse of the row's cumulative distribution at one uniform
    number from the row's own generator (None: torch's default one).

    Why not ``torch.multinomial``: for one sample it draws an exponential for every entry of the
    row (the exponential-race trick): 49152 random numbers per token, ~1 ms a row on the CPU,
    more than a decode step's forward at batch 64. This draws one number per row."""
    cdf = probs.cumsum(dim=-1)
    # the generators live on the host (a GPU engine's too): B draws there, one copy to the device
    u = torch.cat([torch.rand(1, generator=g) for g in generators]).to(probs.device, non_blocking=True)
    chosen = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    # u * total rounded up to the total: the last entry with any mass, never a zero one -- chosen
    # on the device for every row (no host read of which rows need it)
    last_with_mass = probs.shape[-1] - 1 - torch.argmax((probs.flip(-1) != 0).to(torch.uint8), dim=-1)
    return torch.where(chosen >= probs.shape[-1], last_with_mass, chosen)
