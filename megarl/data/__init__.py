"""Prompt data: loading prompt files, tokenizing, resumable sampling order, synthetic arithmetic."""

from megarl.data.arithmetic import add_data_args, generate_arithmetic, run_data, write_jsonl
from megarl.data.datasets import (
    PromptRecord,
    PromptStream,
    TokenizedPrompt,
    load_prompts,
    parse_record,
    tokenize_prompts,
)

__all__ = [
    "PromptRecord",
    "PromptStream",
    "TokenizedPrompt",
    "add_data_args",
    "generate_arithmetic",
    "load_prompts",
    "parse_record",
    "run_data",
    "tokenize_prompts",
    "write_jsonl",
]
