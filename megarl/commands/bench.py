"""`megarl bench ...`: ratios measured side by side in one run. Each benchmark's options are its
settings dataclass's fields by name (``options``): a flag and its field cannot drift apart."""

from __future__ import annotations

import argparse

from megarl.commands import options


def add_train_step_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", default="runs/bench")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="timed steps per side (after one warm-up)")
    p.add_argument(
        "--max-tokens", type=int, default=512, help="Megatron micro-batch row length (configs/demo_cpu.yaml's)"
    )
    p.add_argument(
        "--dtype",
        default="fp32",
        choices=["fp32", "bf16"],
        help="bf16: mixed precision on both sides (fp32 master weights)",
    )
    p.add_argument(
        "--no-roofline", dest="roofline", action="store_false", help="skip measuring this machine's roofline"
    )


def run_train_step(args: argparse.Namespace) -> None:
    from megarl.bench import train_step

    train_step.run(train_step.BenchSettings(**options(args)))


def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="torch", choices=["torch", "sglang"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument(
        "--vllm-python",
        default="",
        metavar="PATH",
        help="also run vLLM's CPU build with this interpreter (its own venv) on the same prompts",
    )
    p.add_argument("--vllm-dtype", default="bf16", choices=["fp32", "bf16"], help="the dtype vLLM serves in")
    p.add_argument(
        "--no-roofline", dest="roofline", action="store_false", help="skip measuring this machine's decode roofline"
    )


def run_generate(args: argparse.Namespace) -> None:
    from megarl.bench import generate

    generate.run(generate.GenerateBench(**options(args)))


def add_machine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--min-time", type=float, default=0.1, help="seconds of timed calls per measurement")


def run_machine(args: argparse.Namespace) -> None:
    from megarl.bench import machine

    machine.run(machine.MachineBench(**options(args)))


def add_attention_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--seq", dest="seqs", type=int, nargs="+", default=(256, 1024), help="packed row lengths", metavar="SEQ"
    )
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--reps", type=int, default=10, help="timed calls of each (alternated)")


def run_attention(args: argparse.Namespace) -> None:
    from megarl.bench import attention

    attention.run(attention.AttentionBench(**{**options(args), "seqs": tuple(args.seqs)}))


def add_episodes_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", type=int, default=16, help="episodes (the tools demo's held-out prompts)")
    p.add_argument("--batch", type=int, default=8, help="episodes in flight (the engine's max_running)")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=48, help="per turn")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each arm (alternated)")


def run_episodes(args: argparse.Namespace) -> None:
    from megarl.bench import episodes

    episodes.run(episodes.EpisodesBench(**options(args)))


def add_async_vs_sync_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True)
    p.add_argument("--workdir", default="runs/bench_async_vs_sync")
    p.add_argument("overrides", nargs="*", help="config overrides for both runs")


def run_async_vs_sync(args: argparse.Namespace) -> None:
    from megarl.bench import async_vs_sync

    async_vs_sync.run(**options(args))


def add_learning_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", help="synthetic | repeat (docs/learning.md; default: the workdir's, else synthetic)")
    p.add_argument("--config", help="the RL config every arm overrides (default: the task's)")
    p.add_argument("--arms", default="", help="comma-separated (default: the task's and every --arm)")
    p.add_argument(
        "--arm",
        action="append",
        default=[],
        metavar="'NAME: key=value ...'",
        help="define an arm by config overrides (repeatable; a task's arm of that name is replaced)",
    )
    p.add_argument("--seeds", type=int, default=8, help="seeds 0..N-1 of each arm")
    p.add_argument("--last", type=int, default=5, help="the training-reward column: mean of the last N steps")
    p.add_argument("--workdir", help="resumable: finished runs are kept (default: the task's)")
    p.add_argument("--warm-start-records", type=int, help="demonstrations of the task's warm start (repeat)")
    p.add_argument("--report-only", action="store_true", help="remake summary, table and plots from the CSVs")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("overrides", nargs="*", help="config overrides for every run")


def run_learning(args: argparse.Namespace) -> None:
    from megarl.bench import learning

    learning.run_grid(
        args.task,
        [a for a in args.arms.split(",") if a],
        list(range(args.seeds)),
        args.overrides,
        args.workdir,
        args.last,
        plots=not args.no_plots,
        extra_arms=args.arm,
        config=args.config,
        warm_start_records=args.warm_start_records,
        report_only=args.report_only,
    )


def add_gpu_check_args(p: argparse.ArgumentParser) -> None:
    from megarl.bench.gpu_check import add_args

    add_args(p)


def run_gpu_check(args: argparse.Namespace) -> None:
    from megarl.bench import gpu_check

    gpu_check.run(args)


def add_moe_decode_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="qwen3-moe-mini", help="a mixture-of-experts model preset")
    p.add_argument("--layers", type=int, default=8, help="layers of the decode step's model")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64], help="sequences decoding")
    p.add_argument("--context", type=int, default=128, help="cached positions of each sequence")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--reps", type=int, default=5, help="timed calls of each (alternated)")
    p.add_argument("--parts", nargs="+", default=["layer", "step"], choices=["layer", "step"], help="what to time")


def run_moe_decode(args: argparse.Namespace) -> None:
    from megarl.bench import moe_decode

    opts = options(args)
    moe_decode.run(moe_decode.MoeDecodeBench(**{**opts, "batch": tuple(opts["batch"]), "parts": tuple(opts["parts"])}))
