"""`megarl plan --config FILE --dry-run-topology`: check a job's layout without starting a process.

What a launch would find out only after minutes of start-up on a thousand
GPUs, checked from shapes in seconds:

- the model shards at the configured TP / PP (trainer) and TP (generator);
- the ranks: ``cfg.layout().topology().check(gpus_per_node)`` (every rank in
  exactly one executor, every TP group within a node), and the job fits the
  allocation (plan.gpus) in whole nodes, as scripts/launch.sh starts it;
- a sample of the longest length fits a trainer micro-batch;
- the weight sync as ``megarl.weight_sync.planner.build_plan`` plans it:
  senders are trainer ranks and receivers generator ranks of the topology,
  and every generator rank receives every element of its shard exactly once
  (transfers into each parameter lie inside its weight blocks, do not overlap,
  and add up to its ``covered_numel``). Per-rank pair counts and bytes come
  with it.

Every failure is a ConfigError naming the config field to change.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from megarl.errors import ConfigError
from megarl.layout import Topology, rank_ranges
from megarl.models.presets import preset_spec
from megarl.plan.config_plan import model_preset, plan_section, section_hardware


@dataclass
class DryRun:
    path: str
    model: str
    gpus_per_node: int
    topology: Topology
    checks: List[str] = field(default_factory=list)
    weight_sync: dict = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    seconds: float = 0.0
    sync_plan: Optional[object] = None  # the weight_sync SyncPlan checked (not in the JSON)

    def to_json(self) -> dict:
        t = self.topology
        return {
            "config": self.path,
            "model": self.model,
            "world_size": t.world_size,
            "gpus_per_node": self.gpus_per_node,
            "nodes": -(-t.world_size // self.gpus_per_node),
            "ranks_per_executor": {k: len(v) for k, v in t.executors.items()},
            "topology": t.describe(),
            "checks": self.checks,
            "weight_sync": self.weight_sync,
            "notes": self.notes,
            "seconds": round(self.seconds, 2),
        }


def dry_run(cfg, path: str = "config") -> DryRun:
    start = time.perf_counter()
    section = plan_section(cfg)
    gpn = section.gpus_per_node
    preset = model_preset(cfg, section)
    spec = preset_spec(preset)
    topo = cfg.layout().topology()
    report = DryRun(path, preset, gpn, topo)
    if topo.drivers_only:
        # SGLang spawns its own TP workers outside the torchrun world; they still occupy GPUs and
        # join the weight-sync group at ranks [T, T + G), which is the topology's world checked here.
        report.notes.append(
            f"generator.backend={cfg.generator.backend}: generator ranks are the weight-sync "
            f"group's (the engines' own workers), checked as ranks of a {topo.world_size}-GPU job"
        )
    report.checks.append(check_model_shards(cfg, spec, topo))
    report.checks.append(check_allocation(cfg, section.gpus, gpn, topo))
    check_tp_groups_within_nodes(cfg, topo, gpn)
    report.checks.extend(topo.check(gpn))
    report.checks.append(check_micro_batch(cfg))
    if not topo.colocated:
        hw = section_hardware(section)
        report.weight_sync, report.sync_plan = check_weight_sync(cfg, spec, topo, gpn, hw.nvlink_gb_s, hw.network_gb_s)
        ws = report.weight_sync
        report.checks.append(
            f"weight sync: {ws['pairs']} (trainer, generator) pairs; every one of "
            f"{ws['receivers']['ranks']} generator ranks receives each element of its "
            f"{ws['params_per_receiver']} parameters exactly once"
        )
    else:
        report.notes.append(
            "run.mode=sync: each rank copies its own weights into its colocated engine; no weight-sync plan to check"
        )
    report.seconds = time.perf_counter() - start
    return report


# -- the checks ---------------------------------------------------------------------------------


def check_model_shards(cfg, spec, topo: Topology) -> str:
    # megarl.weight_sync imports torch (~2 s): importing the dry run (and `megarl plan`) needs none
    from megarl.weight_sync.layouts import check_sglang_tp

    t, g = cfg.trainer, cfg.generator
    try:
        spec.check_parallelism(t.tp, t.pp)
    except ConfigError as err:
        raise ConfigError(f"trainer.tp={t.tp} / trainer.pp={t.pp}: {err}") from None
    if not topo.colocated:
        try:
            check_sglang_tp(spec, g.tp)
        except ConfigError as err:
            raise ConfigError(f"generator.tp={g.tp}: {err}") from None
    return f"the model shards: trainer TP{t.tp} x PP{t.pp} ({spec.num_layers // t.pp} layers per stage)" + (
        f", generator TP{g.tp}" if not topo.colocated else ""
    )


def check_allocation(cfg, plan_gpus, gpus_per_node: int, topo: Topology) -> str:
    used = cfg.layout().world_size
    split = (
        f"trainer {cfg.trainer_dims().world_size} + generator {cfg.generator_dims().world_size}"
        if not topo.colocated
        else f"trainer {cfg.trainer_dims().world_size}"
    )
    if plan_gpus is not None and used > plan_gpus:
        raise ConfigError(
            f"plan.gpus={plan_gpus}: the config needs {used} GPUs ({split}); shrink trainer.dp or "
            f"generator.replicas, or raise plan.gpus"
        )
    if used > gpus_per_node and used % gpus_per_node:
        raise ConfigError(
            f"trainer.dp / generator.replicas: the job's {used} ranks ({split}) are not whole nodes of "
            f"plan.gpus_per_node={gpus_per_node}; scripts/launch.sh starts GPUS_PER_NODE ranks per node"
        )
    nodes = -(-used // gpus_per_node)
    of = f" of plan.gpus={plan_gpus}" if plan_gpus is not None else ""
    if plan_gpus is not None and used < plan_gpus:
        of += f", {plan_gpus - used} idle"
    return f"the job takes {used} GPUs{of} ({split}) on {nodes} node{'s' if nodes > 1 else ''} of {gpus_per_node}"


def check_tp_groups_within_nodes(cfg, topo: Topology, gpus_per_node: int) -> None:
    """topology.check's rule, with the field to change named (Megatron's and SGLang's TP all-reduces
    run every layer and need NVLink)."""
    roles = [("trainer.tp", cfg.trainer.tp, topo.trainer_groups()["tp"])]
    if not topo.colocated:
        roles.append(("generator.tp", cfg.generator.tp, topo.generator_tp_groups()))
    for name, tp, groups in roles:
        for group in groups:
            if group[0] // gpus_per_node != group[-1] // gpus_per_node:
                hint = (
                    "use trainer.pp for more model parallelism"
                    if name == "trainer.tp"
                    else "make the trainer's ranks a multiple of it"
                )
                raise ConfigError(
                    f"{name}={tp}: TP group {rank_ranges(group)} spans nodes of plan.gpus_per_node="
                    f"{gpus_per_node} GPUs; keep TP within a node ({hint})"
                )


def check_micro_batch(cfg) -> str:
    longest = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens - 1  # input positions of one sample
    limit = cfg.trainer.max_tokens_per_microbatch
    if longest > limit:
        raise ConfigError(
            f"trainer.max_tokens_per_microbatch={limit}: a sample of data.max_prompt_tokens + "
            f"rollout.max_new_tokens needs {longest} positions in one micro-batch"
        )
    return f"the longest sample ({longest} positions) fits a micro-batch of {limit} tokens"


def check_weight_sync(
    cfg, spec, topo: Topology, gpus_per_node: int, nvlink_gb_s: float, network_gb_s: float
) -> Tuple[dict, object]:
    """Build the sync plan of the config's layout, check it (raises ConfigError), return (stats, plan)."""
    # torch-free import of the dry run: as in check_model_shards
    from megarl.weight_sync.planner import build_plan
    from megarl.weight_sync.predict import Links, predict_seconds, rank_bytes

    g = cfg.generator
    start = time.perf_counter()
    plan = build_plan(spec, topo.trainer, topo.generator)
    built = time.perf_counter() - start
    senders, receivers = set(topo.executors["trainer"]), set(topo.executors["generator"])
    weights = topo.channel("weights")
    for src, dst in plan.transfers:
        if src not in senders or src not in weights.src:
            raise ConfigError(
                f"weight sync: rank {src} sends but is not a trainer rank {rank_ranges(senders)} "
                f"(check trainer.tp/pp/dp against the weight-sync planner's numbering)"
            )
        if dst not in receivers or dst not in weights.dst:
            raise ConfigError(
                f"weight sync: rank {dst} receives but is not a generator rank {rank_ranges(receivers)} "
                f"(check generator.tp/replicas)"
            )
    unplanned = sorted(receivers - set(plan.dst_layouts))
    if unplanned:
        raise ConfigError(
            f"weight sync: generator ranks {rank_ranges(unplanned)} have no planned shard "
            f"(generator.tp={g.tp} x generator.replicas={g.replicas})"
        )
    check_coverage(plan)
    links = Links(gpus_per_node, nvlink_gb_s, network_gb_s)
    by_rank = rank_bytes(plan, g.fp8, links)
    pairs_out: Dict[int, int] = defaultdict(int)
    pairs_in: Dict[int, int] = defaultdict(int)
    for src, dst in plan.transfers:
        pairs_out[src] += 1
        pairs_in[dst] += 1

    def side(ranks: Sequence[int], pairs: Dict[int, int], direction: str) -> dict:
        sent = [sum(v for k, v in by_rank.get(r, {}).items() if k.startswith(direction)) / 1e9 for r in ranks]
        counts = [pairs.get(r, 0) for r in ranks]
        return {
            "ranks": len(ranks),
            "idle": sum(1 for c in counts if c == 0),
            "pairs": _stats(counts),
            "gb": _stats(sent, 3),
        }

    total = sum(v for totals in by_rank.values() for k, v in totals.items() if k.startswith("send"))
    network = sum(v for totals in by_rank.values() for k, v in totals.items() if k == "send_network")
    dst_params = {len(layout) for layout in plan.dst_layouts.values()}
    return {
        "pairs": len(plan.transfers),
        "transfers": sum(len(ts) for ts in plan.transfers.values()),
        "gb_per_sync": round(total / 1e9, 2),
        "network_fraction": round(network / total, 3) if total else 0.0,
        "precision": "fp8" if g.fp8 else "bf16",
        "predicted_seconds": round(predict_seconds(plan, g.fp8, links), 3),
        "params_per_receiver": max(dst_params),
        "senders": side(sorted(senders), pairs_out, "send"),
        "receivers": side(sorted(receivers), pairs_in, "recv"),
        "plan_build_seconds": round(built, 2),
    }, plan


