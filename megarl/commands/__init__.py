"""The `megarl` subcommands: each module here (and plan/cli.py, convert/cli.py) gives a command its
``add_args(parser)`` and ``run(args)``; megarl/cli.py holds the table that names them.

These modules import no torch at their top: building the parser stays ~0.2 s, and `megarl train`'s
launching process imports no torch (its ranks do). What a command runs is imported inside ``run``.
"""

from __future__ import annotations

import argparse
from typing import Callable, NamedTuple, Optional, Sequence

# The parser's own keys: which command and subcommand was chosen, and the function that runs it.
ROUTING = frozenset({"command", "benchmark", "dataset", "direction", "run_command"})


class Command(NamedTuple):
    name: str
    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Optional[Callable[[argparse.Namespace], object]]  # None: a group (its subcommands run)
    epilog: str = ""


def add_commands(sub, commands: Sequence[Command]) -> None:
    """One parser per command, each remembering the function that runs it."""
    for command in commands:
        parser = sub.add_parser(
            command.name,
            help=command.help,
            description=command.help,
            epilog=command.epilog or None,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        command.add_args(parser)
        if command.run is not None:  # a group's subcommands name their own
            parser.set_defaults(run_command=command.run)


def group(dest: str, commands: Sequence[Command]) -> Callable[[argparse.ArgumentParser], None]:
    """``add_args`` of a command made of subcommands (``megarl bench train-step``)."""

    def add_args(parser: argparse.ArgumentParser) -> None:
        add_commands(parser.add_subparsers(dest=dest, required=True), commands)

    return add_args


def subcommands(name: str, help: str, dest: str, commands: Sequence[Command]) -> Command:
    return Command(name, help, group(dest, commands), None)


def options(args: argparse.Namespace) -> dict:
    """The command's own options by their names: what a settings dataclass or a function takes as
    keywords, so no command copies them one by one (an option with no field of that name is a TypeError)."""
    return {k: v for k, v in vars(args).items() if k not in ROUTING}
