"""Build one rank's WeightSynchronizer of each kind (the wiring, loop/wiring.py, picks which).

    colocated_copy      sync mode, every rank: ColocatedCopy into its own engine
    in_world_sender     a trainer rank whose generators are ranks of the job (torch engine):
                        ShardToShardSender over the job's weight-sync group
    in_world_receiver   such a generator rank: EngineShardReceiver (same group)
    external_sender     a trainer rank whose generators' workers are outside the job (SGLang):
                        ShardToShardSender over a group formed with them at the first sync, at a
                        TCP store the workers also meet at (``runtime.rendezvous``)

Ranks of the sync group: trainer ranks 0..T-1 in Megatron's order, then generator
replica r's TP rank k at T + r * generator.tp + k (megarl.parallel_dims.generator_rank) --
the same numbers whether the generator ranks are in the job's world or are SGLang
workers outside it, so one plan (planner.py) serves both. Nothing here knows the run
mode or the generator backend.
"""

from __future__ import annotations

import torch

from megarl.layout import disaggregated_world_size
from megarl.parallel_dims import GeneratorDims, ParallelDims, generator_rank
from megarl.runtime.rendezvous import init_sync_group
from megarl.weight_sync.endpoints import GeneratorSync
from megarl.weight_sync.ipc import colocated_peers
from megarl.weight_sync.planner import build_plan
from megarl.weight_sync.synchronizer import ColocatedCopy, EngineShardReceiver, ShardToShardSender


def wire_dtype(generator_dtype: str) -> torch.dtype:
    """Non-fp8 bytes travel in the generator's dtype (generator.dtype): exact for its weights, never wider."""
    return torch.bfloat16 if generator_dtype == "bf16" else torch.float32


def _device(job):
    return torch.device("cuda", torch.cuda.current_device()) if job.device == "cuda" else None


def colocated_copy(spec, chunks, backend, norm_names: str) -> ColocatedCopy:
    return ColocatedCopy(spec, chunks, backend, norm_names)


def in_world_sender(spec, trainer: ParallelDims, generator: GeneratorDims, chunks, job, g, norm_names: str):
    """``g``: the config's GeneratorConfig section (fp8, verify_sync, dtype)."""
    # a collective over the sync group: trainer and generator ranks on one GPU pair up for CUDA IPC
    peers = colocated_peers(job.sync_group, job.rank, _device(job))
    return ShardToShardSender(
        spec,
        trainer,
        generator,
        chunks,
        job.rank,
        g.fp8,
        g.verify_sync,
        wire_dtype(g.dtype),
        connect=lambda: (job.sync_group, peers),
        eager=True,
        norm_names=norm_names,
    )


def in_world_receiver(
    spec, trainer: ParallelDims, generator: GeneratorDims, backend, job, replica: int, tp_rank: int, g, norm_names: str
) -> EngineShardReceiver:
    """A generator rank of the job, its engine's parameters ``backend.params`` filled in place."""
    peers = colocated_peers(job.sync_group, job.rank, _device(job))
    if job.rank != generator_rank(trainer, generator, replica, tp_rank):
        raise RuntimeError(f"rank {job.rank} is not generator replica {replica}'s TP rank {tp_rank} in the sync group")
    receiver = GeneratorSync(
        spec,
        trainer,
        generator,
        replica,
        tp_rank,
        backend.params,
        job.sync_group,
        fp8=g.fp8,
        wire_dtype=wire_dtype(g.dtype),
        verify=g.verify_sync,
        plan=build_plan(spec, trainer, generator, norm_names),
        ipc_peers=peers,
    )
    return EngineShardReceiver(backend, receiver)


def external_sender(
    spec,
    trainer: ParallelDims,
    generator: GeneratorDims,
    chunks,
    job,
    g,
    norm_names: str,
    host: str,
    port: int,
    group_backend: str,
    timeout_s: float,
    group_name: str,
) -> ShardToShardSender:
    """A trainer rank sending to workers outside the job: the group forms at the first sync."""

    def connect():
        group = init_sync_group(
            host,
            port,
            disaggregated_world_size(trainer, generator),
            job.rank,
            group_name=group_name,
            backend=group_backend,
            timeout_s=timeout_s,
        )
        return group, colocated_peers(group, job.rank, _device(job))

    return ShardToShardSender(
        spec,
        trainer,
        generator,
        chunks,
        job.rank,
        g.fp8,
        g.verify_sync,
        wire_dtype(g.dtype),
        connect=connect,
        norm_names=norm_names,
    )
