"""Predicted sync time of a plan: link bandwidths, a per-message cost, fp8 quantisation.

A model, not a measurement. Ranks sit ``gpus_per_node`` to a node in sync-group
order (trainer ranks, then generator ranks). A pair on one node talks over
NVLink, other pairs over the network; each GPU's NVLink and NIC work
concurrently, and all GPUs at once. Each GPU, sending and receiving counted
separately, takes

    max(NVLink bytes / NVLink bandwidth, network bytes / network bandwidth)  (LlamaRL s.5.2's model)
  + point-to-point messages x per-message latency                            (alpha-beta model)
  + bf16 bytes it quantises to fp8 / quantisation throughput                 (senders; receivers for
                                                                              toy shapes only)

and the sync takes as long as the busiest GPU. Messages are counted as the
transport sends them (transport.wire_rounds: one header per pair, then per
round one pack of the small payloads plus each large payload on its own).
Quantisation is charged in full, not overlapped with the transfers (the
transport does quantise round k+1 while round k is on the wire, so this
term is an upper bound).

Defaults, each overridable:

- ``nvlink_gb_s`` 450: H100 SXM NVLink 4, 900 GB/s bidirectional per GPU.
- ``network_gb_s`` 50: one 400 Gb/s InfiniBand NIC per GPU (DGX H100).
- ``message_latency_us`` 20: the fixed cost of one point-to-point message
  through NCCL, the middle of the ~10-30 us usually seen for small send/recv
  between nodes (megarl.plan.hardware prices a small all-reduce across nodes at
  40 us, within a node at 8 us).
- ``fp8_quant_gb_s`` 90 (GB/s of bf16 input): megarl's quantiser is eager
  PyTorch. Per element of a 128-aligned box, the sender reads bf16 and writes
  fp32 (6 bytes), copies it into the box (8), and fp8.quantize zero-fills the
  padded copy (4), copies in (8), takes |x| (8), the block amax (4), divides
  (8), clamps (8) and casts to e4m3 (5): 59 bytes of HBM traffic per element,
  29.5 per input byte. At megarl.plan.hardware's H100 figures (3.35 TB/s at
  80% efficiency) that is 2.68e12 / 29.5 = 91 GB/s. A fused kernel reading
  bf16 once and writing e4m3 once would be ~10x faster.
"""

from __future__ import annotations

import gc
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

import torch

from megarl.weight_sync.fp8 import BLOCK, is_fp8_param
from megarl.weight_sync.planner import SyncPlan
from megarl.weight_sync.schedule import pair_messages, receiver_quantised_params, sender_quantised_boxes
from megarl.weight_sync.transport import DEFAULT_BUCKET_BYTES, PACK_BELOW_BYTES, wire_rounds

DEFAULT_MESSAGE_LATENCY_US = 20.0
DEFAULT_FP8_QUANT_GB_S = 90.0


@dataclass(frozen=True)
class Links:
    gpus_per_node: int = 8
    nvlink_gb_s: float = 450.0  # per GPU, within a node
    network_gb_s: float = 50.0  # per GPU, across nodes (400 Gb/s NIC per GPU)
    message_latency_us: float = DEFAULT_MESSAGE_LATENCY_US  # fixed cost of one point-to-point message
    fp8_quant_gb_s: float = DEFAULT_FP8_QUANT_GB_S  # bf16 bytes per second one GPU quantises to block fp8


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


def _wire_dtype(wire_bytes: int):
    return {2: torch.bfloat16, 4: torch.float32}[wire_bytes]


def rank_messages(
    plan: SyncPlan,
    fp8: bool,
    wire_bytes: int = 2,
    bucket_bytes: Optional[int] = None,
    pack_below_bytes: Optional[int] = None,
) -> Dict[int, Dict[str, float]]:
    """Per rank: point-to-point messages sent and received (headers included), and the
    bf16 bytes it quantises (``quant``), exactly as the transport would for this plan."""
    # Only containers are created here, none freed: the cyclic collector would rescan the
    # plan's ~10^6 rectangles again and again (half the time at 405B) for nothing.
    paused = gc.isenabled()
    gc.disable()
    try:
        return _rank_messages(plan, fp8, wire_bytes, bucket_bytes, pack_below_bytes)
    finally:
        if paused:
            gc.enable()


