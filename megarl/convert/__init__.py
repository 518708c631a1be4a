"""Checkpoint conversion between Hugging Face and Megatron layouts.

Kept torch-free (as is convert/cli.py): `megarl`'s argument parser adds the conversion
arguments for every command, `megarl train`'s launching process included, which imports
no torch (tests/multiprocess/test_launch.py)."""

# --dtype choices; megarl.convert.dtypes maps them to torch dtypes
DTYPE_NAMES = ("fp32", "bf16", "fp16")
