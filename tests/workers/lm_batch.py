"""A fixed next-token-prediction batch and its Megatron forward step, shared by workers."""

from functools import partial

import torch

from megarl.models.vocab import mask_vocab_padding
from megarl.trainer.forward import position_ids_for

GLOBAL_BATCH, SEQ, MICRO_BATCH = 8, 16, 1


def fixed_batch(vocab_size: int, seed: int = 1234):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=g)
    # Sequences of different lengths, so per-token normalisation across
    # micro-batches and DP ranks is actually exercised.
    lengths = torch.tensor([SEQ - 2 * i for i in range(GLOBAL_BATCH)]).clamp(min=3)
    mask = (torch.arange(SEQ).unsqueeze(0) < lengths.unsqueeze(1)).float()
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), mask


def micro_batches(vocab_size: int, seed: int = 1234):
    """This DP rank's micro-batches of the global batch."""
    from megatron.core import parallel_state as mpu

    inputs, labels, mask = fixed_batch(vocab_size, seed)
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    per_rank = GLOBAL_BATCH // dp
    start = dp_rank * per_rank
    return [
        (inputs[i : i + MICRO_BATCH], labels[i : i + MICRO_BATCH], mask[i : i + MICRO_BATCH])
        for i in range(start, start + per_rank, MICRO_BATCH)
    ]


def make_forward_step(vocab_size: int):
    """Next-token cross entropy: Megatron's vocab-parallel CE over the unpadded vocabulary."""

    def forward_step(data_iterator, model):
        inputs, labels, mask = next(data_iterator)
        output = model(inputs, position_ids_for(inputs), None)
        return output, partial(loss_func, vocab_size, labels, mask)

    return forward_step


def loss_func(vocab_size, labels, mask, logits):
    """Called by the schedule on the last pipeline stage only."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    per_token_loss = vocab_parallel_cross_entropy(mask_vocab_padding(logits.float(), vocab_size), labels)
    loss_sum = (per_token_loss * mask).sum()
    count = mask.sum().to(torch.int)
    return loss_sum, count, {"lm loss": torch.stack([loss_sum.detach(), count.float()])}


def global_loss(losses) -> float:
    """Mean per-token loss of the step over the world, the same on every rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    total = torch.zeros(2)
    for item in losses:
        total += item["lm loss"]
    last = mpu.is_pipeline_last_stage(ignore_virtual=True)
    if last:
        dist.all_reduce(total, group=mpu.get_data_parallel_group())
    owner = last and mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_data_parallel_rank() == 0
    holder = total if owner else torch.zeros(2)
    dist.all_reduce(holder)
    return (holder[0] / holder[1]).item()


def parse_layout(name: str):
    """TPxPP[xVPP][eEP[tETP]]: e.g. 2x2, 1x2x2 (virtual pipeline 2), 2x1e2 (EP2), 2x1e2t1 (and ETP1)."""
    import dataclasses
    import re

    from megarl.runtime.distributed import world_dims

    match = re.fullmatch(r"([\dx]+)(?:e(\d+)(?:t(\d+))?)?", name)
    sizes = [int(x) for x in match.group(1).split("x")]
    dims = world_dims(sizes[0], sizes[1], sizes[2] if len(sizes) > 2 else 1)
    ep, etp = match.group(2), match.group(3)
    return dataclasses.replace(dims, ep=int(ep or 1), etp=None if etp is None else int(etp))
