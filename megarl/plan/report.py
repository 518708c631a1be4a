"""Readable tables and one-line JSON for plans (LlamaRL s.7) and the PipelineRL appendix."""

from __future__ import annotations

import json
from typing import List, Optional

from megarl.plan.costs import MemoryBreakdown
from megarl.plan.hardware import GB
from megarl.plan.inputs import generator_text
from megarl.plan.llamarl_model import AsyncCandidate, PlanResult, SyncCandidate
from megarl.plan.pipeline_appendix import PAPER_CASE, AppendixInputs, LagRow

# LlamaRL Table 3: measured step-time speed-ups over the DeepSpeed-Chat-like baseline
# (the scenarios that price the paper's setting are in scenarios.py).
LLAMARL_TABLE3 = (
    ("llama3-8b", 256, 2.52),
    ("llama3-70b", 256, 3.98),
    ("llama3-405b", 1024, 10.7),
)


def trainer_json(t) -> dict:
    """A trainer layout (``TrainerLayout``) by Megatron-LM's names (recompute "none" is recompute_granularity None)."""
    d = t.dims
    out = {
        "tp": d.tp,
        "pp": d.pp,
        "dp": d.dp,
        "micro_batch": t.micro_batch,
        "recompute": t.recompute,
        "gpus": d.world_size,
        "sequence_parallel": t.sp,
        "cp": d.cp,
        "vpp": d.vpp,
    }
    if t.recompute == "full":
        out.update(recompute_method=t.recompute_method or "uniform", recompute_num_layers=t.recompute_num_layers or 1)
    if t.recompute == "selective":
        out["recompute_modules"] = list(t.recompute_modules)
    if t.micro_batch_tokens:
        out["micro_batch_tokens"] = t.micro_batch_tokens
    return out


def _r(x: Optional[float], digits: int = 3):
    return None if x is None else round(x, digits)


def memory_json(m: MemoryBreakdown) -> dict:
    return {
        "layout": m.layout,
        "total_gb": _r(m.total / GB, 2),
        "capacity_gb": _r(m.capacity / GB, 1),
        "fits": m.fits,
        "overflow": m.overflow,
        "parts_gb": {k: _r(v / GB, 2) for k, v in m.parts.items()},
    }


def async_json(a: Optional[AsyncCandidate]) -> Optional[dict]:
    if a is None:
        return None
    return {
        "trainer": trainer_json(a.trainer),
        "generator": {
            "tp": a.generator.tp,
            "pp": a.generator.pp,
            "replicas": a.replicas,
            "gpus": a.generator_gpus,
            "sequences_in_flight": a.sequences,
        },
        "theta": _r(a.theta),
        "eta_t": _r(a.eta_t, 5),
        "eta_g": _r(a.eta_g, 5),
        "train_seconds": _r(a.train_seconds),
        "generate_seconds": _r(a.generate_seconds),
        "weight_sync_seconds": _r(a.weight_sync_seconds),
        "weight_sync_method": a.weight_sync_method,
        "step_seconds": _r(a.step_seconds),
        "memory": {"trainer": memory_json(a.trainer_memory), "generator": memory_json(a.generator_memory)},
    }


def sync_json(s: Optional[SyncCandidate]) -> Optional[dict]:
    if s is None:
        return None
    return {
        "layout": trainer_json(s.trainer),
        "generator_precision": s.generator_precision,
        "batching": s.batching,
        "sequences_in_flight": s.sequences,
        "eta_t": _r(s.eta_t, 5),
        "eta_g": _r(s.eta_g, 5),
        "train_seconds": _r(s.train_seconds),
        "generate_seconds": _r(s.generate_seconds),
        "step_seconds": _r(s.step_seconds),
        "memory": {"trainer": memory_json(s.trainer_memory), "colocated_generator": memory_json(s.generator_memory)},
    }


def plan_json(r: PlanResult) -> dict:
    i = r.inputs
    return {
        "model": i.spec and "custom" or i.model,
        "parameters_B": _r(r.params / 1e9, 2),
        "gpus": i.gpus,
        "gpus_per_node": i.gpus_per_node,
        "gpu_memory_gb": i.gpu_memory_gb,
        "batch": i.batch,
        "prompts": i.prompts,
        "samples_per_prompt": i.samples_per_prompt,
        "prompt_tokens": i.prompt_tokens,
        "response_tokens": i.lengths.describe(),
        "trainer_precision": i.trainer_precision,
        "generator_precision": i.generator_precision,
        "sync_generator_precision": i.sync_precision,
        "sync_batching": i.sync_batching,
        "max_lag_steps": i.max_lag_steps,
        "measured": i.measured if isinstance(i.measured, (str, type(None))) else "dict",
        "asynchronous": async_json(r.best_async),
        "synchronous": sync_json(r.best_sync),
        "speedup": _r(r.speedup),
        "layouts_evaluated": {"async": r.async_evaluated, "sync": r.sync_evaluated},
        "notes": r.notes,
    }


