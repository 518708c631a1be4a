"""One process of a megarl job: its executor's process group and the job-wide control group.

Launched by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set; many
nodes) or by ``megarl train`` itself on one machine (local spawn). Global
rank 0 hosts one TCP store on MASTER_PORT + 1; every group is built on a
prefix of it:

    default group   the ranks of this process's executor: the trainer's world
                    (Megatron's parallel state is built over it) or the
                    generators' (their TP groups are subgroups of it)
    control         gloo, all ranks: the channels (loop/channels.py)
    weight sync     trainer + generator ranks when the generators' engines are in
                    this world (async, torch engine): NCCL on GPUs, gloo on CPU or
                    where ranks share a GPU (their bytes then go through CUDA IPC);
                    with SGLang servers the trainer ranks form it with the servers'
                    workers instead (loop/wiring.py)

Which ranks form which executor, and whether this rank may use a GPU, is the
caller's (loop/wiring.py): this module knows no run mode and no generator
backend.

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
from typing import Optional, Sequence

import torch
import torch.distributed as dist

import megatron_patches
from megarl.runtime.cpu_memory import keep_freed_memory
from megarl.runtime.ports import free_port
from megarl.runtime.rendezvous import init_sync_group


@dataclass
class Job:
    rank: int
    world_size: int
    store: object
    control: object
    sync_group: Optional[object] = None
    device: str = "cpu"
    local_rank: int = 0
    shared_devices: bool = False  # more ranks than GPUs on this node


def init_job(
    world_size: int,
    executor: str,
    executor_ranks: Sequence[int],
    uses_gpu: bool = True,
    weight_sync_group: bool = False,
    timeout_s: float = 600.0,
) -> Job:
    """This process's groups. ``executor``/``executor_ranks``: the executor this rank belongs to and
    its global ranks (its default group); ``uses_gpu``: False for a rank that must leave the GPUs to
    others (an SGLang server's driver); ``weight_sync_group``: form the in-world weight-sync group."""
    if "RANK" not in os.environ:  # a one-process job run in place
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != world_size:
        raise RuntimeError(f"launched with WORLD_SIZE={world}, the config needs {world_size} ranks")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    shared = gpus > 0 and int(os.environ.get("LOCAL_WORLD_SIZE", world)) > gpus
    cuda = gpus > 0 and uses_gpu
    if cuda:
        torch.cuda.set_device(local_rank % gpus)
    else:
        megatron_patches.apply_cpu_backend()
        keep_freed_memory()
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    members = list(executor_ranks)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=dist.PrefixStore(executor, store),
        rank=members.index(rank),
        world_size=len(members),
        timeout=timeout,
    )
    control = init_sync_group(
        host, port, world, rank, group_name="megarl_control", backend="gloo", timeout_s=timeout_s, store=store
    )
    sync = None
    if weight_sync_group:
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
    return Job(rank, world, store, control, sync, "cuda" if cuda else "cpu", local_rank, shared)
