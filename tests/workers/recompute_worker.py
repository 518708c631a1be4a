"""Rank body for the activation-recompute tests: one RL step at TP2 x PP2 per recompute setting.

    torchrun --nproc-per-node 4 tests/workers/recompute_worker.py --checkpoint DIR --samples FILE \
        --out DIR --settings none selective full-uniform full-block

For each setting (trainer.recompute_* as megarl.executors.trainer passes them to
Megatron) it runs PolicyTrainer.forward_backward and writes the gradients as a
checkpoint OUT/<setting>/grads, then one Adam step and the updated weights as
OUT/<setting>/weights, and OUT/<setting>-rank<r>.json with the peak bytes of
activations this rank held for backward during the step.

Activation memory is measured with autograd's saved-tensor hooks: every tensor
saved for backward (parameters excluded) counts from when it is saved until
autograd frees it, so the peak is what the schedule keeps alive -- what
recomputation is for -- independent of the allocator.
"""

import argparse
import json
import os
import sys
import weakref

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megarl.checkpointing.megatron_checkpoint import save_model  # noqa: E402
from megarl.checkpointing.model_loading import load_megatron_model  # noqa: E402
from megarl.config import RolloutConfig, TrainerConfig  # noqa: E402
from megarl.executors.trainer import megatron_model_settings  # noqa: E402
from megarl.runtime.distributed import init_distributed, init_megatron, shutdown, world_dims  # noqa: E402
from megarl.trainer.bound_loss import bind_loss  # noqa: E402
from megarl.trainer.policy_trainer import PolicyTrainer  # noqa: E402
from megarl.trainer.setup import OptimizerSettings, build_optimizer, unwrap, wrap_ddp  # noqa: E402
from tests.rl_batch import RHO, TEMPERATURE, load_samples  # noqa: E402

SETTINGS = {
    "none": TrainerConfig(),
    "selective": TrainerConfig(recompute_granularity="selective"),
    # every layer's inputs only: 1 layer per checkpointed group
    "full-uniform": TrainerConfig(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    # the first layer of each stage recomputed, the other kept
    "full-block": TrainerConfig(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
}


class ActivationMeter:
    """Peak live bytes of tensors autograd saved for backward (parameters excluded)."""

    class _Held:
        __slots__ = ("tensor", "__weakref__")

        def __init__(self, tensor):
            self.tensor = tensor

    def __init__(self, params):
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}
        self.live = self.peak = 0

    def pack(self, tensor):
        held = self._Held(tensor)
        if tensor.untyped_storage().data_ptr() not in self.param_storages:
            nbytes = tensor.numel() * tensor.element_size()
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(held, self._release, nbytes)
        return held

    def _release(self, nbytes):
        self.live -= nbytes

    @staticmethod
    def unpack(held):
        return held.tensor


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--samples", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--settings", nargs="+", required=True)
    args = p.parse_args()
    init_distributed()
    samples = load_samples(args.samples)
    layout = world_dims(2, 2)
    for name in args.settings:
        init_megatron(layout)
        spec, chunks = load_megatron_model(args.checkpoint, layout, **megatron_model_settings(SETTINGS[name]))
        settings = OptimizerSettings(lr=1e-3, use_distributed_optimizer=False)
        ddp = wrap_ddp(chunks, settings)
        optimizer = build_optimizer(ddp, settings)
        trainer = PolicyTrainer(
            ddp,
            optimizer,
            spec.vocab_size,
            bind_loss(TrainerConfig(loss_params={"rho": RHO}), RolloutConfig(temperature=TEMPERATURE), lag_bound=0),
            64,
        )
        meter = ActivationMeter([q for c in chunks for q in c.parameters()])
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            plan, _ = trainer.forward_backward(samples)
        out = os.path.join(args.out, name)
        with torch.no_grad():
            weights = [q.detach().clone() for c in ddp for q in c.module.parameters()]
            for chunk in ddp:
                for param in chunk.module.parameters():
                    param.copy_(param.main_grad)
        save_model(unwrap(ddp), os.path.join(out, "grads"), spec)
        with torch.no_grad():
            for param, w in zip((q for c in ddp for q in c.module.parameters()), weights):
                param.copy_(w)
        success, _, _ = optimizer.step()
        assert success
        save_model(unwrap(ddp), os.path.join(out, "weights"), spec)
        with open(f"{out}-rank{dist.get_rank()}.json", "w") as f:
            json.dump({"peak_activation_bytes": meter.peak, "micro_batches": len(plan.micro_batches)}, f)
    shutdown()


if __name__ == "__main__":
    main()
