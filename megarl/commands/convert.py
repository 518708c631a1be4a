"""`megarl convert ...`: checkpoint conversion (the same as tools/convert_*.py)."""

from __future__ import annotations

import argparse

from megarl.commands import Command
from megarl.convert.cli import add_hf_to_megatron_args, add_megatron_to_hf_args


def run_hf_to_megatron(args: argparse.Namespace) -> None:
    from megarl.convert import hf_to_megatron

    hf_to_megatron.convert(hf_to_megatron.from_args(args))


def run_megatron_to_hf(args: argparse.Namespace) -> None:
    from megarl.convert import megatron_to_hf

    megatron_to_hf.convert(megatron_to_hf.from_args(args))


COMMANDS = (
    Command("hf-to-megatron", "Hugging Face / GGUF -> Megatron", add_hf_to_megatron_args, run_hf_to_megatron),
    Command("megatron-to-hf", "Megatron -> Hugging Face", add_megatron_to_hf_args, run_megatron_to_hf),
)
