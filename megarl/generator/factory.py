"""Build a generator replica's backend (the wiring, loop/wiring.py, picks which from ``generator.backend``).

    torch    megarl's reference engine in this process, its weights in SGLang's TP layout
             (every TP rank of the replica builds one over the replica's TP group)
    sglang   one SGLang server per replica, driven over HTTP by the replica's first rank:
             attached (``generator.sglang_urls[replica]``) or launched here
             (generator/sglang/launch.py)

The generator executor above never knows which one it drives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megarl.generator.interface import GeneratorBackend
from megarl.generator.sglang.http_backend import SglangBackend
from megarl.generator.sglang.launch import serving_model, start_replica_server
from megarl.generator.sglang.protocol import RoutedExpertsLayout
from megarl.generator.sglang.server import wait_for_attached
from megarl.generator.torch_engine.engine import TorchEngine
from megarl.parallel_dims import GeneratorDims
from megarl.weight_sync.endpoints import allocate_generator_params


@dataclass(frozen=True)
class GeneratorRank:
    """Where this rank sits among the generators: replica, TP rank, the replica's TP group."""

    dims: GeneratorDims  # the engines' parallelism (sync mode: TP-1 engines, one per rank)
    replica: int
    tp_rank: int
    tp_group: object = None
    device: str = "cpu"
    local_rank: int = 0  # the first GPU of a launched server (its node-local rank)


def torch_engine_backend(g, spec, p: GeneratorRank) -> GeneratorBackend:
    """megarl's reference engine: this rank's TP shard of its replica, in SGLang's layout."""
    dtype = torch.bfloat16 if g.dtype == "bf16" else torch.float32
    params = allocate_generator_params(spec, p.dims.tp, p.tp_rank, dtype, g.fp8, device=p.device, ep=p.dims.ep)
    return TorchEngine(
        spec,
        params,
        max_running=g.max_running,
        max_seq_len=g.max_seq_len,
        tp=p.dims.tp,
        tp_rank=p.tp_rank,
        group=p.tp_group,
        recompute_kv_on_update=g.recompute_kv_on_update,
        ep=p.dims.ep,
        kv_park_timeout_s=g.kv_park_timeout_s,
    )


def sglang_backend(
    g,
    p: GeneratorRank,
    samples_per_prompt: int,
    run_dir,
    store,
    on_failure,
    routes: Optional[RoutedExpertsLayout] = None,
) -> GeneratorBackend:
    """An SGLang server driven over HTTP: attached (generator.sglang_urls) or launched here;
    ``routes``: the samples carry their routed experts (routing replay; an attached server must
    have been started with --enable-return-routed-experts: `megarl sglang-command` adds it)."""
    server = None
    if g.sglang_urls:
        url = g.sglang_urls[p.replica]
        wait_for_attached(url, f"SGLang server of generator replica {p.replica} ({url})", g.sglang_startup_timeout_s)
    else:
        model_dir = serving_model(run_dir, store, p.replica, g.fp8, g.dtype, timeout_s=g.sglang_startup_timeout_s)
        server = start_replica_server(
            g, p.replica, model_dir, run_dir, base_gpu_id=p.local_rank, routed_experts=routes is not None
        )
        url = server.url
    # the executor keeps max_running samples in flight plus one group queued: one thread each
    return SglangBackend(
        url,
        p.replica,
        max_inflight=g.max_running + samples_per_prompt,
        request_timeout_s=g.sglang_request_timeout_s,
        health_timeout_s=g.sglang_health_timeout_s,
        server=server,
        on_failure=on_failure,
        routes=routes,
    )
