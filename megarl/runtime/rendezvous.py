"""A process group between trainer ranks and generator workers that are not in one world.

SGLang spawns its own TP worker processes, so they cannot be ranks of the
trainer's torchrun world. Both sides instead meet at a TCP store (host:port)
and build one extra process group over it, the way SGLang's
``init_weights_update_group`` does (``init_custom_process_group``): ranks are
numbered in the sync group only (trainer ranks first, then generator workers),
independent of each side's own world. Each side calls ``init_sync_group``
with the same host, port, world size and group name.

NCCL on GPUs, gloo on CPU. The group is registered with torch.distributed so
the standard point-to-point API (``batch_isend_irecv``) works on it.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world


def init_sync_group(
    host: str,
    port: int,
    world_size: int,
    rank: int,
    group_name: str = "megarl_weight_sync",
    backend: str | None = None,
    timeout_s: float = 300.0,
    store=None,
):
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:  # else: a store the caller already shares (e.g. the job's, on global rank 0)
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, timeout=timeout
    )
    # Identity rank mapping: P2P ops on this group address peers by sync-group rank.
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_sync_group(group) -> None:
    dist.destroy_process_group(group)
