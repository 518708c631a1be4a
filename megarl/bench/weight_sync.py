"""`megarl bench weight-sync`: shard-to-shard sync vs slime's gather-then-broadcast, one run.

Launches the trainer ranks (Megatron GPTModel at --src-tp x --src-pp) and the
generator workers (--dst-replicas x --dst-tp, SGLang layout) as two worlds
that meet over TCP-store groups, times megarl's sync and the baseline
(baseline.py: what slime does -- TP all-gather, per-stage flattened buckets
broadcast to every worker) alternately on the same weights with the same
bucket size, and prints one JSON line: bytes moved and the minimum (every
worker's own shard), seconds, message counts and the ratio. The run fails,
printing no ratio, unless both paths leave bit-identical generator weights
(``baseline_same_weights``). With ``--fp8`` on shapes that are not whole 128 x 128
blocks per SGLang shard (tiny) the baseline cannot cut block-fp8 tensors and sends
bf16 while megarl sends fp8 where it can: the output says so (``wire_formats``,
``same_wire_format``) and the weights are compared after quantising the
baseline's bf16 shards as SGLang's loader would.

``--plan-only`` builds the plan from shapes (``--model llama3-405b ...`` or a
run config with ``--config``) and prints a predicted time -- a model (link
bandwidths, a per-message latency, fp8 quantisation throughput; predict.py),
not a measurement -- with every assumption beside it.
"""

from __future__ import annotations

import datetime
import functools
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from megarl.checkpointing.megatron_checkpoint import read_spec, resolve_checkpoint_dir
from megarl.config import Config, load_config
from megarl.errors import ConfigError, MegarlError
from megarl.layout import disaggregated_world_size
from megarl.models.hf_checkpoint import SafetensorsCheckpoint, gguf_spec, smollm2_gguf_path
from megarl.models.megatron_model import build_model_chunks, transformer_config
from megarl.models.presets import HF_CONFIGS, PRESETS, preset_spec
from megarl.models.spec import ModelSpec
from megarl.parallel_dims import GeneratorDims, ParallelDims
from megarl.plan.config_plan import model_preset, plan_section, section_hardware
from megarl.runtime.distributed import free_port, init_distributed, init_megatron, shutdown
from megarl.runtime.launch import run_worlds
from megarl.runtime.rendezvous import init_sync_group
from megarl.weight_sync import fp8 as fp8_format
from megarl.weight_sync.baseline import (
    fp8_supported,
    gather_broadcast_receive,
    gather_broadcast_send,
    is_expert_param,
)
from megarl.weight_sync.endpoints import GeneratorSync, TrainerSync, allocate_generator_params, megatron_params
from megarl.weight_sync.fp8 import check_fp8_experts
from megarl.weight_sync.layouts import check_sglang_tp
from megarl.weight_sync.planner import build_plan
from megarl.weight_sync.predict import Links, predict, rank_bytes, transfer_bytes
from megarl.weight_sync.settings import SyncGeometry, SyncSettings, WireFormat


@dataclass(frozen=True)
class WeightSyncBench:
    """The command line's options (``megarl bench weight-sync``); the layout flags (--src-*, --dst-*)
    stay None until ``resolved``, and every layout is used as ``trainer_dims`` / ``generator_dims``."""

    model: Optional[str] = None  # default llama-mini (or the config's model with --config)
    src_tp: Optional[int] = None  # None: 4, or the config's trainer.tp
    src_pp: Optional[int] = None
    src_dp: Optional[int] = None
    src_vpp: Optional[int] = None  # virtual pipeline stages per PP rank (--plan-only); None: 1, or trainer.vpp
    src_ep: Optional[int] = None  # trainer expert parallel (--plan-only); None: 1, or trainer.ep
    src_etp: Optional[int] = None  # trainer expert tensor parallel; None: Megatron's default (tp), or trainer.etp
    dst_tp: Optional[int] = None
    dst_replicas: Optional[int] = None
    dst_ep: Optional[int] = None  # SGLang's --ep-size inside a replica's TP (--plan-only); None: 1, or generator.ep
    fp8: bool = False
    verify: bool = False
    iters: int = 3
    plan_only: bool = False
    config: Optional[str] = None  # a megarl run config (--plan-only)
    overrides: Tuple[str, ...] = ()  # its key=value overrides
    gpus_per_node: Optional[int] = None
    nvlink_gb_s: Optional[float] = None
    network_gb_s: Optional[float] = None
    message_latency_us: Optional[float] = None
    fp8_quant_gb_s: Optional[float] = None
    bucket_mb: int = 64  # both megarl's rounds and the baseline's buckets (DEFAULT_BUCKET_BYTES)

    @property
    def bucket_bytes(self) -> int:
        return self.bucket_mb << 20

    def trainer_dims(self) -> ParallelDims:
        """The trainer's dims (a resolved bench): --src-tp / --src-pp / --src-dp / --src-vpp."""
        return _flag_dims(
            ParallelDims,
            "--src",
            tp=self.src_tp,
            pp=self.src_pp,
            dp=self.src_dp,
            vpp=self.src_vpp,
            ep=self.src_ep,
            etp=self.src_etp,
        )

    def generator_dims(self) -> GeneratorDims:
        """The generators' dims (a resolved bench): --dst-tp x --dst-replicas, --dst-ep inside TP."""
        return _flag_dims(GeneratorDims, "--dst", tp=self.dst_tp, replicas=self.dst_replicas, ep=self.dst_ep)