def check_coverage(plan) -> None:
    """Every destination parameter gets each element of its weight blocks exactly once: transfers lie
    inside the blocks, do not overlap, and add up to the parameter's covered_numel."""
    into: Dict[Tuple[int, str], List[Tuple[Tuple[int, int], Tuple[int, int]]]] = defaultdict(list)
    for (_, dst), transfers in plan.transfers.items():
        for tr in transfers:
            into[(dst, tr.dst_param)].append((tr.dst_rows, tr.dst_cols))
    for dst, layout in plan.dst_layouts.items():
        for tensor in layout:
            rects = into.pop((dst, tensor.name), [])
            boxes = [((b.local_row, b.local_row + b.num_rows), (0, b.cols[1] - b.cols[0])) for b in tensor.blocks]
            got = sum((r[1] - r[0]) * (c[1] - c[0]) for r, c in rects)
            where = f"weight sync: generator rank {dst} parameter {tensor.name}"
            if got != tensor.covered_numel:
                raise ConfigError(f"{where} receives {got} elements, its shard holds {tensor.covered_numel}")
            for rows, cols in rects:
                if not any(_inside(rows, br) and _inside(cols, bc) for br, bc in boxes):
                    raise ConfigError(f"{where}: rows {rows} cols {cols} fall outside its weight blocks")
            for i, (rows, cols) in enumerate(rects):
                for rows2, cols2 in rects[i + 1 :]:
                    if _overlaps(rows, rows2) and _overlaps(cols, cols2):
                        raise ConfigError(f"{where}: rows {rows} cols {cols} arrive twice")
    if into:
        (dst, name), _ = next(iter(into.items()))
        raise ConfigError(f"weight sync: transfers into {name} on rank {dst}, which has no such parameter")


