#!/usr/bin/env python
"""Convert a Hugging Face Llama checkpoint (safetensors or GGUF) to a Megatron dist checkpoint.

    python tools/convert_hf_to_megatron.py --hf-model PATH --output DIR --tp N --pp M [--gguf-file NAME]

Spawns TP x PP local CPU ranks (or runs as one rank of an existing torchrun
world of that size). The result loads at any other TP/PP.
Same as `megarl convert hf-to-megatron ...`.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megarl.cli_common import run_tool  # noqa: E402
from megarl.convert import hf_to_megatron  # noqa: E402
from megarl.convert.cli import add_hf_to_megatron_args  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_hf_to_megatron_args(p)
    hf_to_megatron.convert(hf_to_megatron.from_args(p.parse_args()))


# The guard matters: ranks are spawned processes that re-import this file.
if __name__ == "__main__":
    sys.exit(run_tool(main))