def _flag_dims(kind, flags: str, **sizes):
    """Dims from the layout flags; an error names the flag (``--src-tp: ...``)."""
    try:
        return kind(**sizes, section=flags)
    except ConfigError as err:
        raise ConfigError(str(err).replace(f"{flags}.", f"{flags}-")) from None


DEFAULTS = dict(
    model="llama-mini", src_tp=4, src_pp=1, src_dp=1, src_vpp=1, src_ep=1, dst_tp=2, dst_replicas=2, dst_ep=1
)
# with --config: the run config's field behind each layout flag (a flag given wins over it)
CONFIG_FIELDS = {
    "src_tp": "trainer.tp",
    "src_pp": "trainer.pp",
    "src_dp": "trainer.dp",
    "src_vpp": "trainer.vpp",
    "src_ep": "trainer.ep",
    "src_etp": "trainer.etp",  # None stays Megatron's default (etp = tp)
    "dst_tp": "generator.tp",
    "dst_replicas": "generator.replicas",
    "dst_ep": "generator.ep",
}


@functools.lru_cache(maxsize=4)
def _run_config(path: str, overrides: Tuple[str, ...]) -> Config:
    return load_config(path, overrides)


def run_config(b: WeightSyncBench) -> Optional[Config]:
    """The run config (--config with its overrides), loaded once; None without --config."""
    if b.config is None:
        if b.overrides:
            raise ConfigError(f"override {b.overrides[0]!r}: needs --config FILE")
        return None
    return _run_config(b.config, tuple(b.overrides))


def resolved(b: WeightSyncBench) -> WeightSyncBench:
    """Unset layout fields from the config (--config), else the defaults."""
    values = dict(DEFAULTS)
    cfg = run_config(b)
    if cfg is not None:
        values.update({flag: cfg.get(name) for flag, name in CONFIG_FIELDS.items()})
        values["model"] = model_preset(cfg, plan_section(cfg))
        if not b.fp8:
            b = replace(b, fp8=bool(cfg.generator.fp8))
    return replace(b, **{k: getattr(b, k) if getattr(b, k) is not None else v for k, v in values.items()})


def model_spec(model: str) -> ModelSpec:
    if model in PRESETS or model in HF_CONFIGS:
        return preset_spec(model)
    if model == "smollm2":
        path = smollm2_gguf_path()
        return gguf_spec(path.parent, path.name)

    path = Path(model)
    if (path / "config.json").exists():
        return SafetensorsCheckpoint(path).spec
    return read_spec(resolve_checkpoint_dir(path, what="--model"))


def links_of(b: WeightSyncBench):
    """Link model: command-line values, else the config's plan section (hardware), else predict.py's defaults."""
    values = {}
    cfg = run_config(b)
    if cfg is not None:
        section = plan_section(cfg)
        hw = section_hardware(section)
        values.update(gpus_per_node=hw.gpus_per_node, nvlink_gb_s=hw.nvlink_gb_s, network_gb_s=hw.network_gb_s)
    for name in ("gpus_per_node", "nvlink_gb_s", "network_gb_s", "message_latency_us", "fp8_quant_gb_s"):
        if getattr(b, name) is not None:
            values[name] = getattr(b, name)
    return Links(**values)


