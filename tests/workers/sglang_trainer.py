"""Trainer side of the SGLang TP-worker test: Megatron TP shards pushed to an SGLang server's TP workers.

    torchrun --nproc-per-node T tests/workers/sglang_trainer.py --model MEGATRON_DIR --sync-config FILE --version V

Does what a trainer rank of ``megarl train`` with ``generator.backend: sglang``
does at a sync (weight_sync/factory.py): join the sync group the servers' TP
workers join (the host, port, group name and backend of the sync config the
job writes for them), find same-device peers (a collective the workers' loader
takes part in), and push this rank's shards with ShardToShardSender.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch.distributed as dist  # noqa: E402

from megarl.checkpointing.model_loading import load_megatron_model  # noqa: E402
from megarl.generator.sglang.serving import read_sync_config  # noqa: E402
from megarl.runtime.distributed import init_distributed, init_megatron, shutdown  # noqa: E402
from megarl.weight_sync.ipc import colocated_peers  # noqa: E402
from megarl.weight_sync.synchronizer import ShardToShardSender  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--sync-config", required=True)
    p.add_argument("--version", type=int, required=True)
    args = p.parse_args()
    rank = init_distributed()
    settings, rendezvous = read_sync_config(args.sync_config)  # what the SGLang workers read too
    trainer = settings.geometry.trainer
    assert trainer.world_size == dist.get_world_size(), (trainer, dist.get_world_size())
    init_megatron(trainer)
    _, chunks = load_megatron_model(args.model, trainer)

    def connect():
        group = rendezvous.join(settings.geometry.world_size, rank)
        return group, colocated_peers(group, rank, None)

    sender = ShardToShardSender(settings, chunks, rank, connect=connect)
    stats = sender.sync(args.version)
    print(json.dumps({"rank": rank, "version": stats.version, "bytes_sent": stats.bytes_sent}), flush=True)
    shutdown()


if __name__ == "__main__":
    main()
