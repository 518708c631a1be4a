"""Trainer side of the weight-sync tests: real Megatron GPTModel shards sent over a
TCP-store sync group to generator workers living in another torchrun world.

    torchrun --nproc-per-node 8 tests/workers/weight_sync_trainer.py --port P --generators 4 \
        --models DIR ... --layouts 1x1 2x1 ... --dst-tps 1 2 4 [--fp8]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch.distributed as dist  # noqa: E402
from lm_batch import parse_layout  # noqa: E402

from megarl.models.loading import load_llama  # noqa: E402
from megarl.runtime.distributed import init_distributed, init_megatron, shutdown  # noqa: E402
from megarl.weight_sync.endpoints import TrainerSync  # noqa: E402
from megarl.weight_sync.planner import GeneratorTopology, TrainerTopology, build_plan  # noqa: E402
from megarl.weight_sync.rendezvous import init_sync_group  # noqa: E402
from weight_sync_cases import cases  # noqa: E402


def main():
    args = parse()
    rank = init_distributed()
    world = dist.get_world_size()
    group = init_sync_group("127.0.0.1", args.port, world + args.generators, rank)
    version = 0
    loaded = None
    for case in cases(args, world):
        key = (case.model, case.layout)
        if loaded is None or loaded[0] != key:
            layout = parse_layout(case.layout)
            init_megatron(layout)
            spec, chunks = load_llama(case.model, layout)
            loaded = (key, spec, chunks)
        _, spec, chunks = loaded
        t = parse_layout(case.layout)
        trainer = TrainerTopology(t.tp, t.pp, world // (t.tp * t.pp))
        generator = GeneratorTopology(case.dst_tp, args.generators // case.dst_tp, first_rank=world)
        version += 1
        ipc_peers = set(range(world, world + args.generators)) if args.ipc else None
        TrainerSync(spec, trainer, generator, chunks, group, rank, fp8=case.fp8, wire_dtype=case.dtype,
                    verify=True, plan=build_plan(spec, trainer, generator), bucket_bytes=args.bucket_bytes,
                    ipc_peers=ipc_peers).push(version)
    dist.barrier(group=group)
    shutdown()


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--generators", type=int, required=True)
    p.add_argument("--models", nargs="+", required=True)
    p.add_argument("--layouts", nargs="+", required=True)
    p.add_argument("--dst-tps", nargs="+", type=int, required=True)
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--ipc", action="store_true", help="treat every pair as colocated (shared-memory path)")
    p.add_argument("--bucket-bytes", type=int, default=1 << 16)
    p.add_argument("--out", default=None)
    return p.parse_args()


if __name__ == "__main__":
    main()