def _table(rows: List[List[str]]) -> str:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def plan_text(r: PlanResult) -> str:
    i, a, s = r.inputs, r.best_async, r.best_sync
    lines = [
        f"megarl plan: {i.model if i.spec is None else 'custom model'} ({r.params / 1e9:.1f}B parameters) on "
        f"{i.gpus} GPUs ({i.gpus_per_node}/node, {i.gpu_memory_gb:g} GB), batch {i.batch} = {i.prompts} prompts "
        f"x {i.samples_per_prompt}, {i.prompt_tokens} prompt + {i.lengths.describe()} response tokens",
        "",
    ]
    rows = [["", "role", "layout", "GPUs", "in flight", "seconds"]]
    if a is not None:
        rows.append(
            [
                "asynchronous",
                "trainer",
                a.trainer.describe() + f" x DP{a.dp}",
                str(a.trainer_gpus),
                "",
                f"train {a.train_seconds:.1f}",
            ]
        )
        rows.append(
            [
                "",
                "generator",
                f"{generator_text(a.generator)} {i.generator_precision} x {a.replicas}",
                str(a.generator_gpus),
                str(a.sequences),
                f"generate {a.generate_seconds:.1f}",
            ]
        )
        rows.append(
            [
                "",
                "",
                f"theta = {a.theta:.2f}",
                "",
                "",
                f"weight sync {a.weight_sync_seconds:.2f} ({a.weight_sync_method})",
            ]
        )
        rows.append(["", "step", "max(train, generate) + weight sync", "", "", f"{a.step_seconds:.1f}"])
    if s is not None:
        rows.append(
            [
                "synchronous",
                "colocated",
                s.trainer.describe() + f" x DP{s.dp}",
                str(s.gpus),
                "",
                f"train {s.train_seconds:.1f}",
            ]
        )
        rows.append(
            [
                "",
                "",
                f"generates {s.generator_precision}, {s.batching} batches",
                "",
                str(s.sequences),
                f"generate {s.generate_seconds:.1f}",
            ]
        )
        rows.append(["", "step", "generate + train", "", "", f"{s.step_seconds:.1f}"])
    lines.append(_table(rows))
    lines.append("")
    if r.speedup is not None:
        lines.append(f"predicted speed-up (T_sync / T_async): {r.speedup:.2f}x")
    lines.append("memory per GPU:")
    memories = [a.trainer_memory, a.generator_memory] if a else []
    memories += [s.trainer_memory, s.generator_memory] if s else []
    lines.extend("  " + m.describe() for m in memories)
    lines.extend(f"note: {n}" for n in r.notes)
    return "\n".join(lines)


def appendix_json(a: AppendixInputs, rows: List[LagRow], knee: int) -> dict:
    return {
        "gpus": a.gpus,
        "batch": a.batch,
        "lengths": a.lengths.describe(),
        "utilisation": "custom" if a.utilisation else f"roofline (saturates at h = {a.saturation:.0f})",
        "peak_generation_tokens_s_per_gpu": _r(a.u(1e12), 1),
        "train_tokens_s_per_gpu": _r(a.tau, 1),
        "max_inflight": a.max_inflight,
        "knee_lag": knee,
        "rows": [
            {
                "g_max": row.g_max,
                "speedup": _r(row.speedup),
                "conventional_tokens_s": _r(row.conventional.tokens_s, 1),
                "conventional_inflight_per_gpu": _r(row.conventional.inflight, 2),
                "pipeline_tokens_s": _r(row.pipeline.tokens_s, 1),
                "pipeline_generator_gpus": row.pipeline.generator_gpus,
                "pipeline_inflight_per_gpu": _r(row.pipeline.inflight, 2),
                "pipeline_lag": _r(row.pipeline.lag, 2),
            }
            for row in rows
        ],
    }


def appendix_text(a: AppendixInputs, rows: List[LagRow], knee: int) -> str:
    head = (
        f"PipelineRL appendix model: N = {a.gpus}, B = {a.batch}, lengths {a.lengths.describe()}, "
        f"U(h) {'custom' if a.utilisation else f'roofline saturating at h = {a.saturation:.0f}'}, "
        f"U_max {a.u(1e12):.0f} and tau {a.tau:.0f} tokens/s per GPU"
    )
    table = [["g_max", "conventional tok/s", "Q/GPU", "PipelineRL tok/s", "I gen GPUs", "H/GPU", "speed-up"]]
    for row in rows:
        c, p = row.conventional, row.pipeline
        table.append(
            [
                str(row.g_max),
                f"{c.tokens_s:.0f}",
                f"{c.inflight:.1f}",
                f"{p.tokens_s:.0f}",
                str(p.generator_gpus),
                f"{p.inflight:.1f}",
                f"{row.speedup:.2f}x",
            ]
        )
    return f"{head}\n\n{_table(table)}\n\nPipelineRL reaches 99% of its ideal throughput at g_max = {knee}"


