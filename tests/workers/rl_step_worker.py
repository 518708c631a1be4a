"""Rank body for full RL optimizer steps: a dotted-path user loss, the non-finite guard,
and a KL penalty against a frozen reference model.

    torchrun --nproc-per-node N tests/workers/rl_step_worker.py --checkpoint DIR --samples FILE \
        --out DIR --layout 1x2

Writes OUT/metrics.json and the weights after each case as OUT/<case>.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch.distributed as dist  # noqa: E402
from lm_batch import parse_layout  # noqa: E402

from megarl.checkpointing.megatron_checkpoint import save_model  # noqa: E402
from megarl.models.loading import load_llama  # noqa: E402
from megarl.runtime.distributed import init_distributed, init_megatron, shutdown  # noqa: E402
from megarl.trainer.hooks import LossConfig  # noqa: E402
from megarl.trainer.policy_trainer import PolicyTrainer  # noqa: E402
from megarl.trainer.setup import OptimizerSettings, build_optimizer, unwrap, wrap_ddp  # noqa: E402
from tests.rl_batch import RHO, TEMPERATURE, load_samples  # noqa: E402

CASES = {
    "custom": LossConfig(
        name="examples.losses.entropy_bonus:aipo_with_entropy_bonus",
        params={"rho": RHO, "entropy_coef": 0.01},
        temperature=TEMPERATURE,
    ),
    "nan": LossConfig(name="tests.workers.nan_loss:aipo_with_nan", params={"rho": RHO}, temperature=TEMPERATURE),
    "kl": LossConfig(name="aipo", params={"rho": RHO}, temperature=TEMPERATURE, kl_coef=0.1),
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
    for case, loss in CASES.items():
        init_megatron(layout)
        spec, chunks = load_llama(args.checkpoint, layout)
        ref_chunks = load_llama(args.checkpoint, layout)[1] if loss.kl_coef else None
        ddp = wrap_ddp(chunks)
        optimizer = build_optimizer(ddp, OptimizerSettings(lr=1e-2))
        trainer = PolicyTrainer(ddp, optimizer, spec.vocab_size, loss, 32, ref_chunks=ref_chunks)
        metrics[case] = [trainer.step(samples) for _ in range(2 if loss.kl_coef else 1)]
        save_model(unwrap(ddp), os.path.join(args.out, case), spec)
    if dist.get_rank() == 0:
        with open(os.path.join(args.out, "metrics.json"), "w") as f:
            json.dump(metrics, f, indent=1)
    shutdown()


if __name__ == "__main__":
    main()
