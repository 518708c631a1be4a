"""Rank body for the training-step equality tests.

    torchrun --nproc-per-node N tests/workers/train_step_worker.py --checkpoint DIR --out DIR \
        --layouts 1x1 2x2 2x1 1x2x2 [--steps 2]

For each layout (TPxPP or TPxPPxVP; DP fills the rest of the world) it loads the
same checkpoint, trains ``--steps`` steps of next-token cross entropy on one
fixed global batch through Megatron's schedule, DDP and distributed optimizer,
then saves the weights and writes the global loss and grad norm of each step.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch.distributed as dist  # noqa: E402
from lm_batch import MICRO_BATCH, SEQ, global_loss, make_forward_step, micro_batches, parse_layout  # noqa: E402

from megarl.checkpointing.megatron_checkpoint import save_model  # noqa: E402
from megarl.checkpointing.model_loading import load_megatron_model  # noqa: E402
from megarl.runtime.distributed import init_distributed, init_megatron, shutdown  # noqa: E402
from megarl.trainer.setup import OptimizerSettings, build_optimizer, train_step, unwrap, wrap_ddp  # noqa: E402

# Adam (the distributed optimizer supports only Adam) with eps far above the
# gradient scale: update ~ lr * g, so a wrongly scaled gradient shows in the
# weights instead of vanishing in Adam's g / sqrt(g^2) normalisation.
SETTINGS = OptimizerSettings(optimizer="adam", lr=0.5, adam_eps=1.0, clip_grad=1.0)


def run_steps(ddp, optimizer, spec, steps: int) -> list:
    record = []
    for _ in range(steps):
        result = train_step(
            ddp, optimizer, make_forward_step(spec.vocab_size), micro_batches(spec.vocab_size), SEQ, MICRO_BATCH
        )
        record.append({"loss": global_loss(result["losses"]), "grad_norm": float(result["grad_norm"])})
    return record


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--layouts", nargs="+", required=True)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    init_distributed()
    for name in args.layouts:
        layout = parse_layout(name)
        init_megatron(layout)
        spec, chunks = load_megatron_model(args.checkpoint, layout)
        ddp = wrap_ddp(chunks)
        optimizer = build_optimizer(ddp, SETTINGS)
        record = run_steps(ddp, optimizer, spec, args.steps)
        save_model(unwrap(ddp), os.path.join(args.out, name), spec)
        if dist.get_rank() == 0:
            with open(os.path.join(args.out, f"{name}.json"), "w") as f:
                json.dump(record, f)
    shutdown()


if __name__ == "__main__":
    main()
