"""One process of a megarl job: its executors' process groups and the job-wide control group.

Launched by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set; many
nodes) or by ``megarl train`` itself on one machine (local spawn). Global
rank 0 hosts one TCP store on MASTER_PORT + 1; every group is built on a
prefix of it:

    default group   the ranks of this process's executor: the trainer's world
                    (Megatron's parallel state is built over it) or the
                    generators' (their TP groups are subgroups of it)
    control         gloo, all ranks: the channels (topology.py)
    weight sync     trainer + generator ranks (async, torch engine): NCCL on
                    GPUs, gloo on CPU or where ranks share a GPU (their bytes
                    then go through CUDA IPC); with SGLang servers the trainer
                    ranks form it with the servers' workers instead
                    (weight_sync/factory.py)

GPUs: rank with local rank L uses GPU L mod (GPUs on the node): more ranks
than GPUs (a one-GPU check) share devices, which ``shared_devices`` records.
Generator ranks that drive SGLang servers never touch a GPU: the servers'
own workers own them.

A collective that waits on a dead peer fails after ``timeout_s`` at worst;
the launcher ends the job as soon as any process exits with an error.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megarl.topology import Topology


@dataclass
class Job:
    rank: int
    world_size: int
    topology: Topology
    store: object
    control: object
    sync_group: Optional[object] = None
    device: str = "cpu"
    local_rank: int = 0
    shared_devices: bool = False  # more ranks than GPUs on this node

    def has(self, role: str) -> bool:
        return self.rank in self.topology.executors[role]


def init_job(topology: Topology, timeout_s: float = 600.0) -> Job:
    from megarl.runtime.distributed import free_port
    from megarl.weight_sync.rendezvous import init_sync_group

    if "RANK" not in os.environ:  # a one-process job run in place
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != topology.world_size:
        raise RuntimeError(f"launched with WORLD_SIZE={world}, the config needs {topology.world_size} ranks")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    role = "trainer" if rank in topology.executors["trainer"] else "generator"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    shared = gpus > 0 and int(os.environ.get("LOCAL_WORLD_SIZE", world)) > gpus
    cuda = gpus > 0 and not (role == "generator" and topology.generator_backend == "sglang")
    if cuda:
        torch.cuda.set_device(local_rank % gpus)
    else:
        import megatron_patches
        from megarl.runtime.cpu_memory import keep_freed_memory

        megatron_patches.apply_cpu_backend()
        keep_freed_memory()
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    # this executor's own world: trainer ranks first, then generators (async); all ranks (sync)
    members = topology.executors[role]
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=dist.PrefixStore(role, store),
        rank=members.index(rank),
        world_size=len(members),
        timeout=timeout,
    )
    control = init_sync_group(
        host, port, world, rank, group_name="megarl_control", backend="gloo", timeout_s=timeout_s, store=store
    )
    sync = None
    if topology.mode == "async" and topology.generator_backend == "torch":
        sync = init_sync_group(
            host,
            port,
            world,
            rank,
            group_name="megarl_weight_sync",
            timeout_s=timeout_s,
            store=store,
            backend="gloo" if shared or not cuda else "nccl",
        )
    return Job(rank, world, topology, store, control, sync, "cuda" if cuda else "cpu", local_rank, shared)
