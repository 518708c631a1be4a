"""`megarl demo`: SmolLM2 -> Megatron TP3 on CPU, answer a prompt, check against transformers."""

from __future__ import annotations

import argparse


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", default="runs/demo")
    parser.add_argument("--tp", type=int, default=3, help="tensor-parallel ranks (must divide 9 heads, 3 KV heads)")
    parser.add_argument("--max-new-tokens", type=int, default=12)


def run(args: argparse.Namespace) -> None:
    from megarl.demo import run_demo

    run_demo(args.workdir, args.tp, args.max_new_tokens)