def _check_fp8_flag(spec: ModelSpec, gdims) -> None:
    try:
        check_fp8_experts(spec, gdims.tp, gdims.ep)
    except ConfigError as err:  # named by this command's flag
        raise ConfigError(str(err).replace("generator.fp8:", "--fp8:", 1)) from None


def plan_only(b: WeightSyncBench) -> dict:
    b = resolved(b)
    spec = model_spec(b.model)
    if b.fp8:
        _check_fp8_flag(spec, b.generator_dims())
    dims, gdims = b.trainer_dims(), b.generator_dims()
    # interleaved stages change which PP rank holds (and sends) which layers: the job's own plan
    trainer, generator = dims, gdims
    start = time.perf_counter()
    plan = build_plan(spec, trainer, generator)
    plan_s = time.perf_counter() - start
    links = links_of(b)
    per_rank = rank_bytes(plan, b.fp8, links)
    recv = [
        sum(v for k, v in per_rank[r].items() if k.startswith("recv"))
        for r in range(dims.world_size, disaggregated_world_size(dims, gdims))
    ]
    send = [sum(v for k, v in per_rank[r].items() if k.startswith("send")) for r in range(dims.world_size)]
    p = predict(plan, b.fp8, links, bucket_bytes=b.bucket_bytes)
    busy = p.busiest
    result = {
        "model": b.model,
        "config": b.config,
        "parameters_B": spec.num_parameters() / 1e9,
        "trainer": f"{dims.describe()} = {dims.world_size} GPUs",
        "generator": f"{gdims.describe()} = {gdims.world_size} GPUs",
        "fp8": b.fp8,
        "plan_seconds": round(plan_s, 2),
        "transfers": sum(len(v) for v in plan.transfers.values()),
        "max_bytes_per_receiving_gpu": max(recv),
        "min_bytes_per_receiving_gpu": min(recv),
        "max_bytes_per_sending_gpu": max(send),
        "min_bytes_per_sending_gpu": min(send),
        "predicted_seconds": p.seconds,
        "kind": "prediction from a model (predict.py), not a measurement",
        "breakdown": {  # of the GPU that sets the time
            "rank": busy.rank,
            "role": "generator" if busy.rank >= dims.world_size else "trainer",
            "direction": busy.direction,
            "bandwidth_s": busy.bandwidth_s,
            "latency_s": busy.latency_s,
            "quantise_s": busy.quantise_s,
            "network_bytes": busy.network_bytes,
            "nvlink_bytes": busy.nvlink_bytes,
            "messages": busy.messages,
            "quantised_bf16_bytes": busy.quantised_bytes,
        },
        "bandwidth_only_seconds": p.busiest_bandwidth_only.bandwidth_s,
        "max_messages_per_rank": p.max_messages,
        "assumptions": {
            "gpus_per_node": links.gpus_per_node,
            "nvlink_GB_s": links.nvlink_gb_s,
            "network_GB_s": links.network_gb_s,
            "message_latency_us": links.message_latency_us,
            "fp8_quant_GB_s": links.fp8_quant_gb_s,
            "bucket_MB": b.bucket_mb,
            "quantisation_overlapped": False,
        },
    }
    print(
        f"weight sync, {b.model}: trainer {result['trainer']} -> generator {result['generator']}"
        f"{' (fp8)' if b.fp8 else ''}\n"
        f"  predicted {p.seconds:.3f} s -- a model, not a measurement: busiest GPU = {result['breakdown']['role']} "
        f"sync rank {busy.rank} ({busy.direction}): bandwidth {busy.bandwidth_s:.3f} s "
        f"({busy.network_bytes / 1e9:.2f} GB network, {busy.nvlink_bytes / 1e9:.2f} GB NVLink) + "
        f"{busy.messages} messages x {links.message_latency_us:g} us = {busy.latency_s * 1e3:.1f} ms + "
        f"fp8 quantisation {busy.quantised_bytes / 1e9:.2f} GB bf16 / {links.fp8_quant_gb_s:g} GB/s = "
        f"{busy.quantise_s * 1e3:.1f} ms\n"
        f"  assumptions: {links.gpus_per_node} GPUs per node, NVLink {links.nvlink_gb_s:g} GB/s, network "
        f"{links.network_gb_s:g} GB/s per GPU, {links.message_latency_us:g} us per point-to-point message, "
        f"fp8 quantisation {links.fp8_quant_gb_s:g} GB/s of bf16 per GPU (not overlapped), "
        f"{b.bucket_mb} MB rounds; most messages of one rank: {p.max_messages}",
        flush=True,
    )
    print(json.dumps(result), flush=True)
    return result


