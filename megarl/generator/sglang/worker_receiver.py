"""megarl's shard-to-shard weight receiver, running inside each SGLang TP worker.

SGLang spawns its TP workers itself, so megarl's receiver reaches them as a
*custom weight loader*: the server is started with
``--custom-weight-loader megarl.generator.sglang.worker_receiver.pull_shards``
and the backend triggers a sync with ``POST /update_weights_from_tensor``
whose ``load_format`` is that path and whose one tensor carries the version.
SGLang then calls ``pull_shards(model, named_tensors)`` in every TP worker,
between decode steps (generation is paused in place), and each worker
receives exactly its own shard from the trainer ranks that hold it.

Why not SGLang's ``load_weights``: it expects full (unsharded) HF tensors
from a broadcast, and in 0.5.23 its Llama loader renames
``.weight_scale_inv`` to ``.weight_scale`` and silently drops block-fp8
scales. The receiver writes the model's own parameters by their own names
(``qkv_proj.weight``, ``qkv_proj.weight_scale_inv``...), already sharded
and, for fp8, already quantised by the senders -- nothing to rename.

The sync group and the plan come from a JSON file named by
``MEGARL_SYNC_CONFIG`` in the server's environment (written by
``serving.write_sync_config``); the group is built on first use and kept.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Tuple

import torch

from megarl.errors import ConfigError

_STATE: Dict[str, object] = {}


def _config() -> dict:
    path = os.environ.get("MEGARL_SYNC_CONFIG")
    if not path:
        raise ConfigError("MEGARL_SYNC_CONFIG is not set in the SGLang server's environment "
                          "(start servers through megarl.generator.sglang.serving)")
    with open(path) as f:
        return json.load(f)


def _model_params(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {name: p.data for name, p in model.named_parameters()}


def _receiver(model: torch.nn.Module, replica: int):
    if "sync" in _STATE:
        return _STATE["sync"]
    from sglang.srt.distributed import get_tensor_model_parallel_rank  # lazily: SGLang is GPU-only

    from megarl.models.spec import LlamaSpec
    from megarl.weight_sync.endpoints import GeneratorSync
    from megarl.weight_sync.planner import GeneratorTopology, TrainerTopology
    from megarl.weight_sync.rendezvous import init_sync_group

    cfg = _config()
    spec = LlamaSpec.from_dict(cfg["spec"])
    trainer = TrainerTopology(**cfg["trainer"])
    generator = GeneratorTopology(**cfg["generator"])
    tp_rank = get_tensor_model_parallel_rank()
    rank = generator.rank(replica, tp_rank)
    group = init_sync_group(cfg["host"], cfg["port"], trainer.size + generator.size, rank,
                            group_name=cfg.get("group_name", "megarl_weight_sync"), backend=cfg.get("backend"))
    from megarl.weight_sync.ipc import colocated_peers

    params = _model_params(model)
    # a trainer rank on this same GPU (single-GPU checks, colocated layouts): CUDA IPC, not NCCL
    peers = colocated_peers(group, rank, next(iter(params.values())).device)
    sync = GeneratorSync(spec, trainer, generator, replica, tp_rank, params, group, fp8=cfg["fp8"],
                         verify=cfg.get("verify", False), ipc_peers=peers)
    _STATE["sync"] = sync
    return sync


def pull_shards(model: torch.nn.Module, named_tensors: List[Tuple[str, torch.Tensor]]) -> None:
    """SGLang custom weight loader: receive this worker's shards of policy ``version``."""
    (name, header), = named_tensors
    if name != "megarl_sync":
        raise ConfigError(f"megarl's weight loader got tensor {name!r}; expected the 'megarl_sync' header")
    version, replica = (int(x) for x in header.tolist())
    _receiver(model, replica).pull(expected_version=version)
