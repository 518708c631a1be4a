"""Build one rank's WeightSynchronizer of each kind (the wiring, loop/wiring.py, picks which).

    sync_settings       the config's reading, in one place: SyncSettings (settings.py) -- the
                        trainer's and the generators' layouts, the wire format -- that every
                        endpoint below takes

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

from megarl.config import Config
from megarl.models.spec import ModelSpec
from megarl.weight_sync.endpoints import GeneratorSync
from megarl.weight_sync.ipc import colocated_peers
from megarl.weight_sync.settings import SyncGeometry, SyncRendezvous, SyncSettings, WireFormat
from megarl.weight_sync.synchronizer import ColocatedCopy, EngineShardReceiver, ShardToShardSender


def sync_settings(cfg: Config, spec: ModelSpec, norm_names: str = "local") -> SyncSettings:
    """The weight sync of a disaggregated run, as the config sets it: from the trainer's layout
    (``norm_names``: its layer spec's, "local" | "te") to the generators', in block fp8 or the
    generator's dtype (generator.fp8, generator.dtype), checksummed when generator.verify_sync."""
    layout, g = cfg.layout(), cfg.generator
    geometry = SyncGeometry(spec, layout.trainer, layout.generator, norm_names)
    # the engine's dtype, as generator/factory.py allocates it: exact for its weights, never wider
    wire_dtype = torch.bfloat16 if g.dtype == "bf16" else torch.float32
    return SyncSettings(geometry, WireFormat(fp8=g.fp8, dtype=wire_dtype, verify=g.verify_sync))


def _device(job):
    return torch.device("cuda", torch.cuda.current_device()) if job.device == "cuda" else None


def colocated_copy(spec, chunks, backend, norm_names: str) -> ColocatedCopy:
    return ColocatedCopy(spec, chunks, backend, norm_names)


def in_world_sender(settings: SyncSettings, chunks, job) -> ShardToShardSender:
    """A trainer rank whose generators are ranks of the job, over the job's sync group."""
    # a collective over the sync group: trainer and generator ranks on one GPU pair up for CUDA IPC
    peers = colocated_peers(job.sync_group, job.rank, _device(job))
    return ShardToShardSender(settings, chunks, job.rank, connect=lambda: (job.sync_group, peers), eager=True)


def in_world_receiver(settings: SyncSettings, backend, job, replica: int, tp_rank: int) -> EngineShardReceiver:
    """A generator rank of the job, its engine's parameters ``backend.params`` filled in place."""
    peers = colocated_peers(job.sync_group, job.rank, _device(job))
    if job.rank != settings.geometry.generator_rank(replica, tp_rank):
        raise RuntimeError(f"rank {job.rank} is not generator replica {replica}'s TP rank {tp_rank} in the sync group")
    receiver = GeneratorSync(settings, replica, tp_rank, backend.params, job.sync_group, ipc_peers=peers)
    return EngineShardReceiver(backend, receiver)


def external_sender(settings: SyncSettings, chunks, job, rendezvous: SyncRendezvous) -> ShardToShardSender:
    """A trainer rank sending to workers outside the job: the group forms at the first sync."""

    def connect():
        group = rendezvous.join(settings.geometry.world_size, job.rank)
        return group, colocated_peers(group, job.rank, _device(job))

    return ShardToShardSender(settings, chunks, job.rank, connect=connect)
