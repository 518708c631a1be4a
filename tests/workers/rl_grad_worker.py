"""Rank body for the AIPO-gradient tests: gradients of one RL batch at several layouts.

    torchrun --nproc-per-node N tests/workers/rl_grad_worker.py --checkpoint DIR --samples FILE \
        --out DIR --runs 2x1:32 1x2:64 ...

Each run is LAYOUT:MAX_TOKENS_PER_MICROBATCH. It runs PolicyTrainer.forward_backward
(Megatron schedule + DDP, no optimizer step), writes the gradients as a model
checkpoint OUT/<run> (gradient in place of each weight) and OUT/<run>.json
with the micro-batch count and loss.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lm_batch import parse_layout  # noqa: E402

from megarl.checkpointing.megatron_checkpoint import save_model  # noqa: E402
from megarl.models.loading import load_llama  # noqa: E402
from megarl.runtime.distributed import init_distributed, init_megatron, shutdown  # noqa: E402
from megarl.trainer.hooks import STAT_FIELDS, LossConfig  # noqa: E402
from megarl.trainer.policy_trainer import PolicyTrainer  # noqa: E402
from megarl.trainer.setup import OptimizerSettings, build_optimizer, unwrap, wrap_ddp  # noqa: E402
from tests.rl_batch import RHO, TEMPERATURE, load_samples  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--samples", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--runs", nargs="+", required=True)
    args = p.parse_args()
    init_distributed()
    samples = load_samples(args.samples)
    for run in args.runs:
        layout_name, budget = run.split(":")
        layout = parse_layout(layout_name)
        init_megatron(layout)
        spec, chunks = load_llama(args.checkpoint, layout)
        # Plain DDP (all-reduce), so every rank holds the whole gradient afterwards.
        ddp = wrap_ddp(chunks, OptimizerSettings(use_distributed_optimizer=False))
        optimizer = build_optimizer(ddp, OptimizerSettings(use_distributed_optimizer=False))
        loss = LossConfig(name="aipo", params={"rho": RHO}, temperature=TEMPERATURE)
        trainer = PolicyTrainer(ddp, optimizer, spec.vocab_size, loss, int(budget))
        plan, stats = trainer.forward_backward(samples)
        totals = trainer._reduce_stats(stats)
        with torch.no_grad():
            for chunk in ddp:
                for param in chunk.module.parameters():
                    param.copy_(param.main_grad)
        save_model(unwrap(ddp), os.path.join(args.out, run.replace(":", "_")), spec)
        if dist.get_rank() == 0:
            record = dict(zip(STAT_FIELDS, totals.tolist()))
            record.update(micro_batches=len(plan.micro_batches), efficiency=plan.efficiency)
            with open(os.path.join(args.out, run.replace(":", "_") + ".json"), "w") as f:
                json.dump(record, f)
    shutdown()


if __name__ == "__main__":
    main()
