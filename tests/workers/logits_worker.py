"""Rank body for the logits tests: load one checkpoint at several layouts, save logits.

    torchrun --nproc-per-node N tests/workers/logits_worker.py --checkpoint DIR \
        --tokens tokens.pt --out DIR --layouts 1x1 2x1 1x2 2x2 2x1x2 1x1x2x1

For each layout TPxPP[xEP[xETP]] (EP carved out of the data-parallel ranks) the rank holding TP rank 0 of the last stage in DP
replica 0 writes logits_TPxPP.pt (fp32 [batch, seq, vocab]).
"""

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

from megarl.checkpointing.model_loading import load_megatron_model  # noqa: E402
from megarl.runtime.distributed import init_distributed, init_megatron, shutdown, world_dims  # noqa: E402
from megarl.trainer.forward import full_logits  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--tokens", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--layouts", nargs="+", required=True)
    args = p.parse_args()
    init_distributed()
    from megatron.core import parallel_state as mpu

    tokens = torch.load(args.tokens)
    for name in args.layouts:
        sizes = [int(x) for x in name.split("x")]
        tp, pp, ep, etp = (sizes + [1, None])[:4] if len(sizes) < 4 else sizes
        layout = dataclasses.replace(world_dims(tp, pp), ep=ep, etp=etp)
        init_megatron(layout)
        spec, chunks = load_megatron_model(args.checkpoint, layout)
        logits = full_logits(chunks, tokens, spec.vocab_size)
        if logits is not None and mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_data_parallel_rank() == 0:
            torch.save(logits.float(), os.path.join(args.out, f"logits_{name}.pt"))
    shutdown()


if __name__ == "__main__":
    main()
