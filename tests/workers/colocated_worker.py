"""Rank body of the colocated-copy test: every rank loads the Megatron checkpoint at each
layout, copies it into its own TP-1 engine (fp32, bf16, fp8) and saves what it got.

    torchrun --nproc-per-node 4 tests/workers/colocated_worker.py --models DIR ... \
        --layouts 2x2 1x2 ... --out DIR

Writes OUT/<model>_<layout>_<engine>_rank<r>.pt (the engine tensors) and
OUT/stats_rank<r>.json: copy_colocated's own stats, plus the peak bytes of tensors
allocated during the call as seen by a dispatch mode (an independent measurement).
"""

import argparse
import json
import os
import sys
import weakref

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lm_batch import parse_layout  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from megarl.checkpointing.model_loading import load_megatron_model  # noqa: E402
from megarl.runtime.distributed import init_distributed, init_megatron, shutdown  # noqa: E402
from megarl.weight_sync.colocated import DEFAULT_FP8_BAND_BYTES, copy_colocated  # noqa: E402
from megarl.weight_sync.endpoints import allocate_generator_params  # noqa: E402

# engine dtype, fp8 linears, fp8 band bytes ("fp8-band128": one 128-row block row per band)
ENGINES = {
    "fp32": (torch.float32, False, DEFAULT_FP8_BAND_BYTES),
    "bf16": (torch.bfloat16, False, DEFAULT_FP8_BAND_BYTES),
    "fp8": (torch.float32, True, DEFAULT_FP8_BAND_BYTES),
    "fp8-band128": (torch.float32, True, 0),
}


class LiveAllocations(TorchDispatchMode):
    """Peak bytes of the storages that ops create while active and that are still referenced
    (a storage lives as long as its base tensor, which every view keeps alive)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.sizes = {}

    def _free(self, ptr):
        self.live -= self.sizes.pop(ptr, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr in inputs or ptr in self.sizes or ptr == 0:
                continue
            self.sizes[ptr] = t.untyped_storage().nbytes()
            self.live += self.sizes[ptr]
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._free, ptr)
        return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", required=True)
    p.add_argument("--layouts", nargs="+", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rank = init_distributed()
    world = dist.get_world_size()
    records = []
    for model in args.models:
        tag = os.path.basename(os.path.dirname(model.rstrip("/")))
        for name in args.layouts:
            layout = parse_layout(name)
            init_megatron(layout)
            spec, chunks = load_megatron_model(model, layout)
            for engine, (dtype, fp8, band_bytes) in ENGINES.items():
                params = allocate_generator_params(spec, 1, 0, dtype, fp8=fp8)
                tracker = LiveAllocations()
                with tracker:
                    stats = copy_colocated(spec, chunks, params, fp8_band_bytes=band_bytes)
                case = f"{tag}_{name}_{engine}"
                torch.save(params, os.path.join(args.out, f"{case}_rank{rank}.pt"))
                records.append(
                    {
                        "case": case,
                        "model": tag,
                        "layout": name,
                        "engine": engine,
                        "rank": rank,
                        "dp": world // (layout.tp * layout.pp),
                        "tracked_peak_bytes": tracker.peak,
                        **stats.as_dict(),
                    }
                )
            del chunks
    with open(os.path.join(args.out, f"stats_rank{rank}.json"), "w") as f:
        json.dump(records, f)
    shutdown()


if __name__ == "__main__":
    main()
