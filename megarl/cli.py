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

    convert = sub.add_parser("convert", help="checkpoint conversion (same as tools/convert_*.py)")
    convert_sub = convert.add_subparsers(dest="direction", required=True)
    add_hf_to_megatron_args(convert_sub.add_parser("hf-to-megatron", help="Hugging Face / GGUF -> Megatron"))
    add_megatron_to_hf_args(convert_sub.add_parser("megatron-to-hf", help="Megatron -> Hugging Face"))
    return parser


def dispatch(args: argparse.Namespace) -> None:
    if args.command == "demo":
        from megarl.demo import run_demo

        run_demo(args.workdir, args.tp, args.max_new_tokens)
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
