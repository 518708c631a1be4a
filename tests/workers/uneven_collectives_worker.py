"""Rank body for test_gloo_uneven_collectives: Megatron's first-dimension all-gather (through
megatron_patches/gloo_uneven_collectives.py) and reduce-scatter (Megatron's own) with uneven split
sizes on gloo.

    torchrun --nproc-per-node 3 tests/workers/uneven_collectives_worker.py --out DIR

Rank r holds r + 1 rows (a zero-row rank included when --with-empty); every rank's tensor is a
known function of its rank, so the expected results are computed here without any collective.
Each rank writes the largest differences from them, and what Megatron's own gather does on gloo.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megarl.runtime.distributed import init_distributed, shutdown  # noqa: E402


def rows_of(rank: int, sizes, width: int = 5) -> torch.Tensor:
    start = sum(sizes[:rank])
    return torch.arange(start * width, (start + sizes[rank]) * width, dtype=torch.float32).reshape(-1, width) + 0.5


def contribution(rank: int, total_rows: int, width: int = 5) -> torch.Tensor:
    return torch.arange(total_rows * width, dtype=torch.float32).reshape(total_rows, width) * (rank + 1) - rank


def failure(fn) -> str:
    try:
        fn()
    except Exception as e:  # what gloo says: recorded, the test reads it
        return f"{type(e).__name__}: {e}"[:200]
    return ""


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rank = init_distributed()
    world = dist.get_world_size()
    from megatron.core.tensor_parallel import mappings

    from megatron_patches import gloo_uneven_collectives

    group = dist.new_group(list(range(world)))
    result = {}
    for label, sizes in [("uneven", [r + 1 for r in range(world)]), ("with_empty", [0] + [2] * (world - 1))]:
        mine = rows_of(rank, sizes)
        gathered = mappings._gather_along_first_dim(mine, group, output_split_sizes=sizes)
        expected = torch.cat([rows_of(r, sizes) for r in range(world)])
        result[f"gather_{label}_shape"] = list(gathered.shape)
        result[f"gather_{label}_diff"] = (gathered - expected).abs().max().item()
        total = sum(sizes)
        scattered = mappings._reduce_scatter_along_first_dim(contribution(rank, total), group, input_split_sizes=sizes)
        start = sum(sizes[:rank])
        want = sum(contribution(r, total) for r in range(world))[start : start + sizes[rank]]
        result[f"reduce_scatter_{label}_shape"] = list(scattered.shape)
        result[f"reduce_scatter_{label}_diff"] = (scattered - want).abs().max().item() if want.numel() else 0.0
        # the gradient flows through the autograd function as Megatron's does: a gather's backward
        # is the reduce-scatter of the same splits
        leaf = mine.clone().requires_grad_()
        out = mappings.gather_from_sequence_parallel_region(leaf, group=group, output_split_sizes=sizes)
        (out * torch.arange(out.numel(), dtype=torch.float32).reshape(out.shape)).sum().backward()
        weights = torch.arange(out.numel(), dtype=torch.float32).reshape(out.shape)[start : start + sizes[rank]]
        result[f"gather_grad_{label}_diff"] = (leaf.grad - world * weights).abs().max().item() if sizes[rank] else 0.0
    sizes = [r + 1 for r in range(world)]
    own_gather = gloo_uneven_collectives.megatron_functions["gather"]
    result["megatron_gather_error"] = failure(lambda: own_gather(rows_of(rank, sizes), group, sizes))
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    shutdown()


if __name__ == "__main__":
    main()
