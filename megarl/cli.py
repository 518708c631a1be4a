"""The `megarl` command."""

from __future__ import annotations

import argparse
import sys

from megarl.cli_common import run_tool
from megarl.convert.cli import add_hf_to_megatron_args, add_megatron_to_hf_args
from megarl.data.arithmetic import add_data_args
from megarl.plan.cli import add_plan_args
from megarl.tools_demo import add_calculator_sft_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megarl", description="Megatron-Core backend for RL of LLMs")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="CPU demo: SmolLM2 -> Megatron TP3, answer a prompt, check against transformers")
    demo.add_argument("--workdir", default="runs/demo")
    demo.add_argument("--tp", type=int, default=3, help="tensor-parallel ranks (must divide 9 heads, 3 KV heads)")
    demo.add_argument("--max-new-tokens", type=int, default=12)

    train = sub.add_parser("train", help="asynchronous (or sync) RL: megarl train --config FILE [key=value ...]")
    train.add_argument("--config", required=True)
    train.add_argument("overrides", nargs="*", help="config overrides, e.g. optimizer.lr=1e-6 run.steps=20")
    train.add_argument(
        "--prepare-only",
        action="store_true",
        help="convert the model (first use) and print the world size; start no ranks",
    )
    train.add_argument(
        "--replay",
        metavar="RUN_DIR/rollouts.jsonl",
        help="train on a run's recorded rollouts, no generator (debug a loss); compares the losses",
    )

    sft = sub.add_parser("sft", help="supervised fine-tuning on chat records: megarl sft --config FILE --data F.jsonl")
    sft.add_argument("--config", required=True)
    sft.add_argument("--data", required=True, help='.jsonl of {"messages": [...]} or {"prompt", "response"}')
    sft.add_argument("--epochs", type=int, default=1)
    sft.add_argument("--batch-size", type=int, default=8, help="records per optimizer step")
    sft.add_argument("overrides", nargs="*", help="config overrides, as for megarl train")

    sgc = sub.add_parser("sglang-command", help="the launch command of each replica's SGLang server (attach mode)")
    sgc.add_argument("--config", required=True)
    sgc.add_argument("--model-path", help="the Hugging Face directory the servers load (default: model.source)")
    sgc.add_argument("--replica", type=int, help="print only this replica's command")
    sgc.add_argument("--hosts", default="", help="the job's nodes in order: print host, URL and command per replica")
    sgc.add_argument("--gpus-per-node", type=int, default=8)
    sgc.add_argument("overrides", nargs="*", help="config overrides, as for megarl train")

    ev = sub.add_parser("eval", help="greedy accuracy (and pass@k) of a checkpoint on a prompt set (one JSON line)")
    ev.add_argument("--checkpoint", required=True, help="a Megatron checkpoint dir, an HF dir, or smollm2")
    ev.add_argument("--data", required=True, help=".jsonl/.parquet prompts with answers, or arithmetic:<n>:<seed>")
    ev.add_argument("--max-new-tokens", type=int, default=64)
    ev.add_argument("--reward", default="math")
    ev.add_argument("--batch", type=int, default=32, help="sequences in flight")
    ev.add_argument("--cache-dir", default="runs/cache")
    ev.add_argument("--dump", help="write every prompt, response and reward to this .jsonl")
    ev.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "auto"],
        default=None,
        help="the dtype the engine decodes in. Default: a training run's checkpoint decodes in the "
        "run's generator.dtype (from RUN_DIR/config.json: what its rollouts and in-training "
        "evaluations used); any other checkpoint in fp32. auto: bf16 on CUDA and on CPUs with "
        "native bf16 (avx512_bf16 / amx_bf16; Arm bf16), else fp32",
    )
    ev.add_argument(
        "--samples",
        type=int,
        default=1,
        help="> 1: also this many sampled answers per prompt: reward_mean@K and pass@K",
    )
    ev.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="of the sampled answers. Default: the run's rollout.temperature, else 1.0",
    )
    ev.add_argument(
        "--top-p", type=float, default=None, help="of the sampled answers. Default: the run's rollout.top_p, else 1.0"
    )
    ev.add_argument(
        "--seed",
        type=int,
        default=None,
        help="of the sampled answers' per-prompt seeds (those of "
        "the run's in-training evaluation). Default: the run's run.seed, else 1234",
    )

    ev.add_argument(
        "--tools",
        nargs="+",
        default=(),
        help="answer the policy's tool calls, as rollout.tools does in training (calculator, python, "
        "or dotted paths); each prompt describes them and an episode is scored on its final turn",
    )
    ev.add_argument("--max-turns", type=int, default=None, help="turns of a --tools episode (default 4)")

    plot = sub.add_parser("plot", help="PNG curves of runs' metrics.jsonl (reward, KL, lag, ESS, time), overlaid")
    plot.add_argument("runs", nargs="+", help="run directories (or metrics.jsonl files)")
    plot.add_argument("--out", help="where the PNGs go (default: the first run's directory / plots)")
    plot.add_argument("--x", default="step", choices=["step", "samples", "time"], help="the x axis")
    plot.add_argument("--label", action="append", help="a run's name in the legend, once per run, in order")
    plot.add_argument(
        "--band", action="store_true", help="runs that share a --label: one line, their mean with a 95%% t-band"
    )

    data = sub.add_parser("data", help="prompt datasets")
    data_sub = data.add_subparsers(dest="dataset", required=True)
    add_data_args(data_sub.add_parser("arithmetic", help="multi-digit arithmetic word problems (jsonl)"))
    add_calculator_sft_args(
        data_sub.add_parser("calculator-sft", help="training problems as calculator episodes, for megarl sft (jsonl)")
    )

    bench = sub.add_parser("bench", help="benchmarks: ratios measured side by side in one run")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True)
    train_step = bench_sub.add_parser("train-step", help="RL train-step tokens/s: Megatron path vs plain transformers")
    train_step.add_argument("--workdir", default="runs/bench")
    train_step.add_argument("--samples", type=int, default=8)
    train_step.add_argument("--steps", type=int, default=3, help="timed steps per side (after one warm-up)")
    train_step.add_argument(
        "--max-tokens", type=int, default=512, help="Megatron micro-batch row length (configs/demo_cpu.yaml's)"
    )
    train_step.add_argument(
        "--dtype",
        default="fp32",
        choices=["fp32", "bf16"],
        help="bf16: mixed precision on both sides (fp32 master weights)",
    )
    train_step.add_argument("--no-roofline", action="store_true", help="skip measuring this machine's roofline")

    gen = bench_sub.add_parser("generate", help="generation tokens/s: megarl's engine vs transformers' generate")
    gen.add_argument("--backend", default="torch", choices=["torch", "sglang"])
    gen.add_argument("--batch", type=int, default=64)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    gen.add_argument(
        "--vllm-python",
        default="",
        metavar="PATH",
        help="also run vLLM's CPU build with this interpreter (its own venv) on the same prompts",
    )
    gen.add_argument("--vllm-dtype", default="bf16", choices=["fp32", "bf16"], help="the dtype vLLM serves in")
    gen.add_argument("--no-roofline", action="store_true", help="skip measuring this machine's decode roofline")

    mach = bench_sub.add_parser(
        "machine",
        help="this machine's GEMM / attention / bandwidth rates at the demo "
        "model's shapes and the roofline they imply (one JSON line)",
    )
    mach.add_argument("--min-time", type=float, default=0.1, help="seconds of timed calls per measurement")

    att = bench_sub.add_parser(
        "attention",
        help="the trainer's core attention fwd+bwd: Megatron's unfused path vs the SDPA one the local spec uses",
    )
    att.add_argument("--seq", type=int, nargs="+", default=[256, 1024], help="packed row lengths")
    att.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    att.add_argument("--reps", type=int, default=10, help="timed calls of each (alternated)")

    moe_decode = bench_sub.add_parser(
        "moe-decode",
        help="the torch engine's MoE decode: experts routed on the device vs the per-expert loop (layer and step)",
    )
    moe_decode.add_argument("--preset", default="qwen3-moe-mini", help="a mixture-of-experts model preset")
    moe_decode.add_argument("--layers", type=int, default=8, help="layers of the decode step's model")
    moe_decode.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64], help="sequences decoding")
    moe_decode.add_argument("--context", type=int, default=128, help="cached positions of each sequence")
    moe_decode.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    moe_decode.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    moe_decode.add_argument("--reps", type=int, default=5, help="timed calls of each (alternated)")
    moe_decode.add_argument(
        "--parts", nargs="+", default=["layer", "step"], choices=["layer", "step"], help="what to time"
    )

    epi = bench_sub.add_parser(
        "episodes", help="multi-turn episodes: each turn's KV cache parked for the next vs every context prefilled"
    )
    epi.add_argument("--prompts", type=int, default=16, help="episodes (the tools demo's held-out prompts)")
    epi.add_argument("--batch", type=int, default=8, help="episodes in flight (the engine's max_running)")
    epi.add_argument("--turns", type=int, default=3)
    epi.add_argument("--max-new-tokens", type=int, default=48, help="per turn")
    epi.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    epi.add_argument("--repeats", type=int, default=2, help="timed runs of each arm (alternated)")

    avs = bench_sub.add_parser("async-vs-sync", help="samples/s of the async loop vs the sync baseline, same workload")
    avs.add_argument("--config", required=True)
    avs.add_argument("--workdir", default="runs/bench_async_vs_sync")
    avs.add_argument("overrides", nargs="*", help="config overrides for both runs")

    learn = bench_sub.add_parser(
        "learning",
        help="learning claims as arms x seeds of short runs, each final policy scored on a held-out set, t intervals",
    )
    learn.add_argument("--task", help="synthetic | repeat (docs/learning.md; default: the workdir's, else synthetic)")
    learn.add_argument("--config", help="the RL config every arm overrides (default: the task's)")
    learn.add_argument("--arms", default="", help="comma-separated (default: the task's and every --arm)")
    learn.add_argument(
        "--arm",
        action="append",
        default=[],
        metavar="'NAME: key=value ...'",
        help="define an arm by config overrides (repeatable; a task's arm of that name is replaced)",
    )
    learn.add_argument("--seeds", type=int, default=8, help="seeds 0..N-1 of each arm")
    learn.add_argument("--last", type=int, default=5, help="the training-reward column: mean of the last N steps")
    learn.add_argument("--workdir", help="resumable: finished runs are kept (default: the task's)")
    learn.add_argument("--warm-start-records", type=int, help="demonstrations of the task's warm start (repeat)")
    learn.add_argument("--report-only", action="store_true", help="remake summary, table and plots from the CSVs")
    learn.add_argument("--no-plots", action="store_true")
    learn.add_argument("overrides", nargs="*", help="config overrides for every run")

    ws = bench_sub.add_parser(
        "weight-sync", help="shard-to-shard weight sync vs slime's gather+broadcast (or --plan-only: a predicted time)"
    )
    ws.add_argument(
        "--model",
        default=None,
        help="preset (llama3-8b/70b/405b, llama-mini, tiny, qwen3-30b-a3b, qwen3-235b-a22b, ...), smollm2, "
        "or a path (default llama-mini)",
    )
    ws.add_argument("--src-tp", type=int, default=None, help="trainer TP (default 4)")
    ws.add_argument("--src-pp", type=int, default=None, help="trainer PP (default 1)")
    ws.add_argument("--src-dp", type=int, default=None, help="trainer DP (default 1)")
    ws.add_argument(
        "--src-vpp", type=int, default=None, help="trainer virtual pipeline stages per PP rank (default 1; --plan-only)"
    )
    ws.add_argument("--src-ep", type=int, default=None, help="trainer expert parallel (default 1)")
    ws.add_argument("--src-etp", type=int, default=None, help="trainer expert tensor parallel (default: --src-tp)")
    ws.add_argument("--dst-tp", type=int, default=None, help="generator TP (default 2)")
    ws.add_argument("--dst-replicas", type=int, default=None, help="generator replicas (default 2)")
    ws.add_argument("--dst-ep", type=int, default=None, help="SGLang --ep-size inside a replica's TP (default 1)")
    ws.add_argument("--fp8", action="store_true", help="generators serve block fp8 (senders quantise)")
    ws.add_argument("--verify", action="store_true", help="checksum every destination shard")
    ws.add_argument("--iters", type=int, default=3)
    ws.add_argument(
        "--bucket-mb",
        type=int,
        default=64,
        help="megarl's round size per pair and the baseline's bucket size (the same for both)",
    )
    ws.add_argument("--plan-only", action="store_true", help="plan from shapes and predict the time; start nothing")
    ws.add_argument(
        "--config",
        default=None,
        help="with --plan-only: take the model, trainer tp/pp/dp/ep/etp, generator tp/replicas/ep, fp8 and "
        "links from a megarl run config (flags given override it)",
    )
    ws.add_argument("--gpus-per-node", type=int, default=None, help="default 8 (or the config's plan section)")
    ws.add_argument("--nvlink-gb-s", type=float, default=None, help="per GPU, within a node (default 450)")
    ws.add_argument("--network-gb-s", type=float, default=None, help="per GPU, across nodes (default 50)")
    ws.add_argument(
        "--latency-us",
        type=float,
        default=None,
        help="fixed cost of one point-to-point message (default 20, NCCL's ~10-30 us)",
    )
    ws.add_argument(
        "--fp8-quant-gb-s",
        type=float,
        default=None,
        help="bf16 bytes per second one GPU quantises to block fp8 (default 90: megarl's eager quantiser on an H100)",
    )

    add_plan_args(
        sub.add_parser(
            "plan",
            help="capacity planning (LlamaRL s.7, PipelineRL App. A); "
            "--config FILE [--dry-run-topology] for a run config",
        )
    )

    convert = sub.add_parser("convert", help="checkpoint conversion (same as tools/convert_*.py)")
    convert_sub = convert.add_subparsers(dest="direction", required=True)
    add_hf_to_megatron_args(convert_sub.add_parser("hf-to-megatron", help="Hugging Face / GGUF -> Megatron"))
    add_megatron_to_hf_args(convert_sub.add_parser("megatron-to-hf", help="Megatron -> Hugging Face"))
    return parser


