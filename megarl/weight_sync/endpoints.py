"""The two ends of a weight sync, as a trainer rank and a generator worker see them.

Trainer rank: ``TrainerSync(spec, trainer, generator, chunks, group).push(version)``
sends this rank's part of the plan straight from its Megatron parameters.

Both take ``ipc_peers``: the sync ranks on this same GPU (find them with
``ipc.colocated_peers``, a collective over the group), whose bytes then go
through shared memory; that needs a gloo sync group.

Generator worker: ``allocate_generator_params`` gives the SGLang-layout tensors
of one TP rank (what megarl's reference engine holds; inside SGLang the
model's own parameters play this role), and
``GeneratorSync(..., params, group).pull()`` fills them in place.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Set

import torch

from megarl.models.spec import ModelSpec
from megarl.parallel_dims import GeneratorDims, ParallelDims, generator_rank
from megarl.weight_sync import fp8 as fp8_format
from megarl.weight_sync.layouts import sglang_rank_layout
from megarl.weight_sync.planner import SyncPlan, build_plan
from megarl.weight_sync.transport import DEFAULT_BUCKET_BYTES, SyncStats, WeightReceiver, WeightSender


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
    def __init__(
        self,
        spec: ModelSpec,
        trainer: ParallelDims,
        generator: GeneratorDims,
        chunks: List[torch.nn.Module],
        group,
        sync_rank: int,
        fp8: bool = False,
        wire_dtype: torch.dtype = torch.bfloat16,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        verify: bool = False,
        plan: SyncPlan | None = None,
        ipc_peers: Optional[Set[int]] = None,
        norm_names: str = "local",
    ):
        self.plan = plan or build_plan(spec, trainer, generator, norm_names)
        self.sender = WeightSender(
            self.plan, sync_rank, group, megatron_params(chunks), fp8, wire_dtype, bucket_bytes, verify, ipc_peers
        )

    @torch.no_grad()
    def push(self, version: int) -> SyncStats:
        return self.sender.send(version)


class GeneratorSync:
    def __init__(
        self,
        spec: ModelSpec,
        trainer: ParallelDims,
        generator: GeneratorDims,
        replica: int,
        tp_rank: int,
        params: Dict[str, torch.Tensor],
        group,
        fp8: bool = False,
        wire_dtype: torch.dtype = torch.bfloat16,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        verify: bool = False,
        plan: SyncPlan | None = None,
        ipc_peers: Optional[Set[int]] = None,
        norm_names: str = "local",
    ):
        self.plan = plan or build_plan(spec, trainer, generator, norm_names)
        self.sync_rank = generator_rank(trainer, generator, replica, tp_rank)
        self.receiver = WeightReceiver(
            self.plan, self.sync_rank, group, params, fp8, wire_dtype, bucket_bytes, verify, ipc_peers
        )

    @torch.no_grad()
    def pull(self, expected_version: int | None = None) -> SyncStats:
        return self.receiver.receive(expected_version)