def compare_text(rows: List[dict]) -> str:
    table = [["case", "GPUs", "T_sync (s)", "T_async (s)", "predicted", "paper", "predicted / paper"]]
    for row in rows:
        table.append(
            [
                row["case"],
                str(row["gpus"]),
                row.get("sync", ""),
                row.get("async", ""),
                f"{row['predicted']:.2f}x",
                f"{row['paper']:.2f}x",
                f"{row['predicted'] / row['paper']:.2f}",
            ]
        )
    return _table(table)


def dumps(obj) -> str:
    return json.dumps(obj, sort_keys=False)


__all__ = [
    "LLAMARL_TABLE3",
    "PAPER_CASE",
    "plan_json",
    "plan_text",
    "appendix_json",
    "appendix_text",
    "compare_text",
    "config_plan_json",
    "config_plan_text",
    "dumps",
]


# -- `megarl plan --config FILE` -----------------------------------------------------------------


def config_plan_json(p) -> dict:
    """A run config's plan (megarl.plan.config_plan.ConfigPlan) as one JSON object."""
    out = {"config": p.path, "gpus_used": p.gpus_used}
    out.update(plan_json(p.searched))
    sync = p.searched.best_sync
    out["predicted_step_seconds"] = {
        "configured": _r(p.configured.step_seconds),
        "balanced": _r(p.balanced and p.balanced.step_seconds),
        "searched": _r(p.searched.best_async and p.searched.best_async.step_seconds),
        "synchronous_baseline": _r(sync and sync.step_seconds),
    }
    out["configured"] = dict(async_json(p.configured), fits=p.configured.fits, speedup=_r(p.speedup(p.configured)))
    out["balanced"] = p.balanced and dict(async_json(p.balanced), speedup=_r(p.speedup(p.balanced)))
    out["paper_scenario"] = p.scenario
    out["notes"] = p.notes
    return out


def config_plan_text(p) -> str:
    i, c, b, s = p.inputs, p.configured, p.balanced, p.searched
    lines = [
        f"megarl plan --config {p.path}: {i.model} ({s.params / 1e9:.1f}B parameters), {p.gpus_used} of "
        f"{i.gpus} GPUs ({i.gpus_per_node}/node, {i.gpu_memory_gb:g} GB), batch {i.batch} = {i.prompts} prompts x "
        f"{i.samples_per_prompt}, {i.prompt_tokens} prompt + {i.lengths.describe()} response tokens, trainer "
        f"{i.trainer_precision}, generator {i.generator_precision}",
        "",
    ]
    rows = [
        [
            "layout",
            "trainer",
            "GPUs",
            "generator",
            "GPUs",
            "in flight",
            "train s",
            "generate s",
            "sync s",
            "step s",
            "vs sync",
        ]
    ]

    def row(name, a):
        if a is None:
            return [name, "none fits", "", "", "", "", "", "", "", "", ""]
        speedup = p.speedup(a)
        return [
            name,
            f"{a.trainer.describe()} x DP{a.dp}",
            str(a.trainer_gpus),
            f"{generator_text(a.generator)} x {a.replicas}",
            str(a.generator_gpus),
            str(a.sequences),
            f"{a.train_seconds:.1f}",
            f"{a.generate_seconds:.1f}",
            f"{a.weight_sync_seconds:.2f} ({a.weight_sync_method})",
            f"{a.step_seconds:.1f}",
            "" if speedup is None else f"{speedup:.2f}x",
        ]

    rows.append(row("configured" + ("" if c.fits else " (does not fit)"), c))
    rows.append(row("balanced split", b))
    rows.append(row("searched best", s.best_async))
    if s.best_sync is not None:
        a = s.best_sync
        rows.append(
            [
                "sync baseline",
                f"{a.trainer.describe()} x DP{a.dp}",
                str(a.gpus),
                f"colocated, {a.generator_precision}",
                "",
                str(a.sequences),
                f"{a.train_seconds:.1f}",
                f"{a.generate_seconds:.1f}",
                "",
                f"{a.step_seconds:.1f}",
                "1.00x",
            ]
        )
    lines.append(_table(rows))
    lines += [
        "",
        "configured layout, memory per GPU:",
        "  " + c.trainer_memory.describe(),
        "  " + c.generator_memory.describe(),
    ]
    if b is not None and (b.trainer_gpus, b.sequences) != (c.trainer_gpus, c.sequences):
        lines.append(
            f"balanced split: trainer.dp={b.dp}, generator.replicas={b.replicas}, generator.max_running={b.sequences}"
        )
    if p.scenario is not None:
        sc = p.scenario
        lines.append(
            f"paper scenario {sc['scenario']} (`megarl plan --scenario {sc['scenario']}`): "
            f"{sc['predicted_speedup']:.2f}x predicted vs {sc['paper_speedup']:.2f}x in the paper "
            f"({'within' if sc['within_15_percent'] else 'NOT within'} 15%)"
        )
    lines.extend(f"note: {n}" for n in p.notes)
    return "\n".join(lines)
