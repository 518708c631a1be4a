"""Routing replay ("R3"): the trainer's MoE routers take the experts the generator chose.

The generator records, for every position it fed, the top-k experts of each MoE layer
(Completion.routed_experts, [positions, num_layers, top_k], -1 on dense layers). Without
replay the trainer routes again with its own weights and kernels, and a near tie routes a
token to other experts than the ones that produced its behaviour log-prob: the importance
ratio then compares two different networks (Megatron-LM issue 4168: Qwen3-30B-A3B GRPO
runs collapsed without replay and completed with it).

Megatron-Core 0.16.1 gives the hook and a state per router (``RouterReplay``: a target,
a first-in-first-out list for backward, the RECORD / REPLAY_FORWARD / REPLAY_BACKWARD
actions); its routers call ``router.router_replay.get_replay_topk`` in every forward.
megarl owns the rest, here:

- ``PositionRoutes`` replaces Megatron's per-router instance on the *policy's* routers
  only (installed per chunk, never registered in Megatron's process-wide list, so the
  KL reference model and forward-only passes outside a step route as usual);
- each micro-batch's routes are set inside the forward step for the routers of the chunk
  being run (virtual pipelines run chunks at different times), laid out in Megatron's
  token order: the packed row ([s, b] with b = 1), each TP rank's slice under sequence
  parallelism, each stage's own MoE layers by their global layer number (dense layers
  have no router);
- the output of the chunk's forward carries an autograd identity whose backward switches
  its routers to REPLAY_BACKWARD, so activation recomputation in backward pops that
  micro-batch's routes (1F1B and interleaving run backwards in forward order per chunk)
  instead of reusing the last micro-batch's target;
- a position without routes (padding; a sample the generator recorded none for) keeps
  the trainer's own top-k; the lists are cleared every step.

With replay off the same objects only observe: they return Megatron's own top-k and count
how often it agrees with the generator's (``moe_route_agreement``), so the diagnostic is
there for any run whose generator records routes.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from megatron.core.transformer.transformer_layer import TransformerLayer


class PositionRoutes(RouterReplay):
    """One policy router's replay state: Megatron's RouterReplay with positions that may have no
    route (-1: the router's own choice) and counters for the step's metrics."""

    def __init__(self, replay: bool):
        super().__init__()
        # Megatron's constructor registers every instance process-wide for its global setters;
        # megarl addresses routers per chunk, and the list would mix in other models' routers
        RouterReplay.global_router_replay_instances.remove(self)
        self.replay = replay
        self.real: Optional[torch.Tensor] = None  # [tokens] bool: positions of real samples
        # real token x layers, with a route, agreeing: kept on the router's device (no sync per forward)
        self.counts = torch.zeros(3, dtype=torch.float64)

    def set_micro_batch(self, routes: torch.Tensor, real: torch.Tensor) -> None:
        self.set_target_indices(routes)  # the target, and appended for backward's recompute
        self.real = real
        self.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def clear_step(self) -> None:
        self.clear_indices()
        self.clear_router_replay_action()
        self.real = None

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        own_probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        action = self.router_replay_action
        if action is None:
            return own_probs, own
        if action == RouterReplayAction.REPLAY_BACKWARD:
            target = self.replay_backward_list.pop(0)
        else:
            target = self.target_topk_idx
        target = target.to(scores.device, torch.long)
        routed = target[:, 0] >= 0
        if action == RouterReplayAction.REPLAY_FORWARD:
            self._count(own, target, routed)
        if not self.replay:
            return own_probs, own
        indices = torch.where(routed[:, None], target, own)
        return scores.gather(1, indices), indices

    def _count(self, own: torch.Tensor, target: torch.Tensor, routed: torch.Tensor) -> None:
        real = self.real.to(routed.device)
        with_route = routed & real
        same = (own.sort(dim=1).values == target.sort(dim=1).values).all(dim=1) & with_route
        found = torch.stack([real.sum(), with_route.sum(), same.sum()]).to(torch.float64)
        self.counts = self.counts.to(found.device) + found


class _SwitchToBackward(torch.autograd.Function):
    """Identity; its backward (the first of the micro-batch's backward on this chunk) switches the
    chunk's routers to REPLAY_BACKWARD before any recomputation runs."""

    @staticmethod
    def forward(ctx, output, routers):
        ctx.routers = routers
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        for _, router in ctx.routers:
            router.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        return grad, None


class RoutingReplay:
    """The policy's routers, per chunk, and the step's replay (``replay=False``: observe only)."""

    def __init__(self, chunks: list, replay: bool):
        self.replay, self.active = replay, False
        self.routers: Dict[int, List[Tuple[int, PositionRoutes]]] = {}
        for chunk in chunks:
            found = []
            for module in chunk.modules():
                if isinstance(module, TransformerLayer) and isinstance(module.mlp, MoELayer):
                    state = PositionRoutes(replay)
                    module.mlp.router.router_replay = state
                    found.append((module.layer_number - 1, state))  # Megatron's layer_number: global, from 1
            self.routers[id(chunk)] = found

    def _chunk_routers(self, model) -> List[Tuple[int, PositionRoutes]]:
        if id(model) in self.routers:
            return self.routers[id(model)]
        inner = getattr(model, "module", None)  # the DDP wrapper the schedule passes
        return self.routers.get(id(inner), []) if inner is not None else []

    def begin_step(self, micro_batches) -> None:
        """A step replays (or observes) when any of this rank's micro-batches carries routes; then
        every micro-batch sets a target (all -1 where it has none), so the backward lists stay in
        step with the micro-batches."""
        self.clear_step()
        self.active = any(mb.routes is not None for mb in micro_batches)

    def begin_micro_batch(self, model, mb) -> Optional[List[Tuple[int, PositionRoutes]]]:
        """Set this chunk's routers for ``mb``; returns them (for ``wrap_output``), or None when
        there is nothing to set (a step without routes, or a dense chunk)."""
        routers = self._chunk_routers(model)
        if not self.active or not routers:
            return None
        routes = mb.routes
        if routes is None:  # routes recorded elsewhere in the step, none here: the trainer's own
            routes = torch.full((mb.length, max(layer for layer, _ in routers) + 1, 1), -1, dtype=torch.int16)
        real = torch.arange(mb.length) < mb.real_tokens
        config = model.config
        if config.sequence_parallel and mpu.get_tensor_model_parallel_world_size() > 1:
            # under sequence parallelism each TP rank's routers see its contiguous slice of the row
            tp, rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
            size = mb.length // tp
            routes, real = routes[rank * size : (rank + 1) * size], real[rank * size : (rank + 1) * size]
        for layer, state in routers:
            state.set_micro_batch(routes[:, layer], real)
        return routers

    def end_step(self) -> None:
        """After the step's forward-backward: forward-only passes of the policy route as usual."""
        self.clear_step()
        self.active = False

    @staticmethod
    def wrap_output(output: torch.Tensor, routers) -> torch.Tensor:
        if routers is None or not output.requires_grad:
            return output
        return _SwitchToBackward.apply(output, routers)

    def clear_step(self) -> None:
        for routers in self.routers.values():
            for _, state in routers:
                state.clear_step()

    def step_metrics(self, device: torch.device) -> Dict[str, float]:
        """moe_routes_replayed (the fraction of real token x layer routes taken from the generator)
        and moe_route_agreement (the trainer's own top-k = the generator's, among routed ones),
        summed over every trainer rank's routers; then the counters restart."""
        counts = torch.zeros(3, dtype=torch.float64, device=device)
        for routers in self.routers.values():
            for _, state in routers:
                counts += state.counts.to(device)
                state.counts = torch.zeros_like(state.counts)
        dist.all_reduce(counts)
        real, routed, same = counts.tolist()
        if routed == 0:
            return {}
        return {
            "moe_routes_replayed": routed / real if self.replay else 0.0,
            "moe_route_agreement": same / routed,
        }
