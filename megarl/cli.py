"""The `megarl` command: a table of subcommands, each with its module's ``add_args`` / ``run``
(megarl/commands/, plan/cli.py, convert/cli.py)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from megarl import __version__
from megarl.cli_common import run_tool
from megarl.commands import (
    Command,
    add_commands,
    bench,
    bench_weight_sync,
    config,
    convert,
    data,
    demo,
    evaluate,
    plot,
    sglang_command,
    subcommands,
)
from megarl.commands.train import CONFIG_FIELDS, add_sft_args, add_train_args, run_sft, run_train
from megarl.plan.cli import add_plan_args, run_plan

BENCHMARKS = (
    Command(
        "train-step",
        "RL train-step tokens/s: Megatron path vs plain transformers",
        bench.add_train_step_args,
        bench.run_train_step,
    ),
    Command(
        "generate",
        "generation tokens/s: megarl's engine vs transformers' generate",
        bench.add_generate_args,
        bench.run_generate,
    ),
    Command(
        "machine",
        "this machine's GEMM / attention / bandwidth rates at the demo model's shapes and the roofline they imply "
        "(one JSON line)",
        bench.add_machine_args,
        bench.run_machine,
    ),
    Command(
        "attention",
        "the trainer's core attention fwd+bwd: Megatron's unfused path vs the SDPA one the local spec uses",
        bench.add_attention_args,
        bench.run_attention,
    ),
    Command(
        "episodes",
        "multi-turn episodes: each turn's KV cache parked for the next vs every context prefilled",
        bench.add_episodes_args,
        bench.run_episodes,
    ),
    Command(
        "async-vs-sync",
        "samples/s of the async loop vs the sync baseline, same workload",
        bench.add_async_vs_sync_args,
        bench.run_async_vs_sync,
    ),
    Command(
        "learning",
        "learning claims as arms x seeds of short runs, each final policy scored on a held-out set, t intervals",
        bench.add_learning_args,
        bench.run_learning,
    ),
    Command(
        "moe-decode",
        "the torch engine's MoE decode: experts routed on the device vs the per-expert loop (layer and step)",
        bench.add_moe_decode_args,
        bench.run_moe_decode,
    ),
    Command(
        "gpu-check",
        "`megarl train` on one GPU (trainer and engine sharing it): MFU, tokens/s, sync GB/s (JSON lines)",
        bench.add_gpu_check_args,
        bench.run_gpu_check,
    ),
    Command(
        "weight-sync",
        "shard-to-shard weight sync vs slime's gather+broadcast (or --plan-only: a predicted time)",
        bench_weight_sync.add_args,
        bench_weight_sync.run,
    ),
)

COMMANDS = (
    Command(
        "demo",
        "CPU demo: SmolLM2 -> Megatron TP3, answer a prompt, check against transformers",
        demo.add_args,
        demo.run,
    ),
    Command(
        "train",
        "asynchronous (or sync) RL: megarl train --config FILE [key=value ...]",
        add_train_args,
        run_train,
        epilog=CONFIG_FIELDS,
    ),
    Command(
        "sft",
        "supervised fine-tuning on chat records: megarl sft --config FILE --data F.jsonl",
        add_sft_args,
        run_sft,
        epilog=CONFIG_FIELDS,
    ),
    Command(
        "sglang-command",
        "the launch command of each replica's SGLang server (attach mode)",
        sglang_command.add_args,
        sglang_command.run,
    ),
    Command(
        "eval",
        "greedy accuracy (and pass@k) of a checkpoint on a prompt set (one JSON line)",
        evaluate.add_args,
        evaluate.run,
    ),
    Command(
        "plot", "PNG curves of runs' metrics.jsonl (reward, KL, lag, ESS, time), overlaid", plot.add_args, plot.run
    ),
    Command("config", config.HELP, config.add_args, config.run),
    subcommands("data", "prompt datasets", "dataset", data.COMMANDS),
    subcommands("bench", "benchmarks: ratios measured side by side in one run", "benchmark", BENCHMARKS),
    Command(
        "plan",
        "capacity planning (LlamaRL s.7, PipelineRL App. A); --config FILE [--dry-run-topology] for a run config",
        add_plan_args,
        run_plan,
    ),
    subcommands("convert", "checkpoint conversion (same as tools/convert_*.py)", "direction", convert.COMMANDS),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megarl", description="Megatron-Core backend for RL of LLMs")
    parser.add_argument("--version", action="version", version=f"megarl {__version__}")
    add_commands(parser.add_subparsers(dest="command", required=True), COMMANDS)
    return parser


def dispatch(args: argparse.Namespace) -> None:
    # Each command imports what it runs: the parser stays torch-free (0.2 s), `megarl train`'s
    # launching process imports no torch (its ranks do: tests/multiprocess/test_launch.py), and
    # `megarl plan` / `megarl data` never pay torch's 2-3 s.
    args.run_command(args)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return run_tool(lambda: dispatch(args))


# Spawned ranks re-import the main module: keep the entry point guarded.
if __name__ == "__main__":
    sys.exit(main())
