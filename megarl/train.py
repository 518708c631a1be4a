"""`megarl train --config FILE [key=value ...]`: prepare the model, start the ranks, run the loop.

Under torchrun (RANK/WORLD_SIZE set) this process is one rank of the job;
otherwise it starts the config's world on this machine (gloo on CPU). Ends
with one JSON line: the run's summary (samples/s, where the time went).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

# model_source and config_plan by module: looked up per call (tests/unit/test_plan_config.py replaces them)
from megarl import model_source
from megarl.checkpointing.recorded import recorded_dtypes
from megarl.config import eval_sets, fields_set, load_config
from megarl.data.datasets import check_data_source
from megarl.errors import ConfigError
from megarl.models.spec import ModelSpec
from megarl.plan import config_plan
from megarl.runtime.cpu_dtype import resolve_auto_dtypes
from megarl.runtime.launch import run_world, running_under_torchrun
from megarl.trainer.bound_loss import bind_loss
from megarl.trainer.features import check_model_trains, check_trainer_runs_here


def train(
    config_path: str, overrides: Sequence[str] = (), prepare_only: bool = False, replay: Optional[str] = None
) -> dict:
    cfg = load_config(config_path, overrides)
    if not running_under_torchrun():  # each rank of a torchrun job runs this too: the launcher says it once
        say_start(cfg, config_path, overrides, prepare_only, replay)
    if cfg.trainer.loss == "sft":
        raise ConfigError("trainer.loss: 'sft' is megarl sft's loss (records with their answers), not an RL loss")
    check_loss(cfg, config_path)
    _resolve_dtypes(cfg, replay)
    check_trainer_runs_here(cfg)
    if replay and Path(cfg.run.output_dir).resolve() == Path(replay).resolve().parent:
        raise ConfigError(
            f"run.output_dir: {cfg.run.output_dir} is the run being replayed; give the replay its own "
            f"(e.g. run.output_dir={cfg.run.output_dir.rstrip('/')}_replay)"
        )
    if running_under_torchrun():
        # every rank resolves the model; converting is a job of its own, done before the launch
        # (scripts/launch.sh runs `megarl train --prepare-only` first)
        prepared = model_source.prepare_model(cfg.model, convert=False)
        check_model_trains(ModelSpec.from_dict(prepared.spec), cfg)
        # imported here: this module is `megarl train`'s launcher and stays torch-free (runtime/launch.py);
        # the controller and the replay pull in torch and the trainer (~1.3 s), needed only on a rank
        from megarl.loop.controller import run_rank

        if replay:
            # imported here: as run_rank above (~1.45 s, torch and the trainer), and only a replay needs it
            from megarl.loop.replay import replay_rank

            replay_rank(cfg.to_dict(), prepared, replay)
        else:
            run_rank(cfg.to_dict(), prepared)
        return {}
    if prepare_only and cfg.plan:
        # A GPU config (one with a plan: section) whose layout cannot fit in GPU memory with its own
        # settings is refused before a checkpoint is converted for it, naming the part that overflows.
        config_plan.check_config_fits(cfg)
    if not replay:  # (torchrun's ranks are checked by the --prepare-only that precedes them: scripts/launch.sh)
        _check_data(cfg)  # a replay trains on recorded token ids: it reads no data source
        _check_episodes(cfg)
    prepared = model_source.prepare_model(cfg.model)
    check_model_trains(ModelSpec.from_dict(prepared.spec), cfg)
    if prepare_only:
        print(
            json.dumps(
                {
                    "prepared": prepared.checkpoint or cfg.model.source,
                    "tokenizer": prepared.tokenizer,
                    "world_size": cfg.layout().world_size,
                }
            ),
            flush=True,
        )
        return {}
    if replay:  # the trainer's ranks alone, on recorded batches (replay.py)
        if cfg.run.time_budget_min:
            print(
                f"megarl: --replay trains every recorded step: run.time_budget_min={cfg.run.time_budget_min:g} "
                f"does not apply",
                file=sys.stderr,
                flush=True,
            )
        run_world("megarl.loop.replay:replay_rank", cfg.trainer_dims().world_size, cfg.to_dict(), prepared, replay)
    else:
        # by path: this launcher never imports the controller, nor torch (runtime/launch.py)
        run_world("megarl.loop.controller:run_rank", cfg.layout().world_size, cfg.to_dict(), prepared)
    summary = json.loads((Path(cfg.run.output_dir) / "summary.json").read_text())
    print(json.dumps(summary), flush=True)
    return summary


def say_start(cfg, config_path: str, overrides: Sequence[str], prepare_only: bool, replay: Optional[str]) -> None:
    """One stderr line before the silent part (model conversion, ranks importing Megatron and building
    the model: ~40 s for the tiny CPU run before the first progress line)."""
    ranks = cfg.trainer_dims().world_size if replay else cfg.layout().world_size
    then = "start no ranks (--prepare-only)" if prepare_only else f"start {ranks} ranks"
    given = f"{config_path}" + (f" with {len(overrides)} override(s)" if overrides else "")
    print(
        f"megarl: read {given}: {'replay' if replay else cfg.run.mode} run of {cfg.run.steps} steps into "
        f"{cfg.run.output_dir}; checking it, preparing the model {cfg.model.source}, then {then}",
        file=sys.stderr,
        flush=True,
    )


# What `megarl sft` reads (megarl/loop/sft.py): the model, the trainer's own sections, the aggregation's
# constant and the run's output. An RL config is a natural place to take them from, so the rest is named
# on stderr (RL settings that change nothing here), not refused.
SFT_READS = (
    "model.",
    "trainer.",
    "optimizer.",
    "rollout.max_new_tokens",  # trainer.loss_agg seq_mean_token_sum_norm's constant
    "run.output_dir",
    "run.seed",
    "run.progress",
    "run.keep_checkpoints",
)
# the trainer's fields for RL alone: the RL loss's parameters (the sft loss has none: they would be
# refused), the G steps per batch, and what shapes advantages and rewards (the sft loss reads neither)
SFT_UNREAD_TRAINER = (
    "trainer.loss_params",
    "trainer.updates_per_batch",
    "trainer.advantage_estimator",
    "trainer.normalize_advantage_std",
    "trainer.overlong",
    "trainer.overlong_buffer",
)


def sft(config_path: str, data: str, overrides: Sequence[str] = (), epochs: int = 1, batch_size: int = 8) -> dict:
    """`megarl sft`: the trainer's ranks alone on chat records (megarl/loop/sft.py), trainer.loss=sft."""
    cfg = load_config(config_path, ["trainer.loss=sft", *overrides])
    if cfg.trainer.loss != "sft":
        raise ConfigError(f"trainer.loss: megarl sft trains with 'sft', got {cfg.trainer.loss!r}")
    unread = [k for k in fields_set(cfg) if not k.startswith(SFT_READS) or k in SFT_UNREAD_TRAINER]
    cfg.trainer.loss_params = {}  # the file's RL loss's
    if unread:
        print(f"megarl sft: not read (RL settings; fine-tuning does not use them): {', '.join(unread)}",
              file=sys.stderr, flush=True)  # fmt: skip
    if running_under_torchrun():
        raise ConfigError("megarl sft starts its own ranks on this machine; under torchrun it is not supported yet")
    if not Path(data).is_file():
        raise ConfigError(f"--data {data}: no such file")
    check_loss(cfg, config_path)
    _resolve_dtypes(cfg, "sft")  # a fresh start: not the dtypes of a run in run.output_dir
    check_trainer_runs_here(cfg)
    prepared = model_source.prepare_model(cfg.model)
    check_model_trains(ModelSpec.from_dict(prepared.spec), cfg)
    run_world(
        "megarl.loop.sft:sft_rank", cfg.trainer_dims().world_size, cfg.to_dict(), prepared, data, epochs, batch_size
    )
    summary = json.loads((Path(cfg.run.output_dir) / "summary.json").read_text())
    print(json.dumps(summary), flush=True)
    return summary


