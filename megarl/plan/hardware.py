"""The accelerator the planner prices time and memory on (H100 SXM 80 GB by default).

Every number here is a datasheet figure or a stated efficiency; nothing is
fitted to a paper's result. Efficiencies are the fraction of a peak that real
kernels reach (Megatron bf16 training, memory-bound decode GEMVs, NCCL
all-reduce latencies), and each can be overridden from the command line.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from megarl.errors import ConfigError

GB = 1e9

# Bytes per weight element as stored for the matmuls. "fp8" is SGLang's block
# fp8 (e4m3 + one fp32 scale per 128x128 block: 1 + 4/16384 bytes).
WEIGHT_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0 + 4.0 / (128 * 128)}


def weight_bytes(precision: str, field: str) -> float:
    if precision not in WEIGHT_BYTES:
        raise ConfigError(f"{field}={precision!r} is not a known precision; choose one of {sorted(WEIGHT_BYTES)}")
    return WEIGHT_BYTES[precision]


@dataclass(frozen=True)
class Hardware:
    name: str = "H100-SXM-80GB"
    memory_gb: float = 80.0
    # CUDA context, NCCL buffers, allocator fragmentation, framework workspaces.
    reserved_gb: float = 6.0
    bf16_tflops: float = 989.0  # dense
    fp8_tflops: float = 1979.0  # dense
    hbm_tb_s: float = 3.35
    # Decode GEMV/attention kernels stream weights and KV at ~80% of peak HBM bandwidth.
    hbm_efficiency: float = 0.8
    gpus_per_node: int = 8
    nvlink_gb_s: float = 450.0  # per GPU, per direction, within a node
    network_gb_s: float = 50.0  # per GPU, across nodes (one 400 Gb/s NIC per GPU)
    # One small (decode-sized) all-reduce: NVLink custom all-reduce vs NCCL over InfiniBand.
    allreduce_latency_nvlink_us: float = 8.0
    allreduce_latency_network_us: float = 40.0
    # Megatron bf16 model-FLOPs utilisation of the matmuls alone; TP communication,
    # the pipeline bubble and the data-parallel gradient exchange are priced separately.
    train_mfu: float = 0.40
    prefill_mfu: float = 0.50
    decode_mfu: float = 0.60  # matmul efficiency once decode is compute bound (large batch)
    # Per decode step: scheduler, sampling, CUDA-graph replay (SGLang-class engine).
    decode_step_overhead_ms: float = 1.0
    # Eager PyTorch (megarl's torch engine): host time to dispatch and launch one kernel.
    eager_op_us: float = 8.0
    # Fraction of the trainer's TP all-reduce time not hidden behind compute.
    tp_comm_exposed: float = 0.5
    # Fraction of the gradient reduce-scatter / parameter all-gather left exposed once the
    # overlap the config asks for (optimizer.overlap_grad_reduce / overlap_param_gather) is taken.
    dp_comm_exposed: float = 1.0

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "name" and (not isinstance(value, (int, float)) or value < 0):
                raise ConfigError(f"hardware.{f.name} must be a non-negative number, got {value!r}")
        for name in (
            "memory_gb",
            "bf16_tflops",
            "fp8_tflops",
            "hbm_tb_s",
            "hbm_efficiency",
            "gpus_per_node",
            "nvlink_gb_s",
            "network_gb_s",
            "train_mfu",
            "prefill_mfu",
            "decode_mfu",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"hardware.{name} must be positive, got {getattr(self, name)!r}")
        if self.reserved_gb >= self.memory_gb:
            raise ConfigError(f"hardware.reserved_gb={self.reserved_gb} leaves no memory of memory_gb={self.memory_gb}")

    @property
    def usable_bytes(self) -> float:
        return (self.memory_gb - self.reserved_gb) * GB

    def peak_flops(self, precision: str) -> float:
        return (self.fp8_tflops if precision == "fp8" else self.bf16_tflops) * 1e12

    @property
    def hbm_bytes_s(self) -> float:
        return self.hbm_tb_s * 1e12 * self.hbm_efficiency

    def link_bytes_s(self, group: int) -> float:
        """Per-GPU bandwidth of a collective over `group` consecutive GPUs."""
        return (self.nvlink_gb_s if group <= self.gpus_per_node else self.network_gb_s) * GB

    def allreduce_latency_s(self, group: int) -> float:
        us = self.allreduce_latency_nvlink_us if group <= self.gpus_per_node else self.allreduce_latency_network_us
        return us * 1e-6


H100 = Hardware()
