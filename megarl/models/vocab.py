"""Megatron's padded vocabulary, seen from one tensor-parallel rank.

Megatron pads the vocabulary (to a multiple of 128 x TP) and its output layer
computes logits for the pad entries too. Those columns are not tokens: a
softmax over them would make log-probabilities (and so RL losses) depend on the
TP size the model happens to run at. Everything in megarl that normalises over
the vocabulary masks them first.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state as mpu


def local_vocab_range(shard_size: int) -> tuple:
    """[start, end) of the global vocabulary held by this TP rank."""
    start = mpu.get_tensor_model_parallel_rank() * shard_size
    return start, start + shard_size


def mask_vocab_padding(logits_shard: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Set the logits of pad entries of this rank's vocabulary shard to -inf."""
    start, end = local_vocab_range(logits_shard.shape[-1])
    if end <= vocab_size:
        return logits_shard
    is_pad = torch.arange(start, end, device=logits_shard.device) >= vocab_size
    return logits_shard.masked_fill(is_pad, float("-inf"))