def _inside(a: Tuple[int, int], b: Tuple[int, int]) -> bool:
    return b[0] <= a[0] and a[1] <= b[1]


def _overlaps(a: Tuple[int, int], b: Tuple[int, int]) -> bool:
    return max(a[0], b[0]) < min(a[1], b[1])


def _stats(values: Sequence[float], digits: int = 0) -> dict:
    if not values:
        return {"min": 0, "median": 0, "max": 0}
    r = (lambda x: int(round(x))) if digits == 0 else (lambda x: round(x, digits))
    return {"min": r(min(values)), "median": r(statistics.median(values)), "max": r(max(values))}


# -- output -------------------------------------------------------------------------------------


def dry_run_text(d: DryRun) -> str:
    t, desc = d.topology, d.topology.describe()
    nodes = -(-t.world_size // d.gpus_per_node)
    lines = [
        f"megarl plan --dry-run-topology: {d.path} ({d.model}, {desc['placement']}, {t.world_size} ranks on {nodes} "
        f"node{'s' if nodes > 1 else ''} of {d.gpus_per_node}; no process started)",
        "",
    ]
    rows = [["executor", "ranks", "count", "layout"]]
    layouts = {"trainer": desc["trainer"], "generator": desc["generator"], "reward": "each replica's TP rank 0"}
    for name, ranks in t.executors.items():
        rows.append([name, desc["executors"][name], str(len(ranks)), layouts.get(name, "")])
    lines.append(_table(rows))
    g = desc["groups"]
    lines.append(
        f"groups: {g['trainer_tp']} trainer TP, {g['trainer_dp']} trainer DP, {g['trainer_pp']} trainer PP, "
        f"{g['generator_tp']} generator TP"
    )
    lines.extend(f"channel {c}" for c in desc["channels"])
    lines += ["", "checks passed:"] + [f"  - {c}" for c in d.checks]
    ws = d.weight_sync
    if ws:
        lines += [
            "",
            f"weight sync ({ws['precision']}): {ws['pairs']} pairs, {ws['transfers']} transfers, "
            f"{ws['gb_per_sync']} GB per sync ({ws['network_fraction']:.0%} across nodes), predicted "
            f"{ws['predicted_seconds']} s; plan built in {ws['plan_build_seconds']} s",
        ]
        rows = [["per rank", "ranks", "idle", "pairs min/median/max", "GB min/median/max"]]
        for name in ("senders", "receivers"):
            s = ws[name]
            rows.append(
                [
                    name,
                    str(s["ranks"]),
                    str(s["idle"]),
                    "/".join(str(s["pairs"][k]) for k in ("min", "median", "max")),
                    "/".join(str(s["gb"][k]) for k in ("min", "median", "max")),
                ]
            )
        lines.append(_table(rows))
    lines.extend(f"note: {n}" for n in d.notes)
    lines.append(f"done in {d.seconds:.1f} s")
    return "\n".join(lines)


def _table(rows: List[List[str]]) -> str:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return "\n".join("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
