"""`megarl plan`: capacity planning from the LlamaRL (s.7) and PipelineRL (App. A) models.

    megarl plan --config FILE [key=value ...] [--json]          # a run config's layout, balanced, searched
    megarl plan --config FILE --dry-run-topology [--json]       # its ranks and weight sync, no process
    megarl plan --model llama3-405b --gpus 1024 --batch 2048 [--gpu-memory-gb 80] [--measured FILE.json] [--json]
    megarl plan --pipeline-appendix [--gpus 128 --batch 128 ...]
    megarl plan --scenario llamarl-405b|llamarl-70b|llamarl-8b|pipelinerl|all [--json]   # the papers' settings
    megarl plan --compare-paper

(also ``python -m megarl.plan.cli ...``). With --config the model, cluster and lengths come
from the config (its ``plan:`` section, see config_plan.py); change them with overrides
(``plan.gpus=512``), not with the --model-mode flags, which are refused there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import replace
from typing import List, Optional

from megarl.cli_common import run_tool
from megarl.config import load_config
from megarl.errors import ConfigError
from megarl.plan.config_plan import plan_config
from megarl.plan.dry_run import dry_run, dry_run_text
from megarl.plan.hardware import H100, Hardware
from megarl.plan.inputs import FixedLayout, LengthDistribution, PlanInputs, generator_dims, replica_layout
from megarl.plan.llamarl_model import plan_from_inputs, theorem_setting
from megarl.plan.pipeline_appendix import (
    DEFAULT_LAGS,
    PAPER_CASE,
    AppendixInputs,
    knee_lag,
    speedup_curve,
    table_utilisation,
)
from megarl.plan.report import (
    appendix_json,
    appendix_text,
    compare_text,
    config_plan_json,
    config_plan_text,
    dumps,
    plan_json,
    plan_text,
)
from megarl.plan.scenarios import LLAMARL_GPUS, LLAMARL_SPEEDUP, SCENARIOS, scenarios_json, scenarios_text


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    run = parser.add_argument_group("a run config")
    run.add_argument("--config", default=None, help="plan a `megarl train` config (its plan: section for the cluster)")
    run.add_argument(
        "--dry-run-topology",
        action="store_true",
        help="with --config: build and check its ranks, groups and weight-sync plan; start nothing",
    )
    run.add_argument("overrides", nargs="*", default=[], help="with --config: overrides, e.g. plan.gpus=512")
    mode = parser.add_argument_group("mode")
    mode.add_argument("--pipeline-appendix", action="store_true", help="PipelineRL App. A: speed-up vs max lag")
    mode.add_argument(
        "--compare-paper",
        action="store_true",
        help="the papers' scenarios and the planner's defaults next to the papers' numbers",
    )
    mode.add_argument(
        "--scenario",
        default=None,
        help="a paper's setting (megarl/plan/scenarios.py): llamarl-8b, llamarl-70b, llamarl-405b, pipelinerl or all",
    )
    mode.add_argument(
        "--theorem-setting",
        action="store_true",
        help="price the baseline with the async generator's eta (Theorem 7.5's setting)",
    )
    mode.add_argument("--json", action="store_true", help="print one JSON line instead of tables")
    job = parser.add_argument_group("job")
    job.add_argument("--model", default="llama3-8b", help="preset: llama3-8b, llama3-70b, llama3-405b, llama-mini")
    job.add_argument("--gpus", type=int, default=None, help="N (default 256; 128 with --pipeline-appendix)")
    job.add_argument("--gpus-per-node", type=int, default=8)
    job.add_argument(
        "--batch",
        type=int,
        default=None,
        help="samples per step (default prompts x samples-per-prompt; 128 with --pipeline-appendix)",
    )
    job.add_argument("--prompts", type=int, default=512)
    job.add_argument("--samples-per-prompt", type=int, default=4)
    job.add_argument("--prompt-tokens", type=int, default=512)
    job.add_argument(
        "--response-dist",
        default="uniform",
        choices=["uniform", "exponential"],
        help="uniform on [min, max], or a truncated exponential of --response-tokens-mean capped at max",
    )
    job.add_argument("--response-tokens-min", type=int, default=None, help="uniform: default 512")
    job.add_argument(
        "--response-tokens-max", type=int, default=None, help="default 4096 (uniform), 16384 (exponential)"
    )
    job.add_argument("--response-tokens-mean", type=float, default=2048.0, help="exponential only")
    job.add_argument("--gpu-memory-gb", type=float, default=80.0)
    job.add_argument("--trainer-precision", default="bf16", choices=["bf16"])
    job.add_argument("--generator-precision", default="fp8", choices=["fp8", "bf16"])
    job.add_argument(
        "--sync-generator-precision",
        default=None,
        choices=["fp8", "bf16"],
        help="baseline's generation precision (default: the trainer's)",
    )
    job.add_argument("--sync-batching", default="static", choices=["static", "continuous"])
    job.add_argument(
        "--sync-offload-trainer-state",
        action="store_true",
        help="baseline frees grads and optimizer state while generating",
    )
    job.add_argument("--max-lag-steps", type=float, default=1.0, help="async sequences in flight, in batches")
    job.add_argument("--max-pp", type=int, default=16)
    job.add_argument(
        "--allow-uneven-pp",
        action="store_true",
        help="also search PP sizes that do not divide the layers (Megatron runs them, megarl refuses)",
    )
    job.add_argument("--measured", default=None, help="JSON of measured seconds/sample (see megarl/plan/measured.py)")
    job.add_argument(
        "--weight-sync",
        default=None,
        choices=["predict", "estimate", "skip"],
        help="predict (default): megarl's transfer planner for the chosen layout (needs torch; "
        "seconds at 405B); with --config the default is plan.weight_sync",
    )
    fields = ", ".join(f.name for f in dataclasses.fields(Hardware))
    job.add_argument(
        "--hardware",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help=f"override a hardware number, e.g. train_mfu=0.35 ({fields})",
    )
    fixed = parser.add_argument_group("evaluate one asynchronous layout instead of searching")
    fixed.add_argument("--trainer-gpus", type=int, default=None, help="theta x N; giving it fixes the layout")
    fixed.add_argument("--trainer-tp", type=int, default=8)
    fixed.add_argument("--trainer-pp", type=int, default=1)
    fixed.add_argument("--micro-batch", type=int, default=1)
    fixed.add_argument("--recompute", default="selective", choices=["none", "selective", "full"])
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
    n = gpus or args.gpus or 256
    if args.trainer_gpus is not None:
        if not 0 < args.trainer_gpus < n:
            raise ConfigError(f"--trainer-gpus={args.trainer_gpus} must leave GPUs for the generator (--gpus={n})")
        layout = FixedLayout(
            replica_layout(args.trainer_tp, args.trainer_pp, args.micro_batch, args.recompute).on_gpus(
                args.trainer_gpus, "--trainer-gpus"
            ),
            generator_dims(args.generator_tp, n - args.trainer_gpus, field="--generator-tp"),
            args.generator_batch,
        )
    inputs = PlanInputs(
        model=model or args.model,
        gpus=n,
        gpus_per_node=args.gpus_per_node,
        prompts=prompts,
        samples_per_prompt=samples,
        prompt_tokens=args.prompt_tokens,
        lengths=_lengths(args, 512, 4096),
        gpu_memory_gb=args.gpu_memory_gb,
        trainer_precision=args.trainer_precision,
        generator_precision=args.generator_precision,
        sync_generator_precision=args.sync_generator_precision,
        sync_batching=args.sync_batching,
        sync_offload_trainer_state=args.sync_offload_trainer_state,
        max_lag_steps=args.max_lag_steps,
        layout=layout,
        measured=args.measured,
        weight_sync=args.weight_sync or "predict",
        hardware=_hardware(args),
        max_pp=args.max_pp,
        uneven_pp=args.allow_uneven_pp,
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
        gpus=args.gpus or PAPER_CASE["gpus"],
        batch=args.batch or PAPER_CASE["batch"],
        lengths=_lengths(args, 1, 8192),
        params=args.params,
        hardware=_hardware(args),
        max_inflight=args.max_inflight,
        utilisation=utilisation,
        train_tokens_s=args.train_tokens_s,
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
    if args.config is not None:
        return run_config_plan(args)
    if args.dry_run_topology or args.overrides:
        what = "--dry-run-topology" if args.dry_run_topology else f"override {args.overrides[0]!r}"
        raise ConfigError(f"{what}: needs --config FILE")
    if args.scenario is not None:
        names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
        result = scenarios_json(names)
        if not args.json:
            print(scenarios_text(result), flush=True)
    elif args.compare_paper:
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


# Flags that mean something with --config; every other flag is refused there rather than silently
# ignored, with the config field that replaces it where there is one.
CONFIG_FLAGS = ("config", "dry_run_topology", "overrides", "json", "weight_sync")
CONFIG_REPLACES = {
    "model": "plan.model",
    "gpus": "plan.gpus",
    "gpus_per_node": "plan.gpus_per_node",
    "batch": "rollout.prompts_per_step",
    "prompts": "rollout.prompts_per_step",
    "samples_per_prompt": "rollout.samples_per_prompt",
    "prompt_tokens": "plan.prompt_tokens",
    "response_dist": "plan.response_dist",
    "response_tokens_min": "plan.response_tokens_min",
    "response_tokens_max": "plan.response_tokens_max",
    "response_tokens_mean": "plan.response_tokens_mean",
    "gpu_memory_gb": "plan.gpu_memory_gb",
    "generator_precision": "generator.fp8",
    "max_lag_steps": "plan.max_lag_steps",
    "max_pp": "plan.max_pp",
    "measured": "plan.measured",
    "hardware": "plan.hardware.FIELD",
    "trainer_gpus": "trainer.dp",
    "trainer_tp": "trainer.tp",
    "trainer_pp": "trainer.pp",
    "micro_batch": "trainer.max_tokens_per_microbatch",
    "recompute": "trainer.recompute_granularity",
    "generator_tp": "generator.tp",
    "generator_batch": "generator.max_running",
    "scenario": "plan.model (its paper scenario is part of the config's plan)",
}


def run_config_plan(args) -> dict:
    defaults = argparse.ArgumentParser()
    add_plan_args(defaults)
    default = vars(defaults.parse_args([]))
    for name, value in default.items():
        if name not in CONFIG_FLAGS and getattr(args, name, value) != value:
            flag, instead = "--" + name.replace("_", "-"), CONFIG_REPLACES.get(name)
            raise ConfigError(
                f"{flag}: not with --config"
                + (f"; set {instead} in the config or as an override ({instead}=...)" if instead else "")
            )
    overrides = list(args.overrides)
    if args.weight_sync is not None:
        overrides.append(f"plan.weight_sync={args.weight_sync}")
    cfg = load_config(args.config, overrides)
    try:
        if args.dry_run_topology:
            report = dry_run(cfg, args.config)
            result = report.to_json()
            text = dry_run_text(report)
        else:
            plan = plan_config(cfg, args.config)
            result = config_plan_json(plan)
            text = config_plan_text(plan)
    except ConfigError as err:
        raise ConfigError(f"{args.config}: {err}") from None
    print(dumps(result) if args.json else text, flush=True)
    return result


def compare_paper(args) -> dict:
    """The papers' scenarios (their settings, ``scenarios``) and, for contrast, the planner's defaults
    (megarl's trainer, the best synchronous layout, uniform [512, 4096] responses) on the same clusters."""
    scenarios = scenarios_json()
    rows, plans = [], {}
    for model, paper in LLAMARL_SPEEDUP.items():
        inputs = replace(inputs_from_args(args, model=model, gpus=LLAMARL_GPUS[model]), layout=None)
        plan = plan_from_inputs(inputs)
        plans[model] = plan_json(plan)
        rows.append(
            {
                "case": f"planner defaults, {model}",
                "gpus": inputs.gpus,
                "predicted": plan.speedup,
                "paper": paper,
                "sync": f"{plan.best_sync.step_seconds:.1f}",
                "async": f"{plan.best_async.step_seconds:.1f}",
                "lengths": inputs.lengths.describe(),
            }
        )
    if not args.json:
        print(scenarios_text(scenarios) + "\n\n" + compare_text(rows), flush=True)
    return {
        "scenarios": scenarios,
        "defaults": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()} for row in rows],
        "plans": plans,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="megarl plan", description=__doc__.splitlines()[0])
    add_plan_args(parser)
    args = parser.parse_args(argv)
    return run_tool(lambda: run_plan(args))


if __name__ == "__main__":
    sys.exit(main())
