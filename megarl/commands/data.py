"""`megarl data ...`: prompt datasets written as jsonl."""

from __future__ import annotations

from megarl.commands import Command
from megarl.data.arithmetic import add_data_args, run_data
from megarl.tools_demo import add_calculator_sft_args, run_calculator_sft

COMMANDS = (
    Command("arithmetic", "multi-digit arithmetic word problems (jsonl)", add_data_args, run_data),
    Command(
        "calculator-sft",
        "training problems as calculator episodes, for megarl sft (jsonl)",
        add_calculator_sft_args,
        run_calculator_sft,
    ),
)
