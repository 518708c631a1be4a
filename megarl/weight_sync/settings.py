"""The settings every weight-sync endpoint takes, frozen: between which layouts, and what goes on the wire.

    SyncGeometry   between which layouts: the model, the trainer's Megatron layout (ParallelDims,
                   its layer spec's norm names, its vocabulary padding) and the generators' SGLang
                   layout (GeneratorDims). Both ends derive the same plan from it (planner.py).
    WireFormat     what is sent and how: block fp8 or not, the dtype of the other bytes, the bytes
                   of one round per pair, small payloads packed below a size, checksums verified.
    SyncSettings   the two together: what a sender and a receiver of one sync must agree on.
    SyncRendezvous where a sync group across worlds forms (SGLang's workers and the trainer ranks).

Endpoints once took these as 10-14 positional arguments, each caller repeating them in its own order
(a sender and a receiver built with different bucket bytes plan different rounds and hang); now
factory.py builds one SyncSettings from the config and every endpoint takes it (NeMo-RL builds its
weight senders from frozen specs the same way). ``to_dict`` / ``from_dict`` are the JSON form SGLang's
workers read at their first update (generator/sglang/serving.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional

import torch

from megarl.layout import disaggregated_world_size
from megarl.models.megatron_model import DEFAULT_VOCAB_DIVISIBLE_BY
from megarl.models.spec import ModelSpec
from megarl.parallel_dims import GeneratorDims, ParallelDims, generator_rank
from megarl.runtime.rendezvous import init_sync_group
from megarl.weight_sync.planner import SyncPlan, build_plan

DEFAULT_BUCKET_BYTES = 64 << 20

# Payloads below this size share one flat buffer per (pair, round). Why 1 MiB: a
# point-to-point message has a fixed cost -- NCCL ~10-30 us per send/recv, about
# what a 50 GB/s NIC needs for 1 MiB, while packing 1 MiB costs one copy in and one
# out at HBM speed (~1 us); gloo on this project's 2-core CPU machine ~220-280 us,
# about what copying 1 MiB in and out costs there (~0.1-0.2 ms each way), so 1 MiB
# is near the break-even on CPU and safely below it on GPUs. Larger rectangles
# (nearly all bytes of a real model: a 405B TP8 linear shard is tens of MB) stay
# zero-copy: packing them would add memory traffic and staging memory for nothing.
PACK_BELOW_BYTES = 1 << 20

WIRE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class SyncGeometry:
    """Between which layouts the weights move (shapes only: the plan is a function of this)."""

    spec: ModelSpec
    trainer: ParallelDims
    generator: GeneratorDims
    norm_names: str = "local"  # the trainer's layer spec ("local" | "te"), which names its norms
    vocab_divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY  # Megatron's vocabulary padding

    def plan(self) -> SyncPlan:
        return build_plan(self.spec, self.trainer, self.generator, self.norm_names, self.vocab_divisible_by)

    def generator_rank(self, replica: int, tp_rank: int) -> int:
        """Generator replica ``replica``'s TP rank ``tp_rank`` in the sync group."""
        return generator_rank(self.trainer, self.generator, replica, tp_rank)

    @property
    def world_size(self) -> int:
        """Ranks of the sync group: the trainer's, then every generator worker's."""
        return disaggregated_world_size(self.trainer, self.generator)


@dataclass(frozen=True)
class WireFormat:
    """What a sync sends and how; a sender and its receivers must hold equal ones."""

    fp8: bool = False  # block-fp8 linears (e4m3 + 128x128 scales), quantised by the sender where it can
    dtype: torch.dtype = torch.bfloat16  # every other byte: the generator's dtype, exact, never wider
    bucket_bytes: int = DEFAULT_BUCKET_BYTES  # at most this much per pair and round
    verify: bool = False  # checksums per message, recomputed by the receiver over what landed
    pack_below_bytes: int = PACK_BELOW_BYTES  # payloads below this share one buffer per pair and round

    def __post_init__(self):
        if self.dtype not in WIRE_DTYPES.values():
            raise ValueError(f"wire dtype {self.dtype} is not one of {sorted(WIRE_DTYPES)}")

    @classmethod
    def named(cls, dtype: str, **fields) -> "WireFormat":
        """``dtype`` as the config names it (generator.dtype: bf16 | fp32)."""
        if dtype not in WIRE_DTYPES:
            raise ValueError(f"wire dtype {dtype!r} is not one of {sorted(WIRE_DTYPES)}")
        return cls(dtype=WIRE_DTYPES[dtype], **fields)

    @property
    def dtype_name(self) -> str:
        return next(name for name, d in WIRE_DTYPES.items() if d == self.dtype)


@dataclass(frozen=True)
class SyncSettings:
    """One weight sync's settings: what both of its ends must agree on."""

    geometry: SyncGeometry
    wire: WireFormat = field(default_factory=WireFormat)

    def to_dict(self) -> dict:
        """Flat, JSON-ready (the keys of sync_config.json that SGLang's workers read)."""
        g, w = self.geometry, self.wire
        return {
            "spec": g.spec.to_dict(),
            "trainer": asdict(g.trainer),
            "generator": asdict(g.generator),
            "norm_names": g.norm_names,
            "vocab_divisible_by": g.vocab_divisible_by,
            "fp8": w.fp8,
            "wire_dtype": w.dtype_name,
            "bucket_bytes": w.bucket_bytes,
            "verify": w.verify,
            "pack_below_bytes": w.pack_below_bytes,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SyncSettings":
        geometry = SyncGeometry(
            ModelSpec.from_dict(d["spec"]),
            ParallelDims(**d["trainer"]),
            GeneratorDims(**d["generator"]),
            d.get("norm_names", "local"),
            d.get("vocab_divisible_by", DEFAULT_VOCAB_DIVISIBLE_BY),
        )
        wire = WireFormat.named(
            d.get("wire_dtype", "bf16"),
            fp8=d["fp8"],
            bucket_bytes=d.get("bucket_bytes", DEFAULT_BUCKET_BYTES),
            verify=d.get("verify", False),
            pack_below_bytes=d.get("pack_below_bytes", PACK_BELOW_BYTES),
        )
        return cls(geometry, wire)


@dataclass(frozen=True)
class SyncRendezvous:
    """Where a sync group spanning two worlds forms: a TCP store at ``host:port`` both sides meet
    at; ``backend`` gloo when a trainer rank may share a GPU with a worker (bytes then go through
    CUDA IPC), nccl when every sync rank has its own GPU."""

    host: str
    port: int
    backend: Optional[str] = None  # None: nccl where CUDA is, else gloo (init_sync_group's choice)
    timeout_s: float = 600.0
    group_name: str = "megarl_weight_sync"

    def join(self, world_size: int, rank: int):
        """This rank's sync group (a collective: every one of ``world_size`` ranks calls it)."""
        return init_sync_group(
            self.host,
            self.port,
            world_size,
            rank,
            group_name=self.group_name,
            backend=self.backend,
            timeout_s=self.timeout_s,
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SyncRendezvous":
        return cls(d["host"], d["port"], d.get("backend"), d.get("timeout_s", 600.0), d["group_name"])
