"""The `megarl` command: a table of commands whose functions stay short, each command's options
reaching its settings by name, --version, and `megarl train`'s first words."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from megarl import __version__
from megarl.cli import build_parser, main
from megarl.commands import options
from megarl.commands.convert import run_hf_to_megatron

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 60


def long_functions(source: str) -> dict:
    """{function name: lines} of every function (methods and nested ones too) of LIMIT lines or more."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines >= LIMIT:
                out[node.name] = lines
    return out


def test_every_function_of_cli_py_is_under_60_lines():
    assert long_functions((ROOT / "megarl" / "cli.py").read_text()) == {}


def test_the_length_check_catches_a_long_function():
    body = "".join(f"    x{i} = {i}\n" for i in range(LIMIT - 1))
    assert long_functions(f"def short():\n{body[:40]}\ndef build_parser():\n{body}") == {"build_parser": LIMIT}


def test_version_is_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    setup_version = re.search(r'version="([^"]+)"', (ROOT / "setup.py").read_text()).group(1)
    assert capsys.readouterr().out == f"megarl {__version__}\n" == f"megarl {setup_version}\n"


def test_train_help_says_where_fields_are_described(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "docs/config-reference.md, or `megarl config [SECTION]`" in " ".join(capsys.readouterr().out.split())


def test_weight_sync_flags_are_the_bench_fields_by_name():
    from megarl.bench.weight_sync import WeightSyncBench

    args = build_parser().parse_args(["bench", "weight-sync"])
    assert WeightSyncBench(**{**options(args), "overrides": ()}) == WeightSyncBench()  # same defaults
    args = build_parser().parse_args(
        ["bench", "weight-sync", "--latency-us", "7", "--src-tp", "2", "--fp8", "--config", "c.yaml", "trainer.pp=2"]
    )
    bench = WeightSyncBench(**{**options(args), "overrides": tuple(args.overrides)})
    assert (bench.message_latency_us, bench.src_tp, bench.fp8, bench.config, bench.overrides) == (
        7.0,
        2,
        True,
        "c.yaml",
        ("trainer.pp=2",),
    )


def test_a_flag_with_no_field_of_its_name_is_refused():
    from megarl.bench.weight_sync import WeightSyncBench

    args = build_parser().parse_args(["bench", "weight-sync"])
    args.latency_us = 7.0  # the old flag's name, which is no field of the bench
    with pytest.raises(TypeError, match="latency_us"):
        WeightSyncBench(**options(args))


def test_eval_options_are_evaluate_parameters():
    from megarl.evaluate import evaluate

    args = build_parser().parse_args(["eval", "--checkpoint", "smollm2", "--data", "arithmetic:4:1"])
    assert sorted(options(args)) == sorted(inspect.signature(evaluate).parameters)


@pytest.mark.parametrize(
    "argv, settings",
    [
        (["bench", "train-step", "--no-roofline", "--max-tokens", "256"], ("train_step", "BenchSettings")),
        (["bench", "generate", "--no-roofline"], ("generate", "GenerateBench")),
        (["bench", "machine", "--min-time", "0.5"], ("machine", "MachineBench")),
        (["bench", "attention", "--seq", "64", "128"], ("attention", "AttentionBench")),
        (["bench", "episodes", "--turns", "2"], ("episodes", "EpisodesBench")),
    ],
)
def test_each_benchmark_builds_its_settings_from_its_options(argv, settings):
    import importlib

    cls = getattr(importlib.import_module(f"megarl.bench.{settings[0]}"), settings[1])
    values = options(build_parser().parse_args(argv))
    built = cls(**values)
    assert {k: getattr(built, k) for k in values} == values
    names = {f.name for f in dataclasses.fields(cls)}
    assert set(values) <= names


def test_subcommands_run_their_own_function():
    args = build_parser().parse_args(["convert", "hf-to-megatron", "--hf-model", "x", "--output", "y"])
    assert args.run_command is run_hf_to_megatron and args.direction == "hf-to-megatron"


def test_train_says_what_it_does_before_preparing_the_model(monkeypatch, capsys, tmp_path):
    from megarl import model_source, train
    from megarl.config import load_config

    def stop(*args, **kwargs):
        raise RuntimeError("prepare_model reached")

    monkeypatch.setattr(model_source, "prepare_model", stop)
    tiny = str(ROOT / "configs" / "tiny_cpu.yaml")
    with pytest.raises(RuntimeError, match="prepare_model reached"):
        train.train(tiny, [f"run.output_dir={tmp_path}"])
    ranks = load_config(tiny).layout().world_size
    assert capsys.readouterr().err == (
        f"megarl: read {tiny} with 1 override(s): async run of {load_config(tiny).run.steps} steps into {tmp_path}; "
        f"checking it, preparing the model {load_config(tiny).model.source}, then start {ranks} ranks\n"
    )


def test_weight_sync_plan_takes_the_config_overrides():
    from megarl.bench.weight_sync import WeightSyncBench, run
    from megarl.errors import ConfigError

    tiny = str(ROOT / "configs" / "tiny_cpu.yaml")
    by_override = run(WeightSyncBench(plan_only=True, config=tiny, overrides=("generator.replicas=2",)))
    by_flag = run(WeightSyncBench(plan_only=True, config=tiny, dst_replicas=2))
    plain = run(WeightSyncBench(plan_only=True, config=tiny))
    assert by_override["generator"] == by_flag["generator"] != plain["generator"]
    with pytest.raises(ConfigError, match="override 'trainer.tp=2': needs --config FILE"):
        run(WeightSyncBench(plan_only=True, model="tiny", overrides=("trainer.tp=2",)))
