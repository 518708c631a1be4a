"""`megarl sglang-command`: each replica's SGLang server command, for attach mode."""

from __future__ import annotations

import argparse


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True)
    parser.add_argument("--model-path", help="the Hugging Face directory the servers load (default: model.source)")
    parser.add_argument("--replica", type=int, help="print only this replica's command")
    parser.add_argument("--hosts", default="", help="the job's nodes in order: print host, URL and command per replica")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("overrides", nargs="*", help="config overrides, as for megarl train")


def run(args: argparse.Namespace) -> None:
    from megarl.generator.sglang.command import run as print_commands

    print_commands(args.config, args.overrides, args.model_path, args.replica, args.hosts, args.gpus_per_node)
