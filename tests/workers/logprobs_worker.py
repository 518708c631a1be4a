"""Rank body for the TP2 log-prob test: each rank holds half of the vocabulary.

    torchrun --nproc-per-node 2 tests/workers/logprobs_worker.py --case FILE --out DIR

FILE holds full logits [T, V_padded], targets, temperature, vocabulary size and
upstream gradients; rank r writes its log-probs, entropy and logits gradient shard.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megarl.runtime.distributed import init_distributed, init_megatron, shutdown, world_dims  # noqa: E402
from megarl.trainer.logprobs import vocab_parallel_logprobs  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--case", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rank = init_distributed()
    tp = dist.get_world_size()
    init_megatron(world_dims(tp, 1))
    case = torch.load(args.case)
    full = case["logits"]
    shard = full.shape[-1] // tp
    mine = full[..., rank * shard : (rank + 1) * shard].clone().requires_grad_(True)
    logp, entropy = vocab_parallel_logprobs(
        mine, case["targets"], case["vocab_size"], case["temperature"], with_entropy=True, chunk_tokens=5
    )
    (logp * case["w_logp"] + entropy * case["w_entropy"]).sum().backward()
    torch.save(
        {"logp": logp.detach(), "entropy": entropy.detach(), "grad": mine.grad},
        os.path.join(args.out, f"rank{rank}.pt"),
    )
    shutdown()


if __name__ == "__main__":
    main()
