"""The two ends of a weight sync, as a trainer rank and a generator worker see them.

Both ends take one ``SyncSettings`` (settings.py: the two layouts and the wire format), equal on
every rank of the sync, and each derives the same plan from it.

Trainer rank: ``TrainerSync(settings, chunks, group, sync_rank).push(version)``
sends this rank's part of the plan straight from its Megatron parameters.

Both take ``ipc_peers``: the sync ranks on this same GPU (find them with
``ipc.colocated_peers``, a collective over the group), whose bytes then go
through shared memory; that needs a gloo sync group.

Generator worker: ``allocate_generator_params`` gives the SGLang-layout tensors
of one TP rank (what megarl's reference engine holds; inside SGLang the
model's own parameters play this role), and
``GeneratorSync(settings, replica, tp_rank, params, group).pull()`` fills them in place.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Set

import torch

from megarl.models.spec import ModelSpec
from megarl.weight_sync import fp8 as fp8_format
from megarl.weight_sync.layouts import sglang_rank_layout
from megarl.weight_sync.planner import SyncPlan
from megarl.weight_sync.settings import SyncSettings
from megarl.weight_sync.transport import SyncStats, WeightReceiver, WeightSender


def megatron_params(chunks: List[torch.nn.Module]) -> Dict[str, torch.Tensor]:
    """This rank's Megatron parameters by their GPTModel names (DDP wrappers removed); with
    several virtual-pipeline chunks, chunk v's names carry the prefix "{v}/" (layouts.megatron_rank_layout)."""
    params = {}
    for v, chunk in enumerate(chunks):
        model = getattr(chunk, "module", chunk)
        prefix = f"{v}/" if len(chunks) > 1 else ""
        params.update({prefix + name: p.data for name, p in model.named_parameters()})
    return params


def allocate_generator_params(
    spec: ModelSpec,
    tp: int,
    tp_rank: int,
    dtype: torch.dtype = torch.bfloat16,
    fp8: bool = False,
    device: str | torch.device = "cpu",
    ep: int = 1,
) -> Dict[str, torch.Tensor]:
    """Zero-filled parameters of SGLang TP rank ``tp_rank`` (``ep``: its --ep-size), named and
    shaped as SGLang holds them."""
    if fp8:
        fp8_format.check_fp8_experts(spec, tp, ep)
    params = {}
    for t in sglang_rank_layout(spec, tp, tp_rank, ep):
        if fp8 and fp8_format.is_fp8_param(t.name):
            params[t.name] = torch.zeros(t.shape, dtype=fp8_format.FP8_DTYPE, device=device)
            params[fp8_format.scale_name(t.name)] = torch.zeros(
                fp8_format.scale_shape(t.shape), dtype=torch.float32, device=device
            )
        else:
            params[t.name] = torch.zeros(t.shape, dtype=dtype, device=device)
    return params


class TrainerSync:
    """A trainer rank's end: ``sync_rank`` in ``group`` (trainer ranks first, Megatron's order)."""

    def __init__(
        self,
        settings: SyncSettings,
        chunks: List[torch.nn.Module],
        group,
        sync_rank: int,
        plan: SyncPlan | None = None,
        ipc_peers: Optional[Set[int]] = None,
    ):
        self.plan = plan or settings.geometry.plan()
        self.sender = WeightSender(self.plan, sync_rank, group, megatron_params(chunks), settings.wire, ipc_peers)

    @torch.no_grad()
    def push(self, version: int) -> SyncStats:
        return self.sender.send(version)


class GeneratorSync:
    """Generator replica ``replica``'s TP rank ``tp_rank``: its SGLang-layout ``params`` filled in place."""

    def __init__(
        self,
        settings: SyncSettings,
        replica: int,
        tp_rank: int,
        params: Dict[str, torch.Tensor],
        group,
        plan: SyncPlan | None = None,
        ipc_peers: Optional[Set[int]] = None,
    ):
        self.plan = plan or settings.geometry.plan()
        self.sync_rank = settings.geometry.generator_rank(replica, tp_rank)
        self.receiver = WeightReceiver(self.plan, self.sync_rank, group, params, settings.wire, ipc_peers)

    @torch.no_grad()
    def pull(self, expected_version: int | None = None) -> SyncStats:
        return self.receiver.receive(expected_version)
