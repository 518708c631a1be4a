"""The `megarl` command."""

from __future__ import annotations

import argparse
import sys

from megarl.cli_common import run_tool


def build_parser() -> argparse.ArgumentParser:
    from megarl.convert.cli import add_hf_to_megatron_args, add_megatron_to_hf_args

    parser = argparse.ArgumentParser(prog="megarl", description="Megatron-Core backend for RL of LLMs")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="CPU demo: SmolLM2 -> Megatron TP3, answer a prompt, check against transformers")
    demo.add_argument("--workdir", default="runs/demo")
    demo.add_argument("--tp", type=int, default=3, help="tensor-parallel ranks (must divide 9 heads, 3 KV heads)")
    demo.add_argument("--max-new-tokens", type=int, default=12)

    bench = sub.add_parser("bench", help="benchmarks: ratios measured side by side in one run")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True)
    train_step = bench_sub.add_parser("train-step", help="RL train-step tokens/s: Megatron path vs plain transformers")
    train_step.add_argument("--workdir", default="runs/bench")
    train_step.add_argument("--samples", type=int, default=8)
    train_step.add_argument("--steps", type=int, default=3, help="timed steps per side (after one warm-up)")
    train_step.add_argument("--max-tokens", type=int, default=256, help="Megatron micro-batch row length")

    convert = sub.add_parser("convert", help="checkpoint conversion (same as tools/convert_*.py)")
    convert_sub = convert.add_subparsers(dest="direction", required=True)
    add_hf_to_megatron_args(convert_sub.add_parser("hf-to-megatron", help="Hugging Face / GGUF -> Megatron"))
    add_megatron_to_hf_args(convert_sub.add_parser("megatron-to-hf", help="Megatron -> Hugging Face"))
    return parser


def dispatch(args: argparse.Namespace) -> None:
    if args.command == "demo":
        from megarl.demo import run_demo

        run_demo(args.workdir, args.tp, args.max_new_tokens)
    elif args.command == "bench":
        from megarl.bench import train_step

        train_step.run(train_step.BenchSettings(
            workdir=args.workdir, samples=args.samples, steps=args.steps, max_tokens=args.max_tokens
        ))
    elif args.command == "convert":
        from megarl.convert import cli, hf_to_megatron, megatron_to_hf

        if args.direction == "hf-to-megatron":
            hf_to_megatron.convert(cli.hf_to_megatron_from_args(args))
        else:
            megatron_to_hf.convert(cli.megatron_to_hf_from_args(args))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_tool(lambda: dispatch(args))


# Spawned ranks re-import the main module: keep the entry point guarded.
if __name__ == "__main__":
    sys.exit(main())
