"""`megarl config [SECTION]`: the config reference (megarl/config_reference.py), or one section or field."""

from __future__ import annotations

import argparse

HELP = "every config field's type, default, allowed values and meaning (docs/config-reference.md is its output)"


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "name", nargs="?", default=None, help="a section (trainer, reward.judge) or a field (rollout.max_lag)"
    )


def run(args: argparse.Namespace) -> None:
    from megarl.config_reference import lookup, reference_markdown

    print(reference_markdown() if args.name is None else lookup(args.name), end="")
