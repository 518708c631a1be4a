"""Make distributed-optimizer checkpoints of torch's Adam load correctly.

Why this exists: without Apex or Transformer Engine (every CPU run, and GPU
installs without them) megatron-core 0.16.1's DistributedOptimizer wraps
torch.optim.AdamW, and two things go wrong when it loads a checkpoint:

1. Building the sharded state dict to load into calls state_dict(), which
   asserts that all parameters share one 'step' -- and a fresh optimizer has
   no state at all, so the load dies on ``assert len(steps) == 1``.
   ``init_adam_state_for_loading`` fills the state first with Megatron's own
   dummy step (zero gradients); everything it writes is overwritten by the load.
2. load_state_dict stores the checkpoint's step as *one* tensor object in every
   parameter's state. torch's Adam increments state['step'] in place once per
   parameter, so after a reload the shared counter advances N times per
   optimizer step and every bias correction goes wrong -- silently, the loss
   still goes down. ``untie_adam_step_state`` gives each parameter its own copy.
3. In between, the 'fully_reshardable' loader copies every state entry of a
   parameter from the checkpoint -- including 'step', which that format keeps
   in param_groups, not per parameter -- and fails with KeyError: 'step'.
   ``apply()`` makes that copy skip entries the checkpoint does not carry per
   parameter (load_state_dict has already set them from param_groups).

Fused (Apex/TE) Adam keeps its step in param_groups and is left alone.

When it can be deleted: when Megatron-Core initialises state before building
a loading state dict and clones the step per parameter.
"""

from __future__ import annotations

from megatron.core.optimizer import distrib_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer


def inner_torch_optimizers(optimizer):
    """The torch optimizers inside a Megatron optimizer (one, or one per chained optimizer)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    for opt in chained if chained is not None else [optimizer]:
        inner = getattr(opt, "optimizer", None)
        if inner is not None:
            yield inner


_applied = False


def apply() -> None:
    """Install the fix for (3). Idempotent; a no-op with Apex/TE fused Adam."""
    global _applied
    if _applied or not _uses_torch_adam():
        return
    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            state = self.optimizer.state[main_param]
            step = state.pop("step", None)
            try:
                return original(self, model_param, tensors)
            finally:
                if step is not None:
                    state["step"] = step
        return original(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_main_param_and_optimizer_states
    _applied = True


def _uses_torch_adam() -> bool:
    return not distrib_optimizer.HAVE_APEX_OR_TE


def _distributed_optimizers(optimizer):
    chained = getattr(optimizer, "chained_optimizers", None)
    for opt in chained if chained is not None else [optimizer]:
        if isinstance(opt, DistributedOptimizer):
            yield opt


def init_adam_state_for_loading(optimizer) -> int:
    """Give a fresh torch-Adam distributed optimizer the state a load expects."""
    if not _uses_torch_adam():
        return 0
    initialised = 0
    for opt in _distributed_optimizers(optimizer):
        if not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()
            initialised += 1
    return initialised


def untie_adam_step_state(optimizer) -> int:
    """De-alias shared 'step' tensors in the torch optimizer(s) inside ``optimizer``."""
    untied = 0
    for inner in inner_torch_optimizers(optimizer):
        seen = set()
        for state in inner.state.values():
            step = state.get("step")
            if step is None or not hasattr(step, "clone"):
                continue
            if id(step) in seen:
                state["step"] = step.clone()
                untied += 1
            seen.add(id(state["step"]))
    return untied
