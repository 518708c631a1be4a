"""Forward-only passes through Megatron's own pipeline schedule.

``full_logits`` runs ``get_forward_backward_func()`` with ``forward_only=True``
so pipeline stages exchange activations exactly as in training, and returns the
logits gathered over TP (unpadded vocabulary) on the last pipeline stage.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from megarl.trainer.setup import run_schedule


def position_ids_for(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)


def full_logits(chunks: List[torch.nn.Module], tokens: torch.Tensor, vocab_size: int) -> Optional[torch.Tensor]:
    """Logits [batch, seq, vocab_size] on the last pipeline stage, None elsewhere.

    Every rank must pass the same ``tokens`` (one micro-batch).
    """
    positions = position_ids_for(tokens)

    def forward_step(data_iterator, model):
        output = model(tokens, positions, None)

        def collect(logits, non_loss_data=True):
            return gather_from_tensor_model_parallel_region(logits)[..., :vocab_size]

        return output, collect

    for chunk in chunks:
        chunk.eval()
    with torch.no_grad():
        collected = run_schedule(
            chunks,
            forward_step,
            [None],
            tokens.shape[1],
            tokens.shape[0],
            forward_only=True,
            collect_non_loss_data=True,
        )
    if not mpu.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return collected[0]
