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
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List

from megarl.models.spec import ModelSpec
from megarl.parallel_dims import GeneratorDims, ParallelDims
from megarl.weight_sync.fp8 import BLOCK_FP8_QUANT_CONFIG

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


def write_sync_config(
    path,
    spec: ModelSpec,
    trainer: ParallelDims,
    generator: GeneratorDims,
    host: str,
    port: int,
    fp8: bool,
    verify: bool = False,
    backend: str = "gloo",
    timeout_s: float = 600.0,
    wire_dtype: str = "bf16",
    norm_names: str = "local",
) -> str:
    """The receiver's settings. ``backend``: gloo when a trainer rank may share a GPU with a
    worker (bytes then go through CUDA IPC), nccl when every sync rank has its own GPU;
    ``wire_dtype`` (bf16 | fp32): how non-fp8 bytes travel (the served dtype); ``norm_names``: the
    trainer's layer spec ("te" | "local"), which names its parameters."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(
        json.dumps(
            {
                "spec": spec.to_dict(),
                "trainer": asdict(trainer),
                "generator": asdict(generator),
                "host": host,
                "port": port,
                "fp8": fp8,
                "verify": verify,
                "backend": backend,
                "group_name": SYNC_GROUP_NAME,
                "timeout_s": timeout_s,
                "wire_dtype": wire_dtype,
                "norm_names": norm_names,
            }
        )
    )
    os.replace(tmp, path)  # a server reading it never sees half a file
    return str(path)


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
