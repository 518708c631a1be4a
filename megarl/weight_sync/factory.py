"""Build each rank's WeightSynchronizer from its role, the run mode and the generator backend.

The one place that knows how weights travel in each kind of run:

    sync mode                      every rank: ColocatedCopy into its own engine
    async, generator.backend=torch trainer ranks: ShardToShardSender over the job's sync group
                                   generator ranks: EngineShardReceiver (same group)
    async, generator.backend=sglang
                                   trainer ranks: ShardToShardSender over a group formed with the
                                   servers' TP workers at the first sync (a TCP store on trainer
                                   rank 0's host, MASTER_PORT + 2 unless generator.sglang_sync_port);
                                   trainer rank 0 writes RUN_DIR/sglang/sync_config.json for them,
                                   and, when the job launches the servers, the trainer ranks first
                                   save the policy the servers start from (generator/sglang/launch.py)
                                   replica driver ranks: SglangShardReceiver; other ranks: NoWeights

Ranks of the sync group: trainer ranks 0..T-1 in Megatron's order, then
generator replica r's TP rank k at T + r * generator.tp + k -- the same
numbers whether the generator ranks are in the job's world or are SGLang
workers outside it, so one plan (planner.py) serves both.
"""

from __future__ import annotations

import os

import torch

from megarl.weight_sync.synchronizer import (
    ColocatedCopy,
    EngineShardReceiver,
    NoWeights,
    SglangShardReceiver,
    ShardToShardSender,
    WeightSynchronizer,
)


def wire_dtype(g) -> torch.dtype:
    """Non-fp8 bytes travel in the generator's dtype: exact for its weights, never wider."""
    return torch.bfloat16 if g.dtype == "bf16" else torch.float32


def topologies(cfg, norm_names: str = "local"):
    from megarl.weight_sync.planner import GeneratorTopology, TrainerTopology

    t, g = cfg.trainer, cfg.generator
    trainer = TrainerTopology(t.tp, t.pp, t.dp, norm_names=norm_names, vp=t.vpp if t.vpp > 1 else None)
    return trainer, GeneratorTopology(g.tp, g.replicas, first_rank=trainer.size)


def sglang_rendezvous(cfg) -> tuple:
    """(host, port) of the weight-sync store the trainer ranks and the SGLang workers meet at."""
    g = cfg.generator
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = g.sglang_sync_port or int(os.environ.get("MASTER_PORT", "29500")) + 2
    return host, port


def make_weight_synchronizer(cfg, job, spec, trainer=None, generator=None) -> WeightSynchronizer:
    """``trainer`` / ``generator``: this rank's executors (None where it has none)."""
    g = cfg.generator
    norm_names = trainer.norm_names if trainer is not None else "local"
    if cfg.run.mode == "sync":
        return ColocatedCopy(spec, trainer.chunks, generator.backend, norm_names)
    trainer_topo, gen_topo = topologies(cfg, norm_names)
    if g.backend == "sglang":
        return _sglang(cfg, job, spec, trainer, generator, trainer_topo, gen_topo)
    return _in_world(cfg, job, spec, trainer, generator, trainer_topo, gen_topo)


def _device(job):
    return torch.device("cuda", torch.cuda.current_device()) if job.device == "cuda" else None


def _in_world(cfg, job, spec, trainer, generator, trainer_topo, gen_topo) -> WeightSynchronizer:
    from megarl.weight_sync.endpoints import GeneratorSync
    from megarl.weight_sync.ipc import colocated_peers
    from megarl.weight_sync.planner import build_plan

    g = cfg.generator
    # a collective over the sync group: trainer and generator ranks on one GPU pair up for CUDA IPC
    peers = colocated_peers(job.sync_group, job.rank, _device(job))
    if trainer is not None:
        return ShardToShardSender(
            spec,
            trainer_topo,
            gen_topo,
            trainer.chunks,
            job.rank,
            g.fp8,
            g.verify_sync,
            wire_dtype(g),
            connect=lambda: (job.sync_group, peers),
            eager=True,
        )
    replica, tp_rank = job.topology.replica_of(job.rank)
    receiver = GeneratorSync(
        spec,
        trainer_topo,
        gen_topo,
        replica,
        tp_rank,
        generator.backend.params,
        job.sync_group,
        fp8=g.fp8,
        wire_dtype=wire_dtype(g),
        verify=g.verify_sync,
        plan=build_plan(spec, trainer_topo, gen_topo),
        ipc_peers=peers,
    )
    return EngineShardReceiver(generator.backend, receiver)


def _sglang(cfg, job, spec, trainer, generator, trainer_topo, gen_topo) -> WeightSynchronizer:
    from megarl.generator.sglang import serving

    g = cfg.generator
    if trainer is not None:
        host, port = sglang_rendezvous(cfg)
        backend = "nccl" if job.device == "cuda" and not job.shared_devices else "gloo"
        timeout_s = g.sglang_startup_timeout_s + 600.0  # the first sync waits for the servers to start
        first = job.rank == job.topology.executors["trainer"][0]
        if first:
            serving.write_sync_config(
                serving.sync_config_path(cfg.run.output_dir),
                spec,
                trainer_topo,
                gen_topo,
                host,
                port,
                g.fp8,
                verify=g.verify_sync,
                backend=backend,
                timeout_s=timeout_s,
                wire_dtype=g.dtype,
            )
        if not g.sglang_urls:
            from megarl.generator.sglang.launch import publish_policy

            publish_policy(trainer.chunks, spec, cfg.run.output_dir, job.store, trainer.tokenizer_files, first)

        def connect():
            from megarl.weight_sync.ipc import colocated_peers
            from megarl.weight_sync.rendezvous import init_sync_group

            group = init_sync_group(
                host,
                port,
                trainer_topo.size + gen_topo.size,
                job.rank,
                group_name=serving.SYNC_GROUP_NAME,
                backend=backend,
                timeout_s=timeout_s,
            )
            return group, colocated_peers(group, job.rank, _device(job))

        return ShardToShardSender(
            spec, trainer_topo, gen_topo, trainer.chunks, job.rank, g.fp8, g.verify_sync, wire_dtype(g), connect=connect
        )
    if generator is not None:
        return SglangShardReceiver(generator.backend, g.tp, serving.WORKER_LOADER)
    return NoWeights()
