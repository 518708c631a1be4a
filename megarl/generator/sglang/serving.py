"""How megarl starts SGLang servers for block-fp8 generation with in-flight updates.

SGLang's online ``--quantization fp8`` quantises at load time and cannot take
weight updates (the served tensors are not the loaded ones). megarl instead
serves a checkpoint that *is* block fp8 -- ``quantization_config`` =
``{"quant_method": "fp8", "weight_block_size": [128, 128]}`` -- so the served
parameters (float8_e4m3fn weights + float32 ``weight_scale_inv`` per
128x128 block) have the same format the senders quantise to, and every update
replaces them in place.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Dict, List

from megarl.models.spec import LlamaSpec
from megarl.weight_sync.planner import GeneratorTopology, TrainerTopology

BLOCK_FP8_QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                          "weight_block_size": [128, 128]}

WORKER_LOADER = "megarl.generator.sglang.worker_receiver.pull_shards"


def block_fp8_hf_config(hf_config: Dict) -> Dict:
    """An HF config.json that makes SGLang build block-fp8 linears (lm_head/embeddings stay bf16)."""
    return dict(hf_config, quantization_config=dict(BLOCK_FP8_QUANT_CONFIG))


def write_sync_config(path: str, spec: LlamaSpec, trainer: TrainerTopology, generator: GeneratorTopology,
                      host: str, port: int, fp8: bool, verify: bool = False, backend: str = "gloo") -> str:
    """The receiver's settings. ``backend``: gloo when a trainer rank may share a GPU with a
    worker (bytes then go through CUDA IPC), nccl when every sync rank has its own GPU."""
    with open(path, "w") as f:
        json.dump({"spec": spec.to_dict(), "trainer": asdict(trainer), "generator": asdict(generator), "host": host,
                   "port": port, "fp8": fp8, "verify": verify, "backend": backend}, f)
    return path


def server_args(model_dir: str, port: int, tp: int, base_gpu_id: int, version: int = 0,
                mem_fraction: float = 0.85) -> List[str]:
    """``python -m sglang.launch_server`` arguments for one generator replica."""
    return [
        "--model-path", model_dir, "--port", str(port), "--tp-size", str(tp), "--base-gpu-id", str(base_gpu_id),
        "--weight-version", str(version), "--custom-weight-loader", WORKER_LOADER,
        "--mem-fraction-static", str(mem_fraction), "--skip-server-warmup",
    ]


def server_env(sync_config_path: str) -> Dict[str, str]:
    return dict(os.environ, MEGARL_SYNC_CONFIG=sync_config_path)
