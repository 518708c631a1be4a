"""megarl's shard-to-shard weight receiver, running inside each SGLang TP worker.

SGLang spawns its TP workers itself, so megarl's receiver reaches them as a
*custom weight loader*: the server is started with
``--custom-weight-loader megarl.generator.sglang.worker_receiver.pull_shards``
and the backend triggers a sync with ``POST /update_weights_from_tensor``
whose ``load_format`` is that path and whose one (empty) tensor is named
``megarl_sync/<version>/<replica>``. SGLang then calls
``pull_shards(model, named_tensors)`` in every TP worker, between decode steps
(generation is paused in place), and each worker receives exactly its own
shard from the trainer ranks that hold it.

Why not SGLang's ``load_weights``: it expects full (unsharded) HF tensors
from a broadcast, and in 0.5.23 its Llama loader renames
``.weight_scale_inv`` to ``.weight_scale`` and silently drops block-fp8
scales. The receiver writes the model's own parameters by their own names
(``qkv_proj.weight``, ``qkv_proj.weight_scale_inv``...), already sharded
and, for fp8, already quantised by the senders -- nothing to rename.

The sync group and the plan come from the JSON file named by
``MEGARL_SYNC_CONFIG`` in the server's environment (written by the job at
start: ``serving.write_sync_config``); the group is formed with the trainer
ranks on the first update and kept.
"""

from __future__ import annotations

import os
from typing import Dict, List, Tuple

import torch

from megarl.errors import ConfigError
from megarl.generator.sglang.protocol import parse_sync_trigger_name
from megarl.generator.sglang.serving import SYNC_CONFIG_ENV, read_sync_config
from megarl.weight_sync.endpoints import GeneratorSync
from megarl.weight_sync.ipc import colocated_peers
from megarl.weight_sync.settings import SyncRendezvous, SyncSettings

_STATE: Dict[str, object] = {}


def _config() -> Tuple[SyncSettings, SyncRendezvous]:
    path = os.environ.get(SYNC_CONFIG_ENV)
    if not path:
        raise ConfigError(
            f"{SYNC_CONFIG_ENV} is not set in the SGLang server's environment (start servers with "
            f"the command `megarl sglang-command --config FILE` prints, or let the job launch them)"
        )
    if not os.path.isfile(path):
        raise ConfigError(
            f"{SYNC_CONFIG_ENV}={path}: no such file; the megarl job writes it at start -- is the run "
            f"directory shared with this server's node?"
        )
    return read_sync_config(path)


def _model_params(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {name: p.data for name, p in model.named_parameters()}


def _tp_rank() -> int:
    from sglang.srt.distributed import get_tensor_model_parallel_rank  # lazily: SGLang is GPU-only

    return get_tensor_model_parallel_rank()


def _receiver(model: torch.nn.Module, replica: int):
    if "sync" in _STATE:
        return _STATE["sync"]
    settings, rendezvous = _config()
    tp_rank = _tp_rank()
    rank = settings.geometry.generator_rank(replica, tp_rank)
    group = rendezvous.join(settings.geometry.world_size, rank)
    params = _model_params(model)
    # a trainer rank on this same GPU (single-GPU checks, colocated layouts): CUDA IPC, not NCCL
    peers = colocated_peers(group, rank, next(iter(params.values())).device)
    sync = GeneratorSync(settings, replica, tp_rank, params, group, ipc_peers=peers)
    _STATE["sync"] = sync
    return sync


def pull_shards(model: torch.nn.Module, named_tensors: List[Tuple[str, torch.Tensor]]) -> None:
    """SGLang custom weight loader: receive this worker's shards of the announced policy version."""
    if len(named_tensors) != 1:
        raise ConfigError(f"megarl's weight loader got {len(named_tensors)} tensors; expected one trigger")
    version, replica = parse_sync_trigger_name(named_tensors[0][0])
    _receiver(model, replica).pull(expected_version=version)