# -- the measured run -----------------------------------------------------------------------------


def _groups(b: WeightSyncBench, port: int, sync_rank: int, stage_member):
    """The sync group, and the baseline's per-stage broadcast groups this rank belongs to
    ({stage: group}), all over one TCP store hosted by sync rank 0."""
    dims, generators = b.trainer_dims(), b.generator_dims().world_size
    world = disaggregated_world_size(dims, b.generator_dims())
    store = dist.TCPStore("127.0.0.1", port, world, is_master=sync_rank == 0, timeout=datetime.timedelta(seconds=300))
    sync = init_sync_group("127.0.0.1", port, world, sync_rank, store=store)
    stages = {}
    for s in range(dims.pp):
        rank = stage_member(s)
        if rank is not None:
            stages[s] = init_sync_group(
                "127.0.0.1", port, 1 + generators, rank, group_name=f"baseline-pp_{s}", store=store
            )
    return sync, stages


def _baseline_fp8(b: WeightSyncBench, spec: ModelSpec) -> bool:
    """The baseline quantises like SGLang's block-fp8 checkpoints, per HF weight: only for shapes
    whose shards are whole 128x128 blocks (real Llamas, llama-mini); else it sends bf16."""
    return b.fp8 and fp8_supported(spec, b.generator_dims().tp, b.generator_dims().ep)


def _settings(b: WeightSyncBench, spec: ModelSpec) -> SyncSettings:
    """megarl's sync as the bench runs it: bf16 on the wire, --fp8, --verify, --bucket-mb."""
    geometry = SyncGeometry(spec, b.trainer_dims(), b.generator_dims())
    return SyncSettings(
        geometry, WireFormat(fp8=b.fp8, dtype=torch.bfloat16, bucket_bytes=b.bucket_bytes, verify=b.verify)
    )


def _baseline(settings: SyncSettings, b: WeightSyncBench) -> SyncSettings:
    """The baseline's: the same, but bf16 where its per-HF-weight fp8 cannot go (_baseline_fp8)."""
    return replace(settings, wire=replace(settings.wire, fp8=_baseline_fp8(b, settings.geometry.spec)))


def _trainer_rank(b: WeightSyncBench, port: int, out_dir: str) -> None:
    # Megatron-Core costs ~4 s over torch's import (and prints TE/Apex warnings): only the trainer
    # ranks build a Megatron model; --plan-only and the generator ranks need none of it
    from megatron.core import parallel_state

    rank = init_distributed()
    spec = model_spec(b.model)
    dims = b.trainer_dims()
    if dist.get_world_size() != dims.world_size:
        raise MegarlError(
            f"trainer world of {dist.get_world_size()} ranks, the layout {dims.describe()} has {dims.world_size}"
        )
    init_megatron(dims)
    config = transformer_config(
        spec, dims.tp, dims.pp, params_dtype=torch.bfloat16, perform_initialization=False, ep=dims.ep, etp=dims.etp
    )
    chunks = build_model_chunks(spec, config)
    tp_rank, pp_rank = (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
    )
    experts = dims.ep * dims.expert_tp > 1
    expert_shard = (
        parallel_state.get_expert_model_parallel_rank() * dims.expert_tp
        + parallel_state.get_expert_tensor_parallel_rank()
    )
    with torch.no_grad():  # any finite values do for timing (Megatron's initialiser is slow on CPU), but
        # consistent ones: replicated tensors (norms, routers) equal on every TP rank, DP replicas equal;
        # an expert shard set by its EP and ETP ranks (equal over the experts' data parallel group)
        for i, (name, p) in enumerate(chunks[0].named_parameters()):
            if is_expert_param(name):
                shard = expert_shard
            else:
                shard = tp_rank if getattr(p, "tensor_model_parallel", False) else 0
            seed = (pp_rank * 1000 + i) * 1000 + shard
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.02)
    sources = {dims.rank(pp_rank=s): s for s in range(dims.pp)}  # each stage's TP-0 / DP-0 rank broadcasts
    sync, stages = _groups(b, port, rank, lambda s: 0 if sources.get(rank) == s else None)
    settings = _settings(b, spec)
    ours = TrainerSync(settings, chunks, sync, rank)
    params = megatron_params(chunks)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    expert_group = parallel_state.get_expert_tensor_and_model_parallel_group() if experts else None
    stage_group = stages.get(sources.get(rank))
    times, base_times, stats, base = [], [], None, None
    for i in range(b.iters + 1):  # the first round of each warms up; the two alternate
        dist.barrier(group=sync)
        start = time.perf_counter()
        stats = ours.push(i)
        dist.barrier(group=sync)
        times.append(time.perf_counter() - start)
        dist.barrier(group=sync)
        start = time.perf_counter()
        base = gather_broadcast_send(_baseline(settings, b), rank, params, tp_group, stage_group, expert_group)
        dist.barrier(group=sync)
        base_times.append(time.perf_counter() - start)
    Path(out_dir, f"trainer{rank}.json").write_text(
        json.dumps(
            {
                "seconds": times[1:],
                "baseline_seconds": base_times[1:],
                "wire_messages": stats.wire_messages,
                "pairs": len(ours.sender.peers),
                "baseline": base,
            }
        )
    )
    shutdown()


