"""The step's MoE auxiliary losses as metrics, read from Megatron-Core's own tracker.

Megatron's routers add the load-balancing (Switch) loss and the router z-loss to the gradient
themselves (MoEAuxLossAutoScaler, per MoE layer and per micro-batch) and record each layer's value
divided by its coefficient in a process-wide tracker (moe_utils.save_to_aux_losses_tracker).
Megatron-LM's training loop reduces and logs that tracker (track_moe_metrics); megarl does the
same after each forward-backward: summed over pipeline stages and over the router's TP/CP group,
averaged over data-parallel ranks (the z-loss too, which Megatron leaves per rank), divided by this
rank's micro-batches (megarl's packing gives every DP rank the same count when the batch allows),
and averaged over the MoE layers -- the mean per micro-batch and MoE layer, as Megatron-LM logs it,
with each layer's value beside it.

What the gradient gets (Megatron's definition with calculate_per_token_loss, which megarl's loss
hook runs with): each micro-batch's loss of each layer, times the micro-batch's routed positions
(every packed position, prompts and padding included), and then, like every gradient, divided by
the step's trained tokens. tests/multiprocess/test_moe_gradient.py checks that against a float
reference on transformers' model.
"""

from __future__ import annotations

from typing import Dict

import torch

# Megatron's tracker names, and the metric each becomes
TRACKED = {"load_balancing_loss": "moe_load_balancing_loss", "z_loss": "moe_z_loss"}


def tracked_names(config) -> list:
    """The tracker entries this model's routers write in a training forward."""
    if not getattr(config, "num_moe_experts", None):
        return []
    names = []
    if config.moe_router_load_balancing_type == "aux_loss" and config.moe_aux_loss_coeff > 0:
        names.append("load_balancing_loss")
    if config.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return names


def moe_loss_metrics(config, num_micro_batches: int, device: torch.device) -> Dict[str, float]:
    """The tracked losses of the forward-backward just run, as metrics; the tracker is cleared.
    Every trainer rank must call it (the reduction is collective)."""
    names = tracked_names(config)
    if not names:
        return {}
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
        reduce_aux_losses_tracker_across_ranks,
    )

    tracker = get_moe_layer_wise_logging_tracker()
    for name in names:
        # a pipeline stage without MoE layers has recorded nothing, yet joins the PP reduction
        tracker.setdefault(
            name,
            {
                "values": torch.zeros(config.num_layers, device=device),
                "reduce_group": None,
                "avg_group": None,
                "reduce_group_has_dp": False,
            },
        )
    if "z_loss" in names:
        # Megatron records the z-loss without a group (its value on this DP rank alone); averaged
        # over data-parallel ranks like the load-balancing loss, it is the step's
        from megatron.core import parallel_state

        tracker["z_loss"]["avg_group"] = parallel_state.get_data_parallel_group()
    reduce_aux_losses_tracker_across_ranks(names)
    freq = config.moe_layer_freq
    moe_layers = [i for i in range(config.num_layers) if (freq[i] if isinstance(freq, list) else i % freq == 0)]
    metrics = {}
    for name in names:
        per_layer = (tracker[name]["values"].double() / max(num_micro_batches, 1)).tolist()
        metrics[TRACKED[name]] = sum(per_layer[i] for i in moe_layers) / len(moe_layers)
        metrics.update({f"{TRACKED[name]}/layer{i}": per_layer[i] for i in moe_layers})  # TensorBoard: one curve each
    clear_aux_losses_tracker()
    return metrics
