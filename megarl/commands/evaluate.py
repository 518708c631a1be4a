"""`megarl eval`: greedy accuracy (and pass@k) of a checkpoint on a prompt set."""

from __future__ import annotations

import argparse

from megarl.commands import options


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="a Megatron checkpoint dir, an HF dir, or smollm2")
    parser.add_argument("--data", required=True, help=".jsonl/.parquet prompts with answers, or arithmetic:<n>:<seed>")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--reward", default="math")
    parser.add_argument("--batch", type=int, default=32, help="sequences in flight")
    parser.add_argument("--cache-dir", default="runs/cache")
    parser.add_argument("--dump", help="write every prompt, response and reward to this .jsonl")
    parser.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "auto"],
        default=None,
        help="the dtype the engine decodes in. Default: a training run's checkpoint decodes in the "
        "run's generator.dtype (from RUN_DIR/config.json: what its rollouts and in-training "
        "evaluations used); any other checkpoint in fp32. auto: bf16 on CUDA and on CPUs with "
        "native bf16 (avx512_bf16 / amx_bf16; Arm bf16), else fp32",
    )
    _add_sampling_args(parser)
    parser.add_argument(
        "--tools",
        nargs="+",
        default=(),
        help="answer the policy's tool calls, as rollout.tools does in training (calculator, python, "
        "or dotted paths); each prompt describes them and an episode is scored on its final turn",
    )
    parser.add_argument("--max-turns", type=int, default=None, help="turns of a --tools episode (default 4)")


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--samples",
        type=int,
        default=1,
        help="> 1: also this many sampled answers per prompt: reward_mean@K and pass@K",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="of the sampled answers. Default: the run's rollout.temperature, else 1.0",
    )
    parser.add_argument(
        "--top-p", type=float, default=None, help="of the sampled answers. Default: the run's rollout.top_p, else 1.0"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="of the sampled answers' per-prompt seeds (those of "
        "the run's in-training evaluation). Default: the run's run.seed, else 1234",
    )


def run(args: argparse.Namespace) -> None:
    from megarl.evaluate import evaluate

    evaluate(**options(args))  # each option is the parameter of its name
