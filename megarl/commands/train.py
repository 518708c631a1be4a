"""`megarl train` and `megarl sft`: a run from a config file and ``key=value`` overrides."""

from __future__ import annotations

import argparse

CONFIG_FIELDS = (
    "config fields (type, default, allowed values, meaning): docs/config-reference.md, or `megarl config [SECTION]`"
)


def add_train_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. optimizer.lr=1e-6 run.steps=20")
    parser.add_argument(
        "--prepare-only",
        action="store_true",
        help="convert the model (first use) and print the world size; start no ranks",
    )
    parser.add_argument(
        "--replay",
        metavar="RUN_DIR/rollouts.jsonl",
        help="train on a run's recorded rollouts, no generator (debug a loss); compares the losses",
    )


def run_train(args: argparse.Namespace) -> None:
    from megarl.train import train

    train(args.config, args.overrides, args.prepare_only, args.replay)


def add_sft_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True)
    parser.add_argument("--data", required=True, help='.jsonl of {"messages": [...]} or {"prompt", "response"}')
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8, help="records per optimizer step")
    parser.add_argument("overrides", nargs="*", help="config overrides, as for megarl train")


def run_sft(args: argparse.Namespace) -> None:
    from megarl.train import sft

    sft(args.config, args.data, args.overrides, args.epochs, args.batch_size)
