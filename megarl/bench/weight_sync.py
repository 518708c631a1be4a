"""`megarl bench weight-sync`: shard-to-shard sync vs gather-then-broadcast, one run.

Launches the trainer ranks (Megatron GPTModel at --src-tp x --src-pp) and the
generator workers (--dst-replicas x --dst-tp, SGLang layout) as two worlds
that meet over TCP-store sync groups, times megarl's sync and the baseline
(baseline.py) on the same weights, and prints one JSON line: bytes moved and
the minimum (every worker's own shard), seconds, and the ratio.

``--plan-only`` builds the plan from shapes (e.g. ``--model llama3-405b``) and
prints per-rank byte totals and the predicted time from link bandwidths.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megarl.models.presets import PRESETS, preset_spec
from megarl.models.spec import LlamaSpec


@dataclass(frozen=True)
class WeightSyncBench:
    model: str = "llama-mini"
    src_tp: int = 4
    src_pp: int = 1
    src_dp: int = 1
    dst_tp: int = 2
    dst_replicas: int = 2
    fp8: bool = False
    verify: bool = False
    iters: int = 3
    plan_only: bool = False
    gpus_per_node: int = 8
    nvlink_gb_s: float = 450.0
    network_gb_s: float = 50.0
    bucket_mb: int = 64


def model_spec(model: str) -> LlamaSpec:
    if model in PRESETS:
        return preset_spec(model)
    if model == "smollm2":
        from megarl.models.hf_checkpoint import gguf_spec, smollm2_gguf_path

        path = smollm2_gguf_path()
        return gguf_spec(path.parent, path.name)
    from megarl.checkpointing.megatron_checkpoint import read_spec, resolve_checkpoint_dir
    from megarl.models.hf_checkpoint import SafetensorsCheckpoint

    path = Path(model)
    if (path / "config.json").exists():
        return SafetensorsCheckpoint(path).spec
    return read_spec(resolve_checkpoint_dir(path, what="--model"))


def plan_only(b: WeightSyncBench) -> dict:
    from megarl.weight_sync.planner import GeneratorTopology, TrainerTopology, build_plan
    from megarl.weight_sync.predict import Links, predict_seconds, rank_bytes

    spec = model_spec(b.model)
    trainer = TrainerTopology(b.src_tp, b.src_pp, b.src_dp)
    generator = GeneratorTopology(b.dst_tp, b.dst_replicas, first_rank=trainer.size)
    start = time.perf_counter()
    plan = build_plan(spec, trainer, generator)
    plan_s = time.perf_counter() - start
    links = Links(b.gpus_per_node, b.nvlink_gb_s, b.network_gb_s)
    per_rank = rank_bytes(plan, b.fp8, links)
    recv = [sum(v for k, v in per_rank[r].items() if k.startswith("recv")) for r in range(trainer.size, trainer.size + generator.size)]
    send = [sum(v for k, v in per_rank[r].items() if k.startswith("send")) for r in range(trainer.size)]
    result = {
        "model": b.model, "parameters_B": spec.num_parameters() / 1e9,
        "trainer": f"TP{b.src_tp} x PP{b.src_pp} x DP{b.src_dp} = {trainer.size} GPUs",
        "generator": f"{b.dst_replicas} x TP{b.dst_tp} = {generator.size} GPUs", "fp8": b.fp8,
        "plan_seconds": round(plan_s, 2),
        "transfers": sum(len(v) for v in plan.transfers.values()),
        "max_bytes_per_receiving_gpu": max(recv), "min_bytes_per_receiving_gpu": min(recv),
        "max_bytes_per_sending_gpu": max(send), "min_bytes_per_sending_gpu": min(send),
        "predicted_seconds": predict_seconds(plan, b.fp8, links),
        "links": {"gpus_per_node": b.gpus_per_node, "nvlink_GB_s": b.nvlink_gb_s, "network_GB_s": b.network_gb_s},
    }
    print(json.dumps(result), flush=True)
    return result


# -- the measured run -----------------------------------------------------------------------------


def _trainer_rank(b: WeightSyncBench, ports, out_dir: str) -> None:
    import torch.distributed as dist

    from megarl.models.megatron_llama import build_model_chunks, transformer_config
    from megarl.runtime.distributed import ParallelLayout, init_distributed, init_megatron, shutdown
    from megarl.weight_sync.baseline import gather_broadcast_send
    from megarl.weight_sync.endpoints import TrainerSync, megatron_params
    from megarl.weight_sync.planner import GeneratorTopology, TrainerTopology, build_plan
    from megarl.weight_sync.rendezvous import init_sync_group

    rank = init_distributed()
    spec = model_spec(b.model)
    init_megatron(ParallelLayout(b.src_tp, b.src_pp))
    config = transformer_config(spec, b.src_tp, b.src_pp, params_dtype=torch.bfloat16, perform_initialization=False)
    chunks = build_model_chunks(spec, config)
    generator_rng = torch.Generator().manual_seed(rank)
    with torch.no_grad():  # any finite values do for timing (Megatron's initialiser is slow on CPU)
        for p in chunks[0].parameters():
            p.copy_(torch.randn(p.shape, generator=generator_rng) * 0.02)
    trainer = TrainerTopology(b.src_tp, b.src_pp, dist.get_world_size() // (b.src_tp * b.src_pp))
    generator = GeneratorTopology(b.dst_tp, b.dst_replicas, first_rank=trainer.size)
    sync = init_sync_group("127.0.0.1", ports[0], trainer.size + generator.size, rank)
    bcast = init_sync_group("127.0.0.1", ports[1], 1 + generator.size, rank, group_name="baseline") if rank == 0 else None
    plan = build_plan(spec, trainer, generator)
    ours = TrainerSync(spec, trainer, generator, chunks, sync, rank, fp8=b.fp8, wire_dtype=torch.bfloat16,
                       verify=b.verify, plan=plan, bucket_bytes=b.bucket_mb << 20)
    times, base_times = [], []
    for i in range(b.iters + 1):  # the first round warms up
        dist.barrier(group=sync)
        start = time.perf_counter()
        ours.push(i)
        dist.barrier(group=sync)
        times.append(time.perf_counter() - start)
    params = megatron_params(chunks)
    gathered = 0
    for i in range(b.iters + 1):
        dist.barrier(group=sync)
        start = time.perf_counter()
        gathered = gather_broadcast_send(spec, trainer, rank, params, sync, bcast, torch.bfloat16)["gathered_bytes"]
        dist.barrier(group=sync)
        base_times.append(time.perf_counter() - start)
    if rank == 0:
        Path(out_dir, "trainer.json").write_text(json.dumps(
            {"seconds": times[1:], "baseline_seconds": base_times[1:], "gathered": gathered}))
    shutdown()


def _generator_rank(b: WeightSyncBench, ports, out_dir: str, trainer_size: int) -> None:
    import torch.distributed as dist

    from megarl.runtime.distributed import init_distributed, shutdown
    from megarl.weight_sync.baseline import gather_broadcast_receive
    from megarl.weight_sync.endpoints import GeneratorSync, allocate_generator_params
    from megarl.weight_sync.planner import GeneratorTopology, TrainerTopology, build_plan
    from megarl.weight_sync.rendezvous import init_sync_group

    rank = init_distributed()
    spec = model_spec(b.model)
    trainer = TrainerTopology(b.src_tp, b.src_pp, trainer_size // (b.src_tp * b.src_pp))
    generator = GeneratorTopology(b.dst_tp, b.dst_replicas, first_rank=trainer.size)
    sync_rank = trainer.size + rank
    sync = init_sync_group("127.0.0.1", ports[0], trainer.size + generator.size, sync_rank)
    bcast = init_sync_group("127.0.0.1", ports[1], 1 + generator.size, 1 + rank, group_name="baseline")
    replica, tp_rank = divmod(rank, b.dst_tp)
    params = allocate_generator_params(spec, b.dst_tp, tp_rank, torch.bfloat16, b.fp8)
    ours = GeneratorSync(spec, trainer, generator, replica, tp_rank, params, sync, fp8=b.fp8,
                         wire_dtype=torch.bfloat16, verify=b.verify, plan=build_plan(spec, trainer, generator),
                         bucket_bytes=b.bucket_mb << 20)
    received = 0
    for i in range(b.iters + 1):
        dist.barrier(group=sync)
        received = ours.pull(expected_version=i).bytes_received
        dist.barrier(group=sync)
    base_params = allocate_generator_params(spec, b.dst_tp, tp_rank, torch.bfloat16, False)
    base_received = 0
    for _ in range(b.iters + 1):
        dist.barrier(group=sync)
        base_received = gather_broadcast_receive(spec, b.dst_tp, tp_rank, base_params, bcast, torch.bfloat16)["received_bytes"]
        dist.barrier(group=sync)
    Path(out_dir, f"generator{rank}.json").write_text(json.dumps({"received": received, "baseline_received": base_received}))
    shutdown()


def run(b: WeightSyncBench) -> dict:
    if b.plan_only:
        return plan_only(b)
    from megarl.runtime.distributed import free_port
    from megarl.runtime.launch import run_worlds
    from megarl.weight_sync.planner import GeneratorTopology, TrainerTopology, build_plan

    spec = model_spec(b.model)
    trainer_size = b.src_tp * b.src_pp * b.src_dp
    ports = (free_port(), free_port())
    with tempfile.TemporaryDirectory(prefix="megarl_bench_") as out:
        run_worlds([(_trainer_rank, trainer_size, (b, ports, out)),
                    (_generator_rank, b.dst_tp * b.dst_replicas, (b, ports, out, trainer_size))])
        t = json.loads(Path(out, "trainer.json").read_text())
        gens = [json.loads(Path(out, f"generator{r}.json").read_text()) for r in range(b.dst_tp * b.dst_replicas)]
    plan = build_plan(spec, TrainerTopology(b.src_tp, b.src_pp, b.src_dp),
                      GeneratorTopology(b.dst_tp, b.dst_replicas, first_rank=trainer_size))
    from megarl.weight_sync.predict import transfer_bytes

    # every worker's own shard, once (fp8 weights at one byte plus their scales)
    minimum = int(sum(transfer_bytes(t.dst_param, t.numel, b.fp8) for ts in plan.transfers.values() for t in ts))
    ours_s, base_s = statistics.median(t["seconds"]), statistics.median(t["baseline_seconds"])
    result = {
        "model": b.model, "parameters_M": round(spec.num_parameters() / 1e6, 1),
        "trainer": f"TP{b.src_tp} x PP{b.src_pp} x DP{b.src_dp}", "generator": f"{b.dst_replicas} x TP{b.dst_tp}",
        "fp8": b.fp8, "verify": b.verify, "iters": b.iters,
        "bytes_moved": sum(g["received"] for g in gens), "min_bytes": minimum, "seconds": ours_s,
        "baseline_bytes_moved": t["gathered"] + sum(g["baseline_received"] for g in gens),
        "baseline_seconds": base_s,
        "speedup_vs_gather_broadcast": base_s / ours_s,
    }
    print(json.dumps(result), flush=True)
    return result
