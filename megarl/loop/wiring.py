"""Wires a rank from the run's layout (megarl/layout.py: what run.mode and generator.backend mean).

Everything a rank runs is built here, in the order the collectives between ranks need:

    topology        the layout's: disaggregated (async: trainer ranks, then generator ranks) or
                    colocated (sync: every rank trains and generates); with SGLang a replica's
                    first rank drives its server and the others stand by (drivers_only)
    job             this rank's process groups (runtime/job.py): the in-world weight-sync group
                    exists only where torch engines are ranks of the job
    trainer         TrainerExecutor on trainer ranks, its lag bound (rollout.max_lag async, 0 sync)
    resume point    broadcast from rank 0 (a collective: before any generator waits on the trainer)
    generator       the backend (torch engine or SGLang server), GeneratorExecutor, reward
                    executor, batch maker, evaluator on generator ranks
    schedule        AsyncSchedule | SyncSchedule (loop/schedule.py)
    weights         the WeightSynchronizer of this rank's role (weight_sync/factory.py builds it;
                    the SGLang-side files -- the workers' sync config, the policy the launched
                    servers start from -- are written here, so weight_sync knows no SGLang)

The controller (controller.py) receives a ``Rank`` and never asks for the mode or the backend.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.distributed as dist

from megarl.checkpointing.resume import resumable_checkpoint_dir
from megarl.config import Config, config_from_dict, eval_sets
from megarl.data.datasets import load_records, tokenize_prompts
from megarl.data.random_tokens import random_token_prompts
from megarl.environments.factory import episode_backend, prompt_renderer
from megarl.executors.evaluator import ReplicaEvaluator
from megarl.executors.generator import GeneratorExecutor
from megarl.executors.reward import RewardExecutor
from megarl.executors.trainer import TrainerExecutor
from megarl.generator import factory as backends
from megarl.generator.interface import GeneratorBackend
from megarl.generator.sglang import launch as sglang_launch
from megarl.generator.sglang import serving as sglang_serving
from megarl.generator.sglang.protocol import RoutedExpertsLayout
from megarl.generator.tokenizer import load_tokenizer, stop_ids
from megarl.layout import WEIGHTS, Topology
from megarl.loop.batch import BatchMaker
from megarl.loop.channels import Channel
from megarl.loop.loop_state import ResumePoint, resume_point
from megarl.loop.schedule import AsyncSchedule, Schedule, SyncSchedule
from megarl.models.spec import ModelSpec
from megarl.runtime.cpu_dtype import resolve_auto_dtypes
from megarl.runtime.failure import fail_rank
from megarl.runtime.heartbeat import Heartbeat
from megarl.runtime.job import Job, init_job
from megarl.weight_sync import factory as weights
from megarl.weight_sync.settings import SyncRendezvous
from megarl.weight_sync.synchronizer import NoWeights, SglangShardReceiver, WeightSynchronizer

CHECKPOINTS = "checkpoints"


def concrete_config(cfg_dict: dict) -> Config:
    """The rank's config with no ``auto`` dtype left: `megarl train` resolves it before the launch
    (and says so); a caller that starts ranks itself gets the same resolution here."""
    cfg = config_from_dict(cfg_dict)
    resolve_auto_dtypes(cfg)
    return cfg


def schedule(cfg: Config) -> Schedule:
    """When the loop generates, trains and syncs (loop/schedule.py)."""
    if cfg.layout().colocated:
        r = cfg.rollout
        return SyncSchedule(cfg.trainer.updates_per_batch, r.prompts_per_step * r.samples_per_prompt)
    return AsyncSchedule(
        generate_while_waiting=cfg.generator.generate_while_waiting, inflight_updates=cfg.generator.inflight_updates
    )


def collective_timeout_s(cfg: Config) -> float:
    """How long a collective may wait for a peer: the first weight sync waits for SGLang
    servers to start (launched: the checkpoint's conversion and the load included)."""
    g = cfg.generator
    if cfg.layout().server_generators:
        return max(600.0 + 2 * g.sglang_startup_timeout_s, cfg.run.hang_timeout_s + 120)
    # the hang watchers (runtime/heartbeat.py) speak first, with a better message than a timeout
    return max(600.0, cfg.run.hang_timeout_s + 120)


def sglang_rendezvous(cfg: Config) -> tuple:
    """(host, port) of the weight-sync store the trainer ranks and the SGLang workers meet at."""
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = cfg.generator.sglang_sync_port or int(os.environ.get("MASTER_PORT", "29500")) + 2
    return host, port


def load_prompts(cfg: Config, tokenizer, vocab_size: int, source: Optional[str] = None) -> list:
    """Tokenized prompts of ``source`` (default data.train)."""
    source = source or cfg.data.train
    if source.startswith("random:"):  # token ids: no tokenizer involved
        return random_token_prompts(source, vocab_size, cfg.data.max_prompt_tokens)
    render = prompt_renderer(cfg.rollout, tokenizer)  # rollout.tools: the tools described in every prompt
    return tokenize_prompts(load_records(source), tokenizer, cfg.data.max_prompt_tokens, render)


@dataclass
class Rank:
    """Everything one rank runs, wired."""

    cfg: Config
    topo: Topology
    job: Job
    heartbeat: Heartbeat
    spec: ModelSpec
    schedule: Schedule
    resume: ResumePoint
    channels: Dict[str, Channel]
    weights: WeightSynchronizer
    trainer: Optional[TrainerExecutor] = None
    generator: Optional[GeneratorExecutor] = None  # this rank's generator executor (None: none here)
    # the engine the weights go into: the generator's backend, or the one under its episodes (multi-turn)
    engine: Optional[GeneratorBackend] = None
    reward: Optional[RewardExecutor] = None
    batch_maker: Optional[BatchMaker] = None
    evaluator: Optional[ReplicaEvaluator] = None
    run_mode: str = "async"  # run.mode, as the metrics record names it (nothing branches on it)

    @property
    def out(self) -> Path:
        return Path(self.cfg.run.output_dir)

    @property
    def groups_per_replica(self) -> int:
        return self.cfg.rollout.prompts_per_step // self.topo.generator.replicas

    @property
    def verifies_sync(self) -> bool:
        """Whether each sync's landed shards are checksummed (generator.verify_sync; async only)."""
        return self.cfg.generator.verify_sync and self.schedule.verifies_sync

    def close(self) -> None:
        """Stop what the generators hold (threads, launched servers)."""
        self.heartbeat.close()
        self.weights.close()
        if self.generator is not None:
            self.generator.close()


def wire_rank(cfg: Config, prepared) -> Rank:
    layout = cfg.layout()
    topo = layout.topology()
    rank = int(os.environ.get("RANK", "0"))
    executor = "trainer" if topo.has(rank, "trainer") else "generator"
    job = init_job(
        topo.world_size,
        executor,
        topo.executors[executor],
        # an SGLang server's driver leaves the GPUs to the server's own workers
        uses_gpu=not (executor == "generator" and layout.server_generators),
        weight_sync_group=not layout.colocated and not layout.server_generators,
        timeout_s=collective_timeout_s(cfg),
    )
    heartbeat = Heartbeat(job.store, job.rank, job.world_size, _role(topo, job.rank), cfg.run.hang_timeout_s)
    _set_cpu_threads(cfg, job, executor)
    spec = ModelSpec.from_dict(prepared.spec)
    # the newest checkpoint whose files match its manifest (all ranks share the checksums);
    # each newer, damaged one is named in a warning
    resume_dir = resumable_checkpoint_dir(Path(cfg.run.output_dir) / CHECKPOINTS, group=job.control)
    trainer = None
    if topo.has(job.rank, "trainer"):
        trainer = TrainerExecutor(cfg, prepared, resume_dir, layout.lag_bound, on_gpu=job.device == "cuda")
    # where a resumed run continues (loop_state.py): rank 0 is a trainer rank and read the checkpoint
    box = [resume_point(trainer.loop_state) if job.rank == 0 else None]
    dist.broadcast_object_list(box, group=job.control, group_src=0)
    resume: ResumePoint = box[0]
    parts = Rank(
        cfg, topo, job, heartbeat, spec, schedule(cfg), resume, {}, NoWeights(), trainer=trainer, run_mode=cfg.run.mode
    )
    if topo.has(job.rank, "generator"):
        _wire_generator(parts, prepared)
    parts.channels = {c.name: Channel(c, job.rank, job.control) for c in topo.channels if c.kind != WEIGHTS}
    # the weights channel: how the policy travels is the synchronizer's business alone
    parts.weights = _weight_synchronizer(parts)
    return parts


def _role(topo: Topology, rank: int) -> str:
    if topo.has(rank, "trainer"):
        return "trainer"
    replica, tp_rank = topo.replica_of(rank)
    return f"generator replica {replica}, TP rank {tp_rank}"


def _set_cpu_threads(cfg: Config, job: Job, executor: str) -> None:
    """On CPU, ranks share the cores: an async trainer that is busier than its generator may
    take more threads than an even split (the generator's core is idle while it waits)."""
    if job.device != "cpu":
        return
    n = cfg.trainer.cpu_threads if executor == "trainer" else cfg.generator.cpu_threads
    if n:
        torch.set_num_threads(n)


def _wire_generator(parts: Rank, prepared) -> None:
    cfg, job, topo = parts.cfg, parts.job, parts.topo
    replica, tp_rank = topo.replica_of(job.rank)
    tp_group = None
    if topo.generator.tp > 1 and not topo.drivers_only:  # the engines' TP groups, in the generators' world
        first = topo.executors["generator"][0]
        for ranks in topo.generator_tp_groups():  # every generator rank creates every group
            group = dist.new_group([r - first for r in ranks])
            if job.rank in ranks:
                tp_group = group
    if not topo.runs_generator(job.rank):
        return  # an SGLang replica's other ranks: its server's workers use their GPUs
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    place = backends.GeneratorRank(
        topo.generator,
        replica,
        tp_rank,
        tp_group,
        job.device,
        local_rank=job.local_rank % gpus if gpus else job.local_rank,
    )
    g = cfg.generator
    if cfg.layout().server_generators:
        backend = backends.sglang_backend(
            g,
            place,
            cfg.rollout.samples_per_prompt,
            run_dir=parts.out,
            store=job.store,
            on_failure=fail_rank,
            routes=RoutedExpertsLayout.of(parts.spec) if cfg.trainer.moe_enable_routing_replay else None,
        )
    else:
        backend = backends.torch_engine_backend(g, parts.spec, place)
    tokenizer = load_tokenizer(prepared.tokenizer)
    parts.engine = backend
    backend = episode_backend(cfg.rollout, backend, tokenizer, g.max_seq_len)  # multi-turn: episodes over it
    generator = GeneratorExecutor(
        cfg.rollout,
        g.max_running,
        cfg.run.seed,
        backend,
        load_prompts(cfg, tokenizer, parts.spec.vocab_size),
        stop_ids(tokenizer),
        replica,
        parts.groups_per_replica,
        tp_rank,
        tp_group,
    )
    generator.on_step = lambda waiting=False: parts.heartbeat.beat(
        "waiting for the trainer's step" if waiting else "decoding", waiting=waiting
    )
    if parts.resume.generators:
        generator.load_state_dict(parts.resume.generators[replica])
    reward = RewardExecutor(cfg, tokenizer) if topo.has(job.rank, "reward") else None
    parts.generator, parts.reward = generator, reward
    parts.batch_maker = BatchMaker(
        generator, reward, cfg.rollout.filter_groups, cfg.rollout.samples_per_prompt, tp_group
    )
    if cfg.data.eval:
        parts.evaluator = ReplicaEvaluator(
            cfg.data,
            generator,
            reward,
            {name: load_prompts(cfg, tokenizer, parts.spec.vocab_size, spec) for name, spec in eval_sets(cfg.data)},
            replica,
            topo.generator.replicas,
            job.store,
            reward is not None,
        )


def _weight_synchronizer(parts: Rank) -> WeightSynchronizer:
    cfg, job, topo, spec, trainer = parts.cfg, parts.job, parts.topo, parts.spec, parts.trainer
    g = cfg.generator
    norm_names = trainer.norm_names if trainer is not None else "local"
    layout = cfg.layout()
    if layout.colocated:
        return weights.colocated_copy(spec, trainer.chunks, parts.engine, norm_names)
    settings = weights.sync_settings(cfg, spec, norm_names)
    if not layout.server_generators:
        if trainer is not None:
            return weights.in_world_sender(settings, trainer.chunks, job)
        replica, tp_rank = topo.replica_of(job.rank)
        return weights.in_world_receiver(settings, parts.engine, job, replica, tp_rank)
    if trainer is not None:
        host, port = sglang_rendezvous(cfg)
        rendezvous = SyncRendezvous(
            host,
            port,
            backend="nccl" if job.device == "cuda" and not job.shared_devices else "gloo",
            timeout_s=g.sglang_startup_timeout_s + 600.0,  # the first sync waits for the servers to start
            group_name=sglang_serving.SYNC_GROUP_NAME,
        )
        first = job.rank == topo.first_trainer_rank
        if first:  # the servers' workers read how to join and what they receive
            sglang_serving.write_sync_config(sglang_serving.sync_config_path(cfg.run.output_dir), settings, rendezvous)
        if not g.sglang_urls:  # launched servers start from the trainer's policy
            sglang_launch.publish_policy(
                trainer.chunks, spec, cfg.run.output_dir, job.store, trainer.tokenizer_files, first
            )
        return weights.external_sender(settings, trainer.chunks, job, rendezvous)
    if parts.generator is not None:
        return SglangShardReceiver(parts.engine, g.tp, sglang_serving.WORKER_LOADER)
    return NoWeights()