def _generator_rank(b: WeightSyncBench, port: int, out_dir: str) -> None:
    rank = init_distributed()
    spec = model_spec(b.model)
    dims, gdims = b.trainer_dims(), b.generator_dims()
    sync_rank = dims.world_size + rank
    sync, stages = _groups(b, port, sync_rank, lambda s: 1 + rank)
    replica, tp_rank = gdims.replica_of(rank)
    params = allocate_generator_params(spec, gdims.tp, tp_rank, torch.bfloat16, b.fp8, ep=gdims.ep)
    settings = _settings(b, spec)
    ours = GeneratorSync(settings, replica, tp_rank, params, sync)
    base_params = allocate_generator_params(
        spec, gdims.tp, tp_rank, torch.bfloat16, _baseline_fp8(b, spec), ep=gdims.ep
    )
    stats, base = None, None
    for i in range(b.iters + 1):
        dist.barrier(group=sync)
        stats = ours.pull(expected_version=i)
        dist.barrier(group=sync)
        dist.barrier(group=sync)
        base = gather_broadcast_receive(
            _baseline(settings, b), tp_rank, base_params, [stages[s] for s in range(dims.pp)]
        )
        dist.barrier(group=sync)
    Path(out_dir, f"generator{rank}.json").write_text(
        json.dumps(
            {
                "received": stats.bytes_received,
                "wire_messages": stats.wire_messages,
                "pairs": len(ours.receiver.peers),
                "baseline": base,
                "different_weights": different_weights(params, base_params),
            }
        )
    )
    shutdown()


def different_weights(ours: dict, baseline: dict) -> list:
    """Generator parameters that differ after megarl's sync (``ours``) and the baseline's, bitwise.
    Where megarl holds fp8 and the baseline bf16 (it cannot cut block-fp8 tensors at these
    shapes), the baseline's bf16 shard is quantised first, as SGLang's loader quantises a bf16
    update and megarl's receiver quantises what arrives as bf16; the scales must match too."""

    def raw(t):
        return t.view(torch.uint8) if t.dtype == fp8_format.FP8_DTYPE else t

    expected = {}
    for name, t in baseline.items():
        if name in ours and ours[name].dtype == fp8_format.FP8_DTYPE and t.dtype != fp8_format.FP8_DTYPE:
            q, scale_inv = fp8_format.quantize(t)
            expected[name], expected[fp8_format.scale_name(name)] = q, scale_inv
        else:
            expected[name] = t
    names = sorted(set(ours) | set(expected))
    return [
        n
        for n in names
        if n not in ours
        or n not in expected
        or ours[n].dtype != expected[n].dtype
        or not torch.equal(raw(ours[n]), raw(expected[n]))
    ]


