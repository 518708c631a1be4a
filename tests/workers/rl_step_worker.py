"""Rank body for full RL optimizer steps: a dotted-path user loss, the non-finite guard,
and a KL penalty against a frozen reference model.

    torchrun --nproc-per-node N tests/workers/rl_step_worker.py --checkpoint DIR --samples FILE \
        --out DIR --layout 1x2

Cases:
  custom  the entropy-bonus example loss, one Adam step
  nan     a loss that goes non-finite: the step is skipped
  overlong samples 0 and 3 marked cut by max_new_tokens, trainer.overlong=mask: left out
  kl      plain SGD (no momentum, no clipping: a step is -lr * this step's gradient): step 1
          on the batch's rewards moves pi away from the reference; steps 2 and 3 on the same
          tokens with every reward equal (zero advantage), so only the KL term has a gradient,
          at a learning rate small enough for a first-order prediction of the KL's drop

Writes OUT/metrics.json and the weights after each case as OUT/<case>.
"""

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch.distributed as dist  # noqa: E402
from lm_batch import parse_layout  # noqa: E402

from megarl.checkpointing.megatron_checkpoint import save_model  # noqa: E402
from megarl.checkpointing.model_loading import load_megatron_model  # noqa: E402
from megarl.runtime.distributed import init_distributed, init_megatron, shutdown  # noqa: E402
from megarl.trainer.policy_trainer import PolicyTrainer  # noqa: E402
from megarl.trainer.setup import OptimizerSettings, build_optimizer, unwrap, wrap_ddp  # noqa: E402
from tests.rl_batch import RHO, VERSION, bound_loss, load_samples  # noqa: E402

ENTROPY_COEF = 0.05
KL_LR_AWAY = 1e-3  # step 1
KL_LR = 1e-4  # steps 2, 3: lr x the KL's curvature along the step (|g|^2 / 2 KL ~ 700 here) ~ 0.07
CASES = {  # name -> (TrainerConfig fields, bound by rl_batch.bound_loss; the optimizer's settings)
    "custom": (
        dict(
            loss="examples.losses.entropy_bonus:aipo_with_entropy_bonus",
            loss_params={"rho": RHO, "entropy_coef": ENTROPY_COEF},
        ),
        OptimizerSettings(lr=1e-2),
    ),
    "nan": (
        dict(loss="tests.workers.nan_loss:aipo_with_nan", loss_params={"rho": RHO}),
        OptimizerSettings(lr=1e-2),
    ),
    "overlong": (
        dict(loss="aipo", loss_params={"rho": RHO}, overlong="mask"),
        OptimizerSettings(lr=1e-2),
    ),
    "kl": (
        dict(loss="aipo", loss_params={"rho": RHO}, kl_coef=1.0),
        # Megatron's distributed optimizer is Adam-only
        OptimizerSettings(
            optimizer="sgd", sgd_momentum=0.0, lr=KL_LR_AWAY, clip_grad=0.0, use_distributed_optimizer=False
        ),
    ),
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--samples", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--layout", required=True)
    args = p.parse_args()
    init_distributed()
    samples = load_samples(args.samples)
    layout = parse_layout(args.layout)
    metrics = {}
    for case, (trainer_fields, settings) in CASES.items():
        loss = bound_loss(trainer_fields, lag_bound=0)
        init_megatron(layout)
        spec, chunks = load_megatron_model(args.checkpoint, layout)
        ref_chunks = load_megatron_model(args.checkpoint, layout)[1] if loss.kl_coef else None
        ddp = wrap_ddp(chunks, settings)
        optimizer = build_optimizer(ddp, settings)
        trainer = PolicyTrainer(ddp, optimizer, spec.vocab_size, loss, 32, ref_chunks=ref_chunks)
        if case == "kl":
            equal = [dataclasses.replace(s, reward=0.0, trainer_logprobs=None) for s in samples]
            metrics[case] = [trainer.step(samples, version=VERSION)]
            for group in optimizer.param_groups:
                group["lr"] = KL_LR
            metrics[case] += [trainer.step(equal, version=VERSION) for _ in range(2)]
        elif case == "overlong":
            # trainer_logprobs cleared: the earlier cases handed theirs back into these samples
            cut = [
                dataclasses.replace(s, finish_reason="length" if i in (0, 3) else "stop", trainer_logprobs=None)
                for i, s in enumerate(samples)
            ]
            metrics[case] = [trainer.step(cut, version=VERSION)]
            metrics[case][0]["handed_back"] = [s.trainer_logprobs is not None for s in cut]
        else:
            metrics[case] = [trainer.step(samples, version=VERSION)]
        save_model(unwrap(ddp), os.path.join(args.out, case), spec)
    if dist.get_rank() == 0:
        with open(os.path.join(args.out, "metrics.json"), "w") as f:
            json.dump(metrics, f, indent=1)
    shutdown()


if __name__ == "__main__":
    main()
