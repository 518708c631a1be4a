"""Trainer side of the weight-sync tests: real Megatron GPTModel shards sent over a
TCP-store sync group to generator workers living in another torchrun world.

    torchrun --nproc-per-node 8 tests/workers/weight_sync_trainer.py --port P --generators 4 \
        --models DIR ... --layouts 1x1 2x1 ... --dst-tps 1 2 4 [--fp8] [--pack-below N ...] [--baseline]

``--pack-below`` thresholds are used in turn, case by case (both sides walk the
same cases); ``--baseline`` runs baseline.py (slime's gather + per-stage
broadcast) instead of megarl's sync.
"""

import argparse
import datetime
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch.distributed as dist  # noqa: E402
from lm_batch import parse_layout  # noqa: E402
from weight_sync_cases import cases  # noqa: E402

from megarl.checkpointing.model_loading import load_megatron_model  # noqa: E402
from megarl.parallel_dims import GeneratorDims
from megarl.runtime.distributed import init_distributed, init_megatron, shutdown  # noqa: E402
from megarl.runtime.rendezvous import destroy_sync_group, init_sync_group  # noqa: E402
from megarl.weight_sync.endpoints import TrainerSync, megatron_params  # noqa: E402
from megarl.weight_sync.settings import SyncGeometry, SyncSettings, WireFormat  # noqa: E402
from megarl.weight_sync.transport import WeightSender  # noqa: E402


def main():
    args = parse()
    rank = init_distributed()
    world = dist.get_world_size()
    store, group = sync_group(args, rank, world + args.generators)
    version = 0
    loaded = None
    for case in cases(args, world):
        key = (case.model, case.layout)
        if loaded is None or loaded[0] != key:
            layout = parse_layout(case.layout)
            init_megatron(layout)
            spec, chunks = load_megatron_model(case.model, layout)
            loaded = (key, spec, chunks)
        _, spec, chunks = loaded
        trainer = parse_layout(case.layout)  # over this world of trainer ranks
        generator = GeneratorDims(tp=case.dst_tp, replicas=args.generators // case.dst_tp, ep=case.dst_ep)
        version += 1
        if args.baseline:
            run_baseline(args, spec, trainer, chunks, rank, case, version, store)
            continue
        ipc_peers = set(range(world, world + args.generators)) if args.ipc else None
        settings = case_settings(args, spec, trainer, generator, case, version)
        plan = settings.geometry.plan()
        if pack_threshold(args, version) is None:
            TrainerSync(settings, chunks, group, rank, plan=plan, ipc_peers=ipc_peers).push(version)
        else:
            WeightSender(plan, rank, group, megatron_params(chunks), settings.wire, ipc_peers).send(version)
    dist.barrier(group=group)
    shutdown()


def sync_group(args, sync_rank: int, size: int):
    """The sync group over a TCP store (hosted by sync rank 0) that the baseline's groups share."""
    store = dist.TCPStore(
        "127.0.0.1", args.port, size, is_master=sync_rank == 0, timeout=datetime.timedelta(seconds=300)
    )
    return store, init_sync_group("127.0.0.1", args.port, size, sync_rank, store=store)


def stage_group(store, version: int, stage: int, generators: int, rank_in_group: int):
    return init_sync_group(
        "127.0.0.1", 0, 1 + generators, rank_in_group, group_name=f"baseline{version}-pp_{stage}", store=store
    )


def case_settings(args, spec, trainer, generator, case, version: int) -> SyncSettings:
    """Case number ``version``'s settings: checksums on, --bucket-bytes, the case's fp8 and dtype,
    and its pack threshold (None: the default)."""
    pack_below = pack_threshold(args, version)
    wire = WireFormat(fp8=case.fp8, dtype=case.dtype, bucket_bytes=args.bucket_bytes, verify=True)
    if pack_below is not None:
        wire = replace(wire, pack_below_bytes=pack_below)
    return SyncSettings(SyncGeometry(spec, trainer, generator), wire)


def pack_threshold(args, version: int):
    """The pack threshold of case number ``version`` (1-based); None (given as -1, or no
    --pack-below): the default, through TrainerSync / GeneratorSync."""
    value = args.pack_below[(version - 1) % len(args.pack_below)] if args.pack_below else -1
    return None if value < 0 else value


def run_baseline(args, spec, trainer, chunks, rank, case, version, store):
    from megatron.core import parallel_state

    from megarl.weight_sync.baseline import gather_broadcast_send

    sources = {trainer.rank(pp_rank=s): s for s in range(trainer.pp)}
    group = stage_group(store, version, sources[rank], args.generators, 0) if rank in sources else None
    generator = GeneratorDims(tp=case.dst_tp, replicas=args.generators // case.dst_tp, ep=case.dst_ep)
    gather_broadcast_send(
        case_settings(args, spec, trainer, generator, case, version),
        rank,
        megatron_params(chunks),
        parallel_state.get_tensor_model_parallel_group(),
        group,
        parallel_state.get_expert_tensor_and_model_parallel_group(check_initialized=False),
    )
    if group is not None:
        destroy_sync_group(group)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--generators", type=int, required=True)
    p.add_argument("--models", nargs="+", required=True)
    p.add_argument("--layouts", nargs="+", required=True)
    p.add_argument("--dst-tps", nargs="+", required=True, help="generator layouts TP[eEP]")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--ipc", action="store_true", help="treat every pair as colocated (shared-memory path)")
    p.add_argument("--bucket-bytes", type=int, default=1 << 16)
    p.add_argument(
        "--pack-below",
        nargs="*",
        type=int,
        default=[],
        help="transport pack thresholds (bytes), used in turn case by case; -1: the default",
    )
    p.add_argument("--baseline", action="store_true", help="run baseline.py's gather + broadcast instead")
    p.add_argument("--out", default=None)
    return p.parse_args()


if __name__ == "__main__":
    main()
