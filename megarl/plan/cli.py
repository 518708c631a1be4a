"""`megarl plan`: capacity planning from the LlamaRL (s.7) and PipelineRL (App. A) models.

    megarl plan --model llama3-405b --gpus 1024 --batch 2048 [--gpu-memory-gb 80] [--measured FILE.json] [--json]
    megarl plan --pipeline-appendix [--gpus 128 --batch 128 ...]
    megarl plan --compare-paper

Until the subcommand is wired into megarl/cli.py: ``python -m megarl.plan.cli ...``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import replace
from typing import List, Optional

from megarl.errors import ConfigError
from megarl.plan.hardware import H100, Hardware
from megarl.plan.inputs import FixedLayout, GeneratorLayout, LengthDistribution, PlanInputs, TrainerLayout
from megarl.plan.llamarl_model import plan_from_inputs, theorem_setting
from megarl.plan.pipeline_appendix import (DEFAULT_LAGS, PAPER_CASE, AppendixInputs, conventional, knee_lag,
                                           pipeline, speedup_curve, table_utilisation)
from megarl.plan.report import (LLAMARL_TABLE3, appendix_json, appendix_text, compare_text, dumps, plan_json,
                                plan_text)


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_argument_group("mode")
    mode.add_argument("--pipeline-appendix", action="store_true", help="PipelineRL App. A: speed-up vs max lag")
    mode.add_argument("--compare-paper", action="store_true",
                      help="the three LlamaRL Table 3 cases and the PipelineRL case next to the papers' numbers")
    mode.add_argument("--theorem-setting", action="store_true",
                      help="price the baseline with the async generator's eta (Theorem 7.5's setting)")
    mode.add_argument("--json", action="store_true", help="print one JSON line instead of tables")
    job = parser.add_argument_group("job")
    job.add_argument("--model", default="llama3-8b", help="preset: llama3-8b, llama3-70b, llama3-405b, llama-mini")
    job.add_argument("--gpus", type=int, default=None, help="N (default 256; 128 with --pipeline-appendix)")
    job.add_argument("--gpus-per-node", type=int, default=8)
    job.add_argument("--batch", type=int, default=None,
                     help="samples per step (default prompts x samples-per-prompt; 128 with --pipeline-appendix)")
    job.add_argument("--prompts", type=int, default=512)
    job.add_argument("--samples-per-prompt", type=int, default=4)
    job.add_argument("--prompt-tokens", type=int, default=512)
    job.add_argument("--response-dist", default="uniform", choices=["uniform", "exponential"],
                     help="uniform on [min, max], or a truncated exponential of --response-tokens-mean capped at max")
    job.add_argument("--response-tokens-min", type=int, default=None, help="uniform: default 512")
    job.add_argument("--response-tokens-max", type=int, default=None,
                     help="default 4096 (uniform), 16384 (exponential)")
    job.add_argument("--response-tokens-mean", type=float, default=2048.0, help="exponential only")
    job.add_argument("--gpu-memory-gb", type=float, default=80.0)
    job.add_argument("--trainer-precision", default="bf16", choices=["bf16"])
    job.add_argument("--generator-precision", default="fp8", choices=["fp8", "bf16"])
    job.add_argument("--sync-generator-precision", default=None, choices=["fp8", "bf16"],
                     help="baseline's generation precision (default: the trainer's)")
    job.add_argument("--sync-batching", default="static", choices=["static", "continuous"])
    job.add_argument("--sync-offload-trainer-state", action="store_true",
                     help="baseline frees grads and optimizer state while generating")
    job.add_argument("--max-lag-steps", type=float, default=1.0, help="async sequences in flight, in batches")
    job.add_argument("--max-pp", type=int, default=16)
    job.add_argument("--measured", default=None, help="JSON of measured seconds/sample (see megarl/plan/measured.py)")
    job.add_argument("--weight-sync", default="predict", choices=["predict", "estimate", "skip"],
                     help="predict: megarl's transfer planner for the chosen layout (needs torch; ~7 s at 405B)")
    fields = ", ".join(f.name for f in dataclasses.fields(Hardware))
    job.add_argument("--hardware", action="append", default=[], metavar="FIELD=VALUE",
                     help=f"override a hardware number, e.g. train_mfu=0.35 ({fields})")
    fixed = parser.add_argument_group("evaluate one asynchronous layout instead of searching")
    fixed.add_argument("--trainer-gpus", type=int, default=None, help="theta x N; giving it fixes the layout")
    fixed.add_argument("--trainer-tp", type=int, default=8)
    fixed.add_argument("--trainer-pp", type=int, default=1)
    fixed.add_argument("--micro-batch", type=int, default=1)
    fixed.add_argument("--recompute", default="selective", choices=["selective", "full"])
    fixed.add_argument("--generator-tp", type=int, default=8)
    fixed.add_argument("--generator-batch", type=int, default=None, help="b_g (default: the largest that fits)")
    pipe = parser.add_argument_group("--pipeline-appendix")
    pipe.add_argument("--lags", default=None, help="comma-separated g_max values")
    pipe.add_argument("--max-inflight", type=float, default=None, help="memory cap on sequences per generator GPU")
    pipe.add_argument("--train-tokens-s", type=float, default=None, help="tau per trainer GPU")
    pipe.add_argument("--utilisation", default=None, help='JSON {"h": tokens/s, ...} replacing the roofline U(h)')
    pipe.add_argument("--params", type=float, default=7.6e9, help="model parameters (absolute tokens/s only)")


def _hardware(args) -> Hardware:
    changes = {}
    names = {f.name: f for f in dataclasses.fields(Hardware)}
    for item in args.hardware:
        key, sep, value = item.partition("=")
        if not sep or key not in names:
            raise ConfigError(f"--hardware {item!r}: expected FIELD=VALUE with FIELD one of {sorted(names)}")
        try:
            changes[key] = value if key == "name" else (int(value) if names[key].type in (int, "int") else float(value))
        except ValueError:
            raise ConfigError(f"--hardware {key}={value!r} is not a number") from None
    return replace(H100, gpus_per_node=args.gpus_per_node, memory_gb=args.gpu_memory_gb, **changes)


def _lengths(args, low: int, high: int) -> LengthDistribution:
    if args.response_dist == "exponential":
        return LengthDistribution.truncated_exponential(args.response_tokens_mean, args.response_tokens_max or 16384)
    return LengthDistribution.uniform(args.response_tokens_min or low, args.response_tokens_max or high)


def inputs_from_args(args, model: Optional[str] = None, gpus: Optional[int] = None) -> PlanInputs:
    prompts, samples = args.prompts, args.samples_per_prompt
    if args.batch is not None:
        if args.batch % samples:
            raise ConfigError(f"--batch={args.batch} is not a multiple of --samples-per-prompt={samples}")
        prompts = args.batch // samples
    layout = None
    if args.trainer_gpus is not None:
        layout = FixedLayout(TrainerLayout(args.trainer_tp, args.trainer_pp, args.micro_batch, args.recompute),
                             GeneratorLayout(args.generator_tp), args.trainer_gpus, args.generator_batch)
    inputs = PlanInputs(
        model=model or args.model, gpus=gpus or args.gpus or 256, gpus_per_node=args.gpus_per_node, prompts=prompts,
        samples_per_prompt=samples, prompt_tokens=args.prompt_tokens, lengths=_lengths(args, 512, 4096),
        gpu_memory_gb=args.gpu_memory_gb, trainer_precision=args.trainer_precision,
        generator_precision=args.generator_precision, sync_generator_precision=args.sync_generator_precision,
        sync_batching=args.sync_batching, sync_offload_trainer_state=args.sync_offload_trainer_state,
        max_lag_steps=args.max_lag_steps, layout=layout, measured=args.measured, weight_sync=args.weight_sync,
        hardware=_hardware(args), max_pp=args.max_pp,
    )
    return theorem_setting(inputs) if args.theorem_setting else inputs


def appendix_from_args(args) -> AppendixInputs:
    utilisation = None
    if args.utilisation:
        try:
            with open(args.utilisation) as f:
                utilisation = table_utilisation({float(k): float(v) for k, v in json.load(f).items()})
        except (OSError, ValueError, AttributeError) as err:
            raise ConfigError(f"--utilisation {args.utilisation}: {err}") from None
    return AppendixInputs(
        gpus=args.gpus or PAPER_CASE["gpus"], batch=args.batch or PAPER_CASE["batch"],
        lengths=_lengths(args, 1, 8192), params=args.params, hardware=_hardware(args),
        max_inflight=args.max_inflight, utilisation=utilisation, train_tokens_s=args.train_tokens_s,
    ).validate()


def _lags(args) -> List[int]:
    if not args.lags:
        return list(DEFAULT_LAGS)
    try:
        return [int(x) for x in args.lags.split(",")]
    except ValueError:
        raise ConfigError(f"--lags={args.lags!r} must be comma-separated integers") from None


def run_plan(args) -> dict:
    """Run the mode `args` asks for, print tables (or one JSON line) and return the result as a dict."""
    if args.compare_paper:
        result = compare_paper(args)
    elif args.pipeline_appendix:
        a = appendix_from_args(args)
        rows, knee = speedup_curve(a, _lags(args)), knee_lag(a)
        result = appendix_json(a, rows, knee)
        if not args.json:
            print(appendix_text(a, rows, knee), flush=True)
    else:
        plan = plan_from_inputs(inputs_from_args(args))
        result = plan_json(plan)
        if not args.json:
            print(plan_text(plan), flush=True)
    if args.json:
        print(dumps(result), flush=True)
    return result


# Response lengths the comparison is run under: the default, and a right-skewed one with the
# same kind of mean whose longest responses are ~7x the mean (what a synchronous step waits for).
COMPARE_LENGTHS = (
    ("uniform", lambda: LengthDistribution.uniform(512, 4096)),
    ("long tail", lambda: LengthDistribution.truncated_exponential(2048, 16384)),
)


def compare_paper(args) -> dict:
    rows, plans = [], {}
    for label, lengths in COMPARE_LENGTHS:
        for model, gpus, paper in LLAMARL_TABLE3:
            inputs = replace(inputs_from_args(args, model=model, gpus=gpus), layout=None, lengths=lengths())
            plan = plan_from_inputs(inputs)
            plans[f"{model} {label}"] = plan_json(plan)
            rows.append({"case": f"LlamaRL {model}, {label} lengths", "gpus": gpus, "predicted": plan.speedup,
                         "paper": paper, "sync": f"{plan.best_sync.step_seconds:.1f}",
                         "async": f"{plan.best_async.step_seconds:.1f}", "lengths": inputs.lengths.describe()})
    a = AppendixInputs(hardware=_hardware(args)).validate()
    g = PAPER_CASE["g_max"]
    knee = knee_lag(a)
    at_paper = pipeline(a, g).tokens_s / conventional(a, g).tokens_s
    at_knee = pipeline(a, knee).tokens_s / conventional(a, knee).tokens_s
    rows.append({"case": f"PipelineRL N=128 B=128 g_max={g}", "gpus": a.gpus, "predicted": at_paper,
                 "paper": PAPER_CASE["speedup"]})
    rows.append({"case": f"PipelineRL at its knee g_max={knee}", "gpus": a.gpus, "predicted": at_knee,
                 "paper": PAPER_CASE["speedup"]})
    if not args.json:
        print(compare_text(rows), flush=True)
    return {"compare": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()} for row in rows],
            "plans": plans}


def main(argv=None) -> int:
    from megarl.cli_common import run_tool

    parser = argparse.ArgumentParser(prog="megarl plan", description=__doc__.splitlines()[0])
    add_plan_args(parser)
    args = parser.parse_args(argv)
    return run_tool(lambda: run_plan(args))


if __name__ == "__main__":
    sys.exit(main())
