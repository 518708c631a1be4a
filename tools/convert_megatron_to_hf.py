#!/usr/bin/env python
"""Export a Megatron dist checkpoint written by megarl to a Hugging Face directory.

    python tools/convert_megatron_to_hf.py --megatron DIR --output DIR [--dtype bf16]

One process, one layer in memory at a time; reads a checkpoint saved at any TP/PP.
Same as `megarl convert megatron-to-hf ...`.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megarl.cli_common import run_tool  # noqa: E402
from megarl.convert import megatron_to_hf  # noqa: E402
from megarl.convert.cli import add_megatron_to_hf_args  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_megatron_to_hf_args(p)
    megatron_to_hf.convert(megatron_to_hf.from_args(p.parse_args()))


if __name__ == "__main__":
    sys.exit(run_tool(main))
