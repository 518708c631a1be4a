"""Predicted sync time of a plan from link bandwidths (LlamaRL s.5.2's model).

Ranks sit ``gpus_per_node`` to a node in sync-group order (trainer ranks, then
generator ranks). A pair on one node talks over NVLink, other pairs over the
network; each GPU's NVLink and NIC work concurrently, and all GPUs at once, so
the predicted time is the busiest GPU's max(NVLink bytes / NVLink bandwidth,
network bytes / network bandwidth), sending and receiving counted separately.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict

from megarl.weight_sync.fp8 import BLOCK, is_fp8_param
from megarl.weight_sync.planner import SyncPlan


@dataclass(frozen=True)
class Links:
    gpus_per_node: int = 8
    nvlink_gb_s: float = 450.0  # per GPU, within a node
    network_gb_s: float = 50.0  # per GPU, across nodes (400 Gb/s NIC per GPU)


def transfer_bytes(dst_param: str, numel: int, fp8: bool, wire_bytes: int = 2) -> float:
    if fp8 and is_fp8_param(dst_param):
        return numel * (1.0 + 4.0 / (BLOCK * BLOCK))  # e4m3 + one fp32 scale per 128x128 block
    return float(numel * wire_bytes)


def rank_bytes(plan: SyncPlan, fp8: bool, links: Links, wire_bytes: int = 2) -> Dict[int, Dict[str, float]]:
    out: Dict[int, Dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for (src, dst), transfers in plan.transfers.items():
        n = sum(transfer_bytes(t.dst_param, t.numel, fp8, wire_bytes) for t in transfers)
        link = "nvlink" if src // links.gpus_per_node == dst // links.gpus_per_node else "network"
        out[src][f"send_{link}"] += n
        out[dst][f"recv_{link}"] += n
    return out


def predict_seconds(plan: SyncPlan, fp8: bool, links: Links = Links(), wire_bytes: int = 2) -> float:
    worst = 0.0
    for totals in rank_bytes(plan, fp8, links, wire_bytes).values():
        for direction in ("send", "recv"):
            t = max(totals[f"{direction}_nvlink"] / (links.nvlink_gb_s * 1e9),
                    totals[f"{direction}_network"] / (links.network_gb_s * 1e9))
            worst = max(worst, t)
    return worst
