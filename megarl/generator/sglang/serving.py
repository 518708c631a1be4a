"""How megarl starts SGLang servers for block-fp8 generation with in-flight updates.

SGLang's online ``--quantization fp8`` quantises at load time and cannot take
weight updates (the served tensors are not the loaded ones). megarl instead
serves a checkpoint that *is* block fp8 -- ``quantization_config`` =
``{"quant_method": "fp8", "weight_block_size": [128, 128]}`` -- so the served
parameters (float8_e4m3fn weights + float32 ``weight_scale_inv`` per
128x128 block) have the same format the senders quantise to, and every update
replaces them in place.

Files of a run (``RUN_DIR/sglang/``): ``sync_config.json`` (the receiver's
settings, written by the job at start: servers read it at their first
update, so attached servers may be started before the job), ``policy/``
(the trainer's weights as a Megatron checkpoint) and ``model/`` (the same
as the Hugging Face directory the launched servers load), ``replica<r>.log``.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Dict, List, Tuple

from megarl.weight_sync.fp8 import BLOCK_FP8_QUANT_CONFIG
from megarl.weight_sync.settings import SyncRendezvous, SyncSettings

WORKER_LOADER = "megarl.generator.sglang.worker_receiver.pull_shards"
SYNC_GROUP_NAME = "megarl_sglang_weight_sync"
SYNC_CONFIG_ENV = "MEGARL_SYNC_CONFIG"


def sglang_dir(run_dir) -> Path:
    return Path(run_dir).resolve() / "sglang"


def sync_config_path(run_dir) -> Path:
    return sglang_dir(run_dir) / "sync_config.json"


def block_fp8_hf_config(hf_config: Dict) -> Dict:
    """An HF config.json that makes SGLang build block-fp8 linears (lm_head/embeddings stay bf16)."""
    return dict(hf_config, quantization_config=dict(BLOCK_FP8_QUANT_CONFIG))


def write_sync_config(path, settings: SyncSettings, rendezvous: SyncRendezvous) -> str:
    """What the servers' workers receive (``settings``: both layouts and the wire format, equal to
    the trainer ranks') and where they join the trainer ranks' sync group (``rendezvous``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**settings.to_dict(), **rendezvous.to_dict()}))
    os.replace(tmp, path)  # a server reading it never sees half a file
    return str(path)


def read_sync_config(path) -> Tuple[SyncSettings, SyncRendezvous]:
    with open(path) as f:
        d = json.load(f)
    return SyncSettings.from_dict(d), SyncRendezvous.from_dict(d)


def server_args(
    model_dir: str,
    port: int,
    tp: int,
    base_gpu_id: int,
    version: int = 0,
    mem_fraction: float = 0.85,
    host: str = "127.0.0.1",
    ep: int = 1,
    routed_experts: bool = False,
) -> List[str]:
    """``sglang.launch_server`` arguments for one generator replica (token ids in and out); ``ep``:
    its experts over ``--ep-size`` of its TP ranks (the layout megarl's weight sync writes);
    ``routed_experts``: answers may carry every position's experts (routing replay)."""
    expert_parallel = ["--ep-size", str(ep)] if ep > 1 else []
    expert_parallel += ["--enable-return-routed-experts"] if routed_experts else []
    return [
        "--model-path",
        str(model_dir),
        "--host",
        host,
        "--port",
        str(port),
        "--tp-size",
        str(tp),
        "--base-gpu-id",
        str(base_gpu_id),
        "--weight-version",
        str(version),
        "--custom-weight-loader",
        WORKER_LOADER,
        "--mem-fraction-static",
        str(mem_fraction),
        "--skip-server-warmup",
        "--skip-tokenizer-init",
        *expert_parallel,
    ]


def launcher(command: str) -> List[str]:
    """``generator.sglang_launcher`` as argv; empty: this interpreter's ``-m sglang.launch_server``."""
    return shlex.split(command) if command else [sys.executable, "-m", "sglang.launch_server"]


def replica_command(
    g, replica: int, model_dir: str, base_gpu_id: int, host: str = "127.0.0.1", routed_experts: bool = False
) -> List[str]:
    """The full command line of replica ``replica``'s server (``g``: the generator config section;
    ``routed_experts``: trainer.moe_enable_routing_replay)."""
    return (
        launcher(g.sglang_launcher)
        + server_args(
            model_dir,
            g.sglang_port + replica,
            g.tp,
            base_gpu_id,
            mem_fraction=g.sglang_mem_fraction,
            host=host,
            ep=g.ep,
            routed_experts=routed_experts,
        )
        + list(g.sglang_args)
    )


def server_env(sync_config_path: str) -> Dict[str, str]:
    return dict(os.environ, **{SYNC_CONFIG_ENV: str(sync_config_path)})
