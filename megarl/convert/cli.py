"""Argument parsers for the conversion tools (tools/*.py and `megarl convert ...`).

Torch-free, as megarl/convert/__init__.py says why; each converter builds its settings from
these arguments (``from_args`` in hf_to_megatron.py and megatron_to_hf.py)."""

from __future__ import annotations

import argparse

from megarl.convert import DTYPE_NAMES


def add_hf_to_megatron_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hf-model", required=True, help="HF model directory (config.json + safetensors), or a .gguf file")
    p.add_argument("--output", required=True, help="output directory (must be empty or absent)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size to build the checkpoint at")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to build the checkpoint at")
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel size (models with experts; carved out of data-parallel ranks)",
    )
    p.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default: --tp, as Megatron)")
    p.add_argument("--gguf-file", default=None, help="name of a GGUF file inside --hf-model")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_NAMES], help="parameter dtype (auto: as stored)")
    p.add_argument("--vocab-divisible-by", type=int, default=128, help="pad the vocabulary to a multiple of this x TP")


def add_megatron_to_hf_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--megatron", required=True, help="checkpoint root (with latest_checkpointed_iteration.txt) or iteration dir"
    )
    p.add_argument("--output", required=True, help="output HF directory (must be empty or absent)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_NAMES], help="output dtype (auto: as stored)")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file to write")
    p.add_argument(
        "--fp8",
        action="store_true",
        help="block-fp8 linear layers with 128x128 weight_scale_inv (SGLang's format; others bf16)",
    )