def _rank_messages(plan, fp8, wire_bytes, bucket_bytes, pack_below_bytes):
    bucket_bytes = DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
    pack_below_bytes = PACK_BELOW_BYTES if pack_below_bytes is None else pack_below_bytes
    wire_dtype = _wire_dtype(wire_bytes)
    boxes = sender_quantised_boxes(plan) if fp8 else {}
    out: Dict[int, Dict[str, float]] = defaultdict(lambda: defaultdict(float))
    # A pair's messages depend only on where its rectangles land (and which of its fp8
    # weights the senders quantise): generator replicas repeat the same pairs.
    seen: Dict[tuple, tuple] = {}
    for (src, dst), transfers in plan.transfers.items():
        key = (
            tuple((t.dst_param, t.dst_rows, t.dst_cols) for t in transfers),
            tuple(sorted({t.dst_param for t in transfers if (dst, t.dst_param) in boxes})),
        )
        if key not in seen:
            messages = pair_messages(plan, src, dst, fp8, boxes)
            n = 1 + sum(r.wire_messages for r in wire_rounds(messages, wire_dtype, bucket_bytes, pack_below_bytes))
            seen[key] = (n, sum(m.wire_elements() * wire_bytes for m in messages if m.kind == "fp8"))
        n, quantised = seen[key]
        out[src]["send"] += n
        out[dst]["recv"] += n
        out[src]["quant_send"] += quantised
    if fp8:
        for dst, layout in plan.dst_layouts.items():
            late = receiver_quantised_params(plan, dst, boxes)
            out[dst]["quant_recv"] += sum(t.numel * wire_bytes for t in layout if t.name in late)
    return out


@dataclass
class RankTime:
    rank: int
    direction: str  # send | recv
    nvlink_bytes: float = 0.0
    network_bytes: float = 0.0
    messages: int = 0
    quantised_bytes: float = 0.0
    bandwidth_s: float = 0.0
    latency_s: float = 0.0
    quantise_s: float = 0.0

    @property
    def seconds(self) -> float:
        return self.bandwidth_s + self.latency_s + self.quantise_s


@dataclass
class Prediction:
    seconds: float
    busiest: RankTime  # the GPU (and direction) that sets the time
    busiest_bandwidth_only: RankTime  # the busiest by the bandwidth term alone (LlamaRL's model)
    links: Links
    max_messages: Dict[str, int] = field(default_factory=dict)  # most messages of any rank, per direction

    def as_dict(self) -> dict:
        def rank(r: RankTime) -> dict:
            return {**asdict(r), "seconds": r.seconds}

        return {
            "seconds": self.seconds,
            "busiest": rank(self.busiest),
            "bandwidth_only_seconds": self.busiest_bandwidth_only.bandwidth_s,
            "max_messages_per_rank": self.max_messages,
            "assumptions": asdict(self.links),
        }


def predict(
    plan: SyncPlan,
    fp8: bool,
    links: Links = Links(),
    wire_bytes: int = 2,
    bucket_bytes: Optional[int] = None,
    pack_below_bytes: Optional[int] = None,
) -> Prediction:
    by_rank = rank_bytes(plan, fp8, links, wire_bytes)
    counts = rank_messages(plan, fp8, wire_bytes, bucket_bytes, pack_below_bytes)
    times: List[RankTime] = []
    for rank in sorted(set(by_rank) | set(counts)):
        totals, c = by_rank.get(rank, {}), counts.get(rank, {})
        for direction in ("send", "recv"):
            nv, net = totals.get(f"{direction}_nvlink", 0.0), totals.get(f"{direction}_network", 0.0)
            n, q = int(c.get(direction, 0)), c.get(f"quant_{direction}", 0.0)
            if not (nv or net or n or q):
                continue
            times.append(
                RankTime(
                    rank,
                    direction,
                    nv,
                    net,
                    n,
                    q,
                    bandwidth_s=max(nv / (links.nvlink_gb_s * 1e9), net / (links.network_gb_s * 1e9)),
                    latency_s=n * links.message_latency_us * 1e-6,
                    quantise_s=q / (links.fp8_quant_gb_s * 1e9),
                )
            )
    if not times:
        empty = RankTime(-1, "send")
        return Prediction(0.0, empty, empty, links)
    busiest = max(times, key=lambda r: r.seconds)
    max_messages = {d: max((r.messages for r in times if r.direction == d), default=0) for d in ("send", "recv")}
    return Prediction(busiest.seconds, busiest, max(times, key=lambda r: r.bandwidth_s), links, max_messages)


def predict_seconds(plan: SyncPlan, fp8: bool, links: Links = Links(), wire_bytes: int = 2) -> float:
    return predict(plan, fp8, links, wire_bytes).seconds
