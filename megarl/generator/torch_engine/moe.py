"""The engine's sparse MLP, routed on the device: no value goes to the host inside a layer.

The loop it replaces (``expert_loop``, kept for the tests and ``megarl bench moe-decode``) asked
``torch.nonzero`` for each local expert's tokens and sliced by the answer: per expert per layer a
host synchronisation and ~10 kernel launches, 32 x 8 of each per decode step of the qwen3-moe-mini
preset, and a GPU idle at every one. Here the token-expert pairs are sorted by expert once per
layer, each expert's rows found by a binary search in the sorted ids (``searchsorted``, on the
device: ``bincount`` would size its output from a host read of the largest id on CUDA), and both
expert matmuls are one grouped GEMM each over the sorted rows (``F.grouped_mm``: CUTLASS on sm90
and later in bf16, a C++ loop over the groups on CPU).

The same arithmetic as the loop, so the same floats: each expert multiplies the same rows in the
same order (ascending token, the stable sort's order), and each token's outputs are summed in
ascending expert id starting from zero, the order the loop's ``index_add_`` calls added them in.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F


def route(h: torch.Tensor, gate: torch.Tensor, top_k: int, renormalise: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE's router: softmax of the router logits in fp32, then the top k; the k weights
    renormalised to sum to 1 if the model says so. Returns (weights in h's dtype, expert ids), [T, k]."""
    probs = F.softmax(F.linear(h, gate).float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(h.dtype), experts


def apply_experts(
    h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, first: int
) -> torch.Tensor:
    """This rank's experts ``first .. first + E`` (stacked w13 [E, 2I, H] = [gate; up], w2 [E, H, I])
    applied to the tokens routed to them, SwiGLU, weighted and summed per token: [T, H]; tokens
    routed to no local expert get zeros (EP: another rank holds their experts)."""
    n_local, k = w13.shape[0], experts.shape[1]
    experts, rank = experts.sort(dim=-1)  # each token's experts ascending: the loop's summation order
    weights = weights.gather(1, rank)
    local = experts - first
    here = (local >= 0) & (local < n_local)
    # another rank's expert: a bucket after the last group, which grouped_mm does not multiply
    by_expert, order = torch.sort(torch.where(here, local, n_local).flatten(), stable=True)
    ends = torch.searchsorted(by_expert, torch.arange(n_local, device=h.device), right=True, out_int32=True)
    x = h.index_select(0, order // k)
    gate, up = F.grouped_mm(x, w13.transpose(1, 2), offs=ends).chunk(2, dim=-1)
    y = F.grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=ends) * weights.flatten()[order, None]
    # back to [token, expert rank]; rows past the last group were never written: masked, not multiplied
    pairs = torch.empty_like(y).index_copy_(0, order, y).view(len(h), k, -1)
    pairs = torch.where(here[..., None], pairs, 0)
    out = torch.zeros_like(h)
    for r in range(k):  # left to right, as the loop's index_add_ calls: the same roundings
        out += pairs[:, r]
    return out


def expert_loop(
    h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, first: int
) -> torch.Tensor:
    """The per-expert loop ``apply_experts`` replaced (a ``torch.nonzero`` and its host read per
    expert): the reference the tests compare with and ``megarl bench moe-decode`` times."""
    out = torch.zeros_like(h)
    for j in range(w13.shape[0]):
        rows, slot = torch.nonzero(experts == first + j, as_tuple=True)
        if rows.numel() == 0:
            continue
        gate, up = F.linear(h[rows], w13[j]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[j]) * weights[rows, slot, None]
        out.index_add_(0, rows, y)
    return out