def dispatch(args: argparse.Namespace) -> None:
    # Each command imports what it runs: the parser stays torch-free (0.2 s), `megarl train`'s
    # launching process imports no torch (its ranks do: tests/multiprocess/test_launch.py), and
    # `megarl plan` / `megarl data` never pay torch's 2-3 s.
    if args.command == "train":
        from megarl.train import train

        train(args.config, args.overrides, args.prepare_only, args.replay)
    elif args.command == "sft":
        from megarl.train import sft

        sft(args.config, args.data, args.overrides, args.epochs, args.batch_size)
    elif args.command == "sglang-command":
        from megarl.generator.sglang.command import run

        run(args.config, args.overrides, args.model_path, args.replica, args.hosts, args.gpus_per_node)
    elif args.command == "eval":
        from megarl.evaluate import evaluate

        evaluate(
            args.checkpoint,
            args.data,
            args.max_new_tokens,
            args.reward,
            args.batch,
            args.cache_dir,
            args.dump,
            args.dtype,
            args.samples,
            args.temperature,
            args.top_p,
            args.seed,
            args.tools,
            args.max_turns,
        )
    elif args.command == "plot":
        from megarl.plot import plot_runs

        plot_runs(args.runs, args.out, args.x, args.label, args.band)
    elif args.command == "data" and args.dataset == "calculator-sft":
        from megarl.tools_demo import run_calculator_sft

        run_calculator_sft(args)
    elif args.command == "data":
        from megarl.data.arithmetic import run_data

        run_data(args)
    elif args.command == "demo":
        from megarl.demo import run_demo

        run_demo(args.workdir, args.tp, args.max_new_tokens)
    elif args.command == "bench" and args.benchmark == "train-step":
        from megarl.bench import train_step

        train_step.run(
            train_step.BenchSettings(
                workdir=args.workdir,
                samples=args.samples,
                steps=args.steps,
                max_tokens=args.max_tokens,
                dtype=args.dtype,
                roofline=not args.no_roofline,
            )
        )
    elif args.command == "bench" and args.benchmark == "generate":
        from megarl.bench import generate

        generate.run(
            generate.GenerateBench(
                args.backend,
                args.batch,
                args.max_new_tokens,
                args.dtype,
                vllm_python=args.vllm_python,
                vllm_dtype=args.vllm_dtype,
                roofline=not args.no_roofline,
            )
        )
    elif args.command == "bench" and args.benchmark == "machine":
        from megarl.bench import machine

        machine.run(machine.MachineBench(min_time=args.min_time))
    elif args.command == "bench" and args.benchmark == "attention":
        from megarl.bench import attention

        attention.run(attention.AttentionBench(seqs=tuple(args.seq), dtype=args.dtype, reps=args.reps))
    elif args.command == "bench" and args.benchmark == "moe-decode":
        from megarl.bench import moe_decode

        moe_decode.run(
            moe_decode.MoeDecodeBench(
                preset=args.preset,
                layers=args.layers,
                batch=tuple(args.batch),
                context=args.context,
                dtype=args.dtype,
                device=args.device,
                reps=args.reps,
                parts=tuple(args.parts),
            )
        )
    elif args.command == "bench" and args.benchmark == "episodes":
        from megarl.bench import episodes

        episodes.run(
            episodes.EpisodesBench(args.prompts, args.batch, args.turns, args.max_new_tokens, args.dtype, args.repeats)
        )
    elif args.command == "bench" and args.benchmark == "async-vs-sync":
        from megarl.bench import async_vs_sync

        async_vs_sync.run(args.config, args.overrides, args.workdir)
    elif args.command == "bench" and args.benchmark == "learning":
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
    elif args.command == "bench" and args.benchmark == "weight-sync":
        from megarl.bench.weight_sync import WeightSyncBench, run

        run(
            WeightSyncBench(
                model=args.model,
                src_tp=args.src_tp,
                src_pp=args.src_pp,
                src_dp=args.src_dp,
                src_vpp=args.src_vpp,
                src_ep=args.src_ep,
                src_etp=args.src_etp,
                dst_tp=args.dst_tp,
                dst_replicas=args.dst_replicas,
                dst_ep=args.dst_ep,
                fp8=args.fp8,
                verify=args.verify,
                iters=args.iters,
                plan_only=args.plan_only,
                config=args.config,
                gpus_per_node=args.gpus_per_node,
                nvlink_gb_s=args.nvlink_gb_s,
                network_gb_s=args.network_gb_s,
                message_latency_us=args.latency_us,
                fp8_quant_gb_s=args.fp8_quant_gb_s,
                bucket_mb=args.bucket_mb,
            )
        )
    elif args.command == "plan":
        from megarl.plan.cli import run_plan

        run_plan(args)
    elif args.command == "convert":
        from megarl.convert import hf_to_megatron, megatron_to_hf

        if args.direction == "hf-to-megatron":
            hf_to_megatron.convert(hf_to_megatron.from_args(args))
        else:
            megatron_to_hf.convert(megatron_to_hf.from_args(args))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_tool(lambda: dispatch(args))


# Spawned ranks re-import the main module: keep the entry point guarded.
if __name__ == "__main__":
    sys.exit(main())