def check_loss(cfg, config_path: Optional[str] = None) -> None:
    """The trainer's loss bound as its ranks will bind it (megarl.trainer.bound_loss), before any rank
    starts: a bad trainer.loss / loss_params / loss_agg is refused here, naming the field."""
    try:
        bind_loss(cfg.trainer, cfg.rollout, lag_bound=0)  # the lag bound changes nothing that is checked
    except ConfigError as e:
        raise ConfigError(f"{config_path or 'config'}: {e}") from None


def _check_episodes(cfg) -> None:
    """rollout.tools, rollout.env and rollout.agent resolved before any rank starts: a tool or factory that does not
    import, or does not make a tool, is named by its field here, not by the first generator rank."""
    if cfg.rollout.tools:
        from megarl.environments.tool import resolve_tools

        resolve_tools(cfg.rollout.tools)
    for name in ("env", "agent"):
        if getattr(cfg.rollout, name) is not None:
            from megarl.dotted_path import resolve_dotted_path

            resolve_dotted_path(getattr(cfg.rollout, name), f"rollout.{name}")


def _check_data(cfg) -> None:
    """data.train and data.eval parsed here, before a conversion or any rank: a missing file or a malformed
    line is named by the field and the file:line at once, not later by the first rank to read it."""
    check_data_source("data.train", cfg.data.train, cfg.data.max_prompt_tokens)
    for i, (_, spec) in enumerate(eval_sets(cfg.data)):
        field = f"data.eval[{i}]" if len(cfg.data.eval) > 1 else "data.eval"
        check_data_source(field, spec, cfg.data.max_prompt_tokens)


def _resolve_dtypes(cfg, replay: Optional[str]) -> None:
    """model.dtype / generator.dtype ``auto`` -> the concrete dtype for this machine (runtime/cpu_dtype.py),
    once, before any rank starts: the ranks and RUN_DIR/config.json see only fp32 or bf16. A run being
    resumed keeps the dtype its earlier launch recorded."""
    recorded = {} if replay else recorded_dtypes(Path(cfg.run.output_dir))
    for line in resolve_auto_dtypes(cfg, recorded=recorded):
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank resolves; one says so
            print(f"megarl: {line}", file=sys.stderr, flush=True)