def run(b: WeightSyncBench) -> dict:
    if b.plan_only:
        return plan_only(b)
    if b.config is not None:
        raise ConfigError("--config goes with --plan-only (the measured run takes --model and the layout flags)")
    b = resolved(b)
    dims, gdims = b.trainer_dims(), b.generator_dims()
    if dims.vpp > 1:
        raise ConfigError(
            f"--src-vpp {dims.vpp}: the measured run builds one model chunk per PP rank; "
            "virtual stages go with --plan-only"
        )

    spec = model_spec(b.model)
    spec.check_parallelism(dims.tp, dims.pp, None, dims.ep, dims.etp)
    check_sglang_tp(spec, gdims.tp, gdims.ep)
    if b.fp8:
        _check_fp8_flag(spec, gdims)
    trainer_size, generators = dims.world_size, gdims.world_size
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="megarl_bench_") as out:
        run_worlds(
            [
                (_trainer_rank, trainer_size, (b, port, out)),
                (_generator_rank, generators, (b, port, out)),
            ]
        )
        ts = [json.loads(Path(out, f"trainer{r}.json").read_text()) for r in range(trainer_size)]
        gens = [json.loads(Path(out, f"generator{r}.json").read_text()) for r in range(generators)]
    different = {r: g["different_weights"] for r, g in enumerate(gens) if g["different_weights"]}
    if different:
        rank, names = next(iter(different.items()))
        raise MegarlError(
            f"weight-sync bench: megarl's sync and the baseline left different weights on generator rank(s) "
            f"{sorted(different)} (rank {rank}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}); "
            f"the timings compare different results, so no speed-up is reported"
        )
    plan = build_plan(spec, dims, gdims)
    # every worker's own shard, once (fp8 weights at one byte plus their scales)
    minimum = int(sum(transfer_bytes(t.dst_param, t.numel, b.fp8) for ts_ in plan.transfers.values() for t in ts_))
    t0 = ts[0]
    ours_s, base_s = statistics.median(t0["seconds"]), statistics.median(t0["baseline_seconds"])
    gathered = sum(t["baseline"]["gathered_bytes"] for t in ts)
    broadcast = sum(g["baseline"]["received_bytes"] for g in gens)
    baseline_fp8 = _baseline_fp8(b, spec)
    formats = {
        "megarl": "fp8" if b.fp8 else "bf16",
        "baseline": "fp8" if baseline_fp8 else "bf16",
    }
    result = {
        "model": b.model,
        "parameters_M": round(spec.num_parameters() / 1e6, 1),
        "trainer": dims.describe(),
        "generator": gdims.describe(),
        "fp8": b.fp8,
        "verify": b.verify,
        "iters": b.iters,
        "bucket_MB": b.bucket_mb,
        "wire_formats": formats,
        "same_wire_format": formats["megarl"] == formats["baseline"],
        "bytes_moved": sum(g["received"] for g in gens),
        "min_bytes": minimum,
        "seconds": ours_s,
        "seconds_each": t0["seconds"],
        "wire_messages": sum(g["wire_messages"] for g in gens),  # data point-to-point messages, all receivers
        "max_wire_messages_per_receiver": max(g["wire_messages"] for g in gens),
        "header_messages": sum(g["pairs"] for g in gens),
        "baseline_bytes_moved": gathered + broadcast,
        "baseline_gathered_bytes": gathered,
        "baseline_broadcast_bytes_received": broadcast,
        "baseline_all_gathers_per_trainer_rank": max(t["baseline"]["all_gathers"] for t in ts),
        "baseline_broadcasts_per_worker": gens[0]["baseline"]["broadcasts"],
        "baseline_fp8": baseline_fp8,
        "baseline_seconds": base_s,
        "baseline_seconds_each": t0["baseline_seconds"],
        "baseline_same_weights": True,  # checked above: the run fails otherwise
        "speedup_vs_gather_broadcast": base_s / ours_s,
    }
    if not result["same_wire_format"]:
        result["note"] = (
            f"not the same bytes: the baseline sends bf16 (block fp8 needs every SGLang TP{gdims.tp} shard of "
            f"{b.model}'s linear weights to be whole 128x128 blocks), megarl sends fp8 with scales where a sender "
            f"fills a whole 128-aligned box and bf16 (quantised on arrival) elsewhere; the byte counts and the "
            f"speed-up compare the two formats, not only the two algorithms"
        )
        print(f"weight-sync bench: {result['note']}", file=sys.stderr, flush=True)
    print(json.dumps(result), flush=True)
    return result
