"""Rank body for the RL-gradient tests: gradients of one RL batch at several layouts and losses.

    torchrun --nproc-per-node N tests/workers/rl_grad_worker.py --checkpoint DIR --samples FILE \
        --out DIR --runs 2x1:32 1x2:64:gspo,dr_grpo ...

Each run is LAYOUT:MAX_TOKENS_PER_MICROBATCH[:CASE,CASE...] (cases of tests/rl_batch.CASES,
default aipo; a masked case runs on rl_batch.masked_samples of the batch). The model is loaded
once per layout; for each case it runs
PolicyTrainer.forward_backward (Megatron schedule + DDP, no optimizer step) at the
trainer version rl_batch.VERSION, writes the gradients as a model checkpoint
OUT/<layout>_<budget>_<case> (gradient in place of each weight) and a .json beside it
with the summed statistics, the step's metrics and the micro-batch count.
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
from megatron.core import parallel_state as mpu  # noqa: E402

from megarl.checkpointing.megatron_checkpoint import save_model  # noqa: E402
from megarl.checkpointing.model_loading import load_megatron_model  # noqa: E402
from megarl.runtime.distributed import init_distributed, init_megatron, shutdown  # noqa: E402
from megarl.trainer.policy_trainer import PolicyTrainer  # noqa: E402
from megarl.trainer.response_logits import _output_layer  # noqa: E402
from megarl.trainer.router_replay import RoutingReplay  # noqa: E402
from megarl.trainer.setup import OptimizerSettings, build_optimizer, unwrap, wrap_ddp  # noqa: E402
from megarl.trainer.stats import metrics_from_totals  # noqa: E402
from tests.rl_batch import CASES, MAX_LAG, MOE_AUX, VERSION, bound_loss, case_samples, load_samples  # noqa: E402


def save_grads(ddp, spec, path):
    """The gradients written where the weights go; the weights put back afterwards."""
    params = [p for chunk in ddp for p in chunk.module.parameters()]
    weights = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.copy_(p.main_grad)
    save_model(unwrap(ddp), path, spec)
    with torch.no_grad():
        for p, w in zip(params, weights):
            p.copy_(w)


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
        layout_name, budget, *cases = run.split(":")
        # a layout ending in "aux": rl_batch.MOE_AUX's router losses on; then (or alone) "sp":
        # Megatron's sequence parallelism (norms over TP on CPU: megatron_patches/torch_norm_sp.py)
        # "replay": routing replay of the samples' routed experts; "rc" before it: full recomputation
        # (routers re-run in backward: each micro-batch's own routes must be popped)
        name = layout_name
        replay = name.endswith("replay")
        name = name.removesuffix("replay")
        settings = {}
        if name.endswith("rc"):
            settings.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
            name = name.removesuffix("rc")
        settings.update(MOE_AUX if name.endswith("aux") else {})
        name = name.removesuffix("aux")
        settings["sequence_parallel"] = name.endswith("sp")
        layout = parse_layout(name.removesuffix("sp"))
        init_megatron(layout)
        spec, chunks = load_megatron_model(args.checkpoint, layout, **settings)
        # Plain DDP (all-reduce), so every rank holds the whole gradient afterwards.
        ddp = wrap_ddp(chunks, OptimizerSettings(use_distributed_optimizer=False))
        optimizer = build_optimizer(ddp, OptimizerSettings(use_distributed_optimizer=False))
        # positions the output layer computed logits for (trainer/response_logits.py: responses only)
        rows = torch.zeros(1, dtype=torch.float64)

        def count_rows(_module, args, _output):
            rows.add_(args[0].shape[0])  # returns None: the output stays the layer's

        for chunk in ddp:
            layer = _output_layer(chunk)
            if layer is not None:
                layer.register_forward_hook(count_rows)
        for case in cases[0].split(",") if cases else ["aipo"]:
            # replay off: the same objects only observe (moe_route_agreement) when samples carry routes
            routing = RoutingReplay(ddp, replay=replay)
            trainer = PolicyTrainer(
                ddp, optimizer, spec.vocab_size, bound_loss(CASES[case]), int(budget), routing=routing
            )
            batch = case_samples(samples, CASES[case])
            rows.zero_()
            plan, stats = trainer.forward_backward(batch, version=VERSION)
            totals = trainer._reduce_stats(stats)
            # every DP rank's micro-batches (the reference's aux losses are per micro-batch)
            mine = (mpu.get_data_parallel_rank(), [(mb.sample_indices, mb.length) for mb in plan.micro_batches])
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            output_layer_rows = rows.clone()
            dist.all_reduce(output_layer_rows)  # every TP rank of the last stage computes the same rows
            output_layer_rows /= layout.tp
            name = f"{layout_name}_{budget}_{case}"
            save_grads(ddp, spec, os.path.join(args.out, name))
            if dist.get_rank() == 0:
                record = dict(zip(trainer.stat_fields, totals.tolist()))
                record.update(
                    metrics=metrics_from_totals(totals, MAX_LAG),
                    micro_batches=len(plan.micro_batches),
                    packed=[mbs for _, mbs in sorted(dict(every).items())],  # per DP rank: (samples, row length)
                    moe_metrics=trainer.moe_metrics,
                    output_layer_rows=output_layer_rows.item(),
                    efficiency=plan.efficiency,
                    trainer_logprobs=[s.trainer_logprobs for s in batch],
                )
                with open(os.path.join(args.out, name + ".json"), "w") as f:
                    json.dump(record, f)
    shutdown()


if __name__ == "__main__":
    main()
