"""Process-group and Megatron parallel-state set-up for one rank.

Works the same under torchrun (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set),
under megarl.runtime.launch (which sets them), or alone (a world of one). On a
machine without a usable GPU it activates the CPU backend from
megatron_patches and uses gloo; with GPUs it uses NCCL and never patches.
"""

from __future__ import annotations

import atexit
import datetime
import os

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as _c10d

import megatron_patches
from megarl.parallel_dims import ParallelDims
from megarl.runtime.cpu_memory import keep_freed_memory
from megarl.runtime.ports import free_port  # noqa: F401  (re-exported: tests and tools import it here)

# Megatron-Core is imported inside init_megatron and shutdown: every rank imports this module
# (loop/controller.py), and a generator rank on GPUs never needs Megatron-Core before its exit;
# so does every `megarl` command (cli.py -> convert/cli.py). Megatron-Core's import costs 1.3-1.5 s
# of CPU beyond torch's (measured 2026-12-03).


def init_distributed(timeout_minutes: float = 10.0) -> int:
    """Initialise torch.distributed (idempotent) and return this rank."""
    if not torch.cuda.is_available():
        megatron_patches.apply_cpu_backend()
        keep_freed_memory()
    if dist.is_initialized():
        return dist.get_rank()
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=timeout_minutes))
    # Without this gloo aborts at interpreter exit and torchrun reports a failure.
    atexit.register(shutdown)
    return dist.get_rank()


# The process groups the last init_megatron created (destroyed by the next one and at shutdown).
_MEGATRON_GROUPS: list = []


def _destroy_groups(groups: list) -> None:
    for group in groups:
        if group in _c10d._world.pg_map:
            dist.destroy_process_group(group)
    groups.clear()


def world_dims(tp: int = 1, pp: int = 1, vpp: int = 1, cp: int = 1) -> ParallelDims:
    """ParallelDims over this process's whole world: data parallel over what the other dimensions
    leave (as Megatron-Core derives it)."""
    world, model = dist.get_world_size(), tp * pp * cp
    if world % model:
        raise ValueError(f"world size {world} is not divisible by TP {tp} x PP {pp} x CP {cp}")
    return ParallelDims(tp=tp, pp=pp, dp=world // model, cp=cp, vpp=vpp)


def init_megatron(dims: ParallelDims, seed: int = 1234) -> None:
    """(Re)initialise Megatron's parallel state for ``dims`` over the whole world (this process's
    default group: the trainer's ranks in a job)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    world = dist.get_world_size()
    if world != dims.world_size:
        raise ValueError(f"{dims.describe()} is {dims.world_size} ranks; this world has {world}")
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    # destroy_model_parallel only forgets Megatron's groups; torch keeps every one alive.
    # A process that re-initialises for layout after layout (tests, tools) would pile them
    # up: measured, 8 gloo ranks slowed up to ~50x per weight-sync round after 12 layouts.
    _destroy_groups(_MEGATRON_GROUPS)
    before = set(_c10d._world.pg_map)
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.virtual_pipeline_model_parallel_size,
        context_parallel_size=dims.cp,
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=dims.etp,
    )
    _MEGATRON_GROUPS[:] = [g for g in _c10d._world.pg_map if g not in before]
    _check_groups(dims, mpu)
    model_parallel_cuda_manual_seed(seed)


def _check_groups(dims: ParallelDims, mpu) -> None:
    """This rank's Megatron groups are the ones ParallelDims computes (the topology, the weight-sync
    planner and plan/ use its formulas): a Megatron-Core whose rank order changed fails here."""
    rank = dist.get_rank()
    groups = {
        "tp": mpu.get_tensor_model_parallel_group(),
        "pp": mpu.get_pipeline_model_parallel_group(),
        "dp": mpu.get_data_parallel_group(),
        "cp": mpu.get_context_parallel_group(),
        "dp-cp": mpu.get_data_parallel_group(with_context_parallel=True),
    }
    for token, group in groups.items():
        ours = next(g for g in dims.groups(token) if rank in g)
        theirs = dist.get_process_group_ranks(group)
        if ours != theirs:
            raise RuntimeError(
                f"rank {rank}: Megatron-Core's {token} group is {theirs}, megarl.parallel_dims computes {ours} "
                f"for {dims.describe()}"
            )


def shutdown() -> None:
    if not dist.is_initialized():
        return
    try:
        from megatron.core import parallel_state as mpu

        mpu.destroy_model_parallel()
    except ImportError:  # pragma: no cover
        pass
    _MEGATRON_GROUPS.clear()
    dist.destroy_process_group()
