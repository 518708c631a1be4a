"""Rank body for the resume test: a reloaded run continues exactly like an unbroken one.

    torchrun --nproc-per-node N tests/workers/resume_worker.py --checkpoint DIR --out DIR \
        --save-layout 2x1 --resume-layouts 2x1 1x2

At --save-layout: train 1 step, save a training checkpoint (weights + distributed
Adam state), train 2 more steps, save the weights as "unbroken". Then for each
resume layout: build a fresh model and optimizer, load the training checkpoint,
train the same 2 steps, save the weights as "resumed_<layout>". Then the state's round trip
through another layout: load the training checkpoint at each resume layout other than the save
layout and save it again untrained ("resharded_<layout>"), load that at the save layout, train the
same 2 steps, save the weights as "round_trip_<layout>" (the same arithmetic as the unbroken run:
equal bitwise unless the state changed on the way).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch.distributed as dist  # noqa: E402
from lm_batch import parse_layout  # noqa: E402
from train_step_worker import run_steps  # noqa: E402

from megarl.checkpointing.megatron_checkpoint import save_model  # noqa: E402
from megarl.checkpointing.model_loading import load_megatron_model  # noqa: E402
from megarl.checkpointing.training_checkpoint import load_training_state, save_training_state  # noqa: E402
from megarl.runtime.distributed import init_distributed, init_megatron, shutdown  # noqa: E402
from megarl.trainer.setup import (  # noqa: E402
    OptimizerSettings,
    build_optimizer,
    fuse_torch_adam_on_cpu,
    unwrap,
    wrap_ddp,
)

# Plain Adam: the bias correction depends on each parameter's step count.
SETTINGS = OptimizerSettings(optimizer="adam", lr=1e-2, clip_grad=1.0)


def fresh(checkpoint, layout):
    init_megatron(layout)
    spec, chunks = load_megatron_model(checkpoint, layout)
    ddp = wrap_ddp(chunks)
    return spec, ddp, build_optimizer(ddp, SETTINGS)


def adam_step_counts(optimizer) -> dict:
    """Step count of every parameter's Adam state on this rank, and how many distinct tensors hold them."""
    steps = [s["step"] for opt in optimizer.chained_optimizers for s in opt.optimizer.state.values()]
    return {
        "values": sorted({float(t) for t in steps}),
        "distinct_objects": len({id(t) for t in steps}),
        "n": len(steps),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--save-layout", required=True)
    p.add_argument("--resume-layouts", nargs="+", required=True)
    args = p.parse_args()
    init_distributed()
    train_ckpt = os.path.join(args.out, "train_ckpt")
    records = {}

    spec, ddp, optimizer = fresh(args.checkpoint, parse_layout(args.save_layout))
    records["before_save"] = run_steps(ddp, optimizer, spec, 1)
    save_training_state(unwrap(ddp), optimizer, train_ckpt, spec, iteration=1, loop_state={"policy_version": 1})
    records["unbroken"] = run_steps(ddp, optimizer, spec, 2)
    save_model(unwrap(ddp), os.path.join(args.out, "unbroken"), spec)

    for name in args.resume_layouts:
        spec, ddp, optimizer = fresh(args.checkpoint, parse_layout(name))
        loop_state = load_training_state(unwrap(ddp), optimizer, train_ckpt)
        fuse_torch_adam_on_cpu(optimizer)
        records[f"loop_state_{name}"] = loop_state
        records[f"resumed_{name}"] = run_steps(ddp, optimizer, spec, 2)
        records[f"adam_steps_{name}"] = adam_step_counts(optimizer)
        save_model(unwrap(ddp), os.path.join(args.out, f"resumed_{name}"), spec)
    for name in args.resume_layouts:
        if name == args.save_layout:
            continue
        resharded = os.path.join(args.out, f"resharded_{name}")
        spec, ddp, optimizer = fresh(args.checkpoint, parse_layout(name))
        loop_state = load_training_state(unwrap(ddp), optimizer, train_ckpt)
        save_training_state(unwrap(ddp), optimizer, resharded, spec, iteration=1, loop_state=loop_state)
        spec, ddp, optimizer = fresh(args.checkpoint, parse_layout(args.save_layout))
        load_training_state(unwrap(ddp), optimizer, resharded)
        fuse_torch_adam_on_cpu(optimizer)
        records[f"round_trip_{name}"] = run_steps(ddp, optimizer, spec, 2)
        save_model(unwrap(ddp), os.path.join(args.out, f"round_trip_{name}"), spec)
    if dist.get_rank() == 0:
        with open(os.path.join(args.out, "records.json"), "w") as f:
            json.dump(records, f, indent=1)
    shutdown()


if __name__ == "__main__":
    main()
