"""`megarl sglang-command --config FILE`: the command that starts each replica's SGLang server.

For attach mode (``generator.sglang_urls``): start these on the generator
nodes, then the job. Each line sets ``MEGARL_SYNC_CONFIG`` to the file the
job writes at start in its run directory (the servers read it at their first
weight update, so they may start first; the run directory must be on a
filesystem both see).

``--hosts h0,h1,...`` (the job's nodes in order, as scripts/slurm.sbatch
passes them) places replica r where the topology puts its ranks -- node
(T + r * tp) // gpus_per_node, first GPU (T + r * tp) % gpus_per_node, T the
trainer's GPUs -- and prints ``host<TAB>url<TAB>command`` per replica; the
URLs are what ``generator.sglang_urls`` must then list.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import List, Optional, Sequence
from urllib.parse import urlparse

from megarl.config import load_config
from megarl.errors import ConfigError
from megarl.generator.sglang import serving


def replica_commands(
    cfg, model_path: Optional[str], host: str = "0.0.0.0", hosts: Sequence[str] = (), gpus_per_node: int = 8
) -> List[str]:
    g = cfg.generator
    if g.backend != "sglang":
        raise ConfigError(f"generator.backend is {g.backend!r}: sglang-command is for generator.backend=sglang")
    if model_path is None:
        source = Path(cfg.model.source)
        if g.fp8 or not (source / "config.json").is_file():
            raise ConfigError(
                "--model-path: give the Hugging Face directory the servers load (the policy's "
                "weights; for generator.fp8 a block-fp8 one: `megarl convert megatron-to-hf "
                "--megatron CKPT --output DIR --fp8`); only a bf16 run from an HF model.source "
                "can default to it"
            )
        model_path = str(source.resolve())
    env = f"{serving.SYNC_CONFIG_ENV}={shlex.quote(str(serving.sync_config_path(cfg.run.output_dir)))}"
    lines = []
    for r in range(g.replicas):
        first_gpu = cfg.trainer_dims().world_size + r * g.tp
        base = first_gpu % gpus_per_node if hosts else 0
        cmd = serving.replica_command(
            g, r, model_path, base_gpu_id=base, host=host, routed_experts=cfg.trainer.moe_enable_routing_replay
        )
        port = g.sglang_port + r
        if g.sglang_urls:  # the port the job will call
            port = urlparse(g.sglang_urls[r]).port
            if port is None:
                raise ConfigError(f"generator.sglang_urls[{r}]: {g.sglang_urls[r]!r} has no port")
            cmd[cmd.index("--port") + 1] = str(port)
        line = env + " " + " ".join(shlex.quote(c) for c in cmd)
        if hosts:
            node = first_gpu // gpus_per_node
            if node >= len(hosts):
                raise ConfigError(f"--hosts: replica {r} needs node {node}, only {len(hosts)} hosts given")
            line = f"{hosts[node]}\thttp://{hosts[node]}:{port}\t{line}"
        lines.append(line)
    return lines


def run(
    config_path: str,
    overrides: Sequence[str],
    model_path: Optional[str],
    replica: Optional[int],
    hosts: str = "",
    gpus_per_node: int = 8,
) -> None:
    cfg = load_config(config_path, overrides)
    lines = replica_commands(cfg, model_path, hosts=[h for h in hosts.split(",") if h], gpus_per_node=gpus_per_node)
    if replica is not None:
        if not 0 <= replica < len(lines):
            raise ConfigError(f"--replica {replica}: the config has generator.replicas={len(lines)}")
        lines = [lines[replica]]
    print("\n".join(lines), flush=True)
