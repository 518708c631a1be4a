"""`megarl bench weight-sync`: its flags are WeightSyncBench's fields by name (bench/weight_sync.py)."""

from __future__ import annotations

import argparse

from megarl.commands import options


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="preset (llama3-8b/70b/405b, llama-mini, tiny, qwen3-30b-a3b, qwen3-235b-a22b, ...), smollm2, "
        "or a path (default llama-mini)",
    )
    _add_layout_args(p)
    p.add_argument("--fp8", action="store_true", help="generators serve block fp8 (senders quantise)")
    p.add_argument("--verify", action="store_true", help="checksum every destination shard")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument(
        "--bucket-mb",
        type=int,
        default=64,
        help="megarl's round size per pair and the baseline's bucket size (the same for both)",
    )
    p.add_argument("--plan-only", action="store_true", help="plan from shapes and predict the time; start nothing")
    p.add_argument(
        "--config",
        default=None,
        help="with --plan-only: take the model, trainer tp/pp/dp/vpp/ep/etp, generator tp/replicas/ep, fp8 and "
        "links from a megarl run config (flags given override it)",
    )
    p.add_argument("overrides", nargs="*", default=[], help="with --config: config overrides, e.g. trainer.tp=8")
    _add_link_args(p)


def _add_layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--src-tp", type=int, default=None, help="trainer TP (default 4)")
    p.add_argument("--src-pp", type=int, default=None, help="trainer PP (default 1)")
    p.add_argument("--src-dp", type=int, default=None, help="trainer DP (default 1)")
    p.add_argument(
        "--src-vpp", type=int, default=None, help="trainer virtual pipeline stages per PP rank (default 1; --plan-only)"
    )
    p.add_argument("--src-ep", type=int, default=None, help="trainer expert parallel (default 1)")
    p.add_argument("--src-etp", type=int, default=None, help="trainer expert tensor parallel (default: --src-tp)")
    p.add_argument("--dst-tp", type=int, default=None, help="generator TP (default 2)")
    p.add_argument("--dst-replicas", type=int, default=None, help="generator replicas (default 2)")
    p.add_argument("--dst-ep", type=int, default=None, help="SGLang --ep-size inside a replica's TP (default 1)")


def _add_link_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus-per-node", type=int, default=None, help="default 8 (or the config's plan section)")
    p.add_argument("--nvlink-gb-s", type=float, default=None, help="per GPU, within a node (default 450)")
    p.add_argument("--network-gb-s", type=float, default=None, help="per GPU, across nodes (default 50)")
    p.add_argument(
        "--latency-us",
        dest="message_latency_us",
        type=float,
        default=None,
        help="fixed cost of one point-to-point message (default 20, NCCL's ~10-30 us)",
    )
    p.add_argument(
        "--fp8-quant-gb-s",
        type=float,
        default=None,
        help="bf16 bytes per second one GPU quantises to block fp8 (default 90: megarl's eager quantiser on an H100)",
    )


def run(args: argparse.Namespace) -> None:
    from megarl.bench.weight_sync import WeightSyncBench
    from megarl.bench.weight_sync import run as run_bench

    run_bench(WeightSyncBench(**{**options(args), "overrides": tuple(args.overrides)}))
