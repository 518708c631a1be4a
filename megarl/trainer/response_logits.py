"""Logits only where the loss reads them: the output layer on a micro-batch's trained positions.

The RL loss reads log pi at trained response positions only (loss mask 1: a masked response
token, like a prompt token, is context and nothing else), yet Megatron's GPTModel runs its output
layer over every position of the packed row, prompts included. That layer is the model's widest
GEMM ([tokens, hidden] x [hidden, vocab], three times with its gradients) and its logits are the
largest activation ([tokens, vocab/TP]; Llama 3's vocabulary is 128k); with RL prompts often
longer than their answers, most of it was thrown away (SmolLM2 on CPU, a demo-like batch with 62%
prompt positions: the output layer's GEMMs ~9% of a bf16 train step; steps 1.03x faster without
the prompts' share, 1.12x on `megarl bench train-step`'s batch). So for the duration of one
micro-batch's forward, a forward pre-hook on the output layer keeps only the hidden states of
the selected positions (hooks.trained_positions) -- the selection Megatron makes
itself before its output layer when inference materialises only the last token's logits
(GPTModel._postprocess). The output layer, its weight-gradient accumulation and the tied
embedding stay Megatron's own; the positions left out would only have received zero gradient.

Not with sequence parallelism: there the output layer's input is this rank's slice of the
sequence and the layer all-gathers it itself, so the rows are left as they are (the loss
selects from the full logits, as before).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


def _output_layer(model: torch.nn.Module):
    """The output layer of this model chunk, or None (not the last pipeline stage)."""
    while not hasattr(model, "output_layer") and hasattr(model, "module"):
        model = model.module  # DDP / Float16Module wrappers
    if not getattr(model, "post_process", False):
        return None
    return getattr(model, "output_layer", None)


@contextmanager
def logits_at(model: torch.nn.Module, rows: torch.Tensor) -> Iterator[bool]:
    """Within: the chunk's output layer computes logits for the positions where ``rows`` (a [seq] bool
    mask of the packed [seq, 1, hidden] row) is True, in order. Yields whether it does: False on a
    chunk without the output layer and with sequence parallelism (the logits then cover every
    position)."""
    layer = _output_layer(model)
    if layer is None or getattr(layer, "sequence_parallel", False):
        yield False
        return

    def keep_rows(_module, args, kwargs):
        hidden = args[0]
        if hidden.dim() != 3 or hidden.shape[1] != 1 or hidden.shape[0] != rows.numel():
            raise ValueError(
                f"the output layer's input is {tuple(hidden.shape)}; the trained-position selection expects "
                f"one packed row of {rows.numel()} positions, [seq, 1, hidden]"
            )
        return (hidden[rows],) + tuple(args[1:]), kwargs

    handle = layer.register_forward_pre_hook(keep_rows, with_kwargs=True)
    try:
        yield True
    finally:
        handle.remove()
