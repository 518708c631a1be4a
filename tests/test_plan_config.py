"""The Llama 3.1 run configs, `megarl plan --config` and its 1024-rank topology dry run."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import pytest

from megarl.cli import main as megarl_main
from megarl.config import load_config
from megarl.errors import ConfigError
from megarl.models.presets import preset_spec
from megarl.plan.dry_run import dry_run
from megarl.plan.inputs import FixedLayout, GeneratorLayout, PlanInputs, TrainerLayout
from megarl.plan.llamarl_model import evaluate_layout, pipeline_sizes, plan_from_inputs, trainer_layouts, build_costs
from megarl.weight_sync.layouts import sglang_rank_layout

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {  # file -> (preset, GPUs, trainer ranks, generator ranks)
    "llama3_8b.yaml": ("llama3-8b", 256, 128, 128),
    "llama3_70b.yaml": ("llama3-70b", 256, 192, 64),
    "llama3_405b.yaml": ("llama3-405b", 1024, 896, 128),
}


def _config(name: str, *overrides: str):
    return load_config(str(ROOT / "configs" / name), overrides)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_llama_configs_load_and_validate(name):
    preset, gpus, trainer, generator = CONFIGS[name]
    cfg = _config(name)
    assert cfg.plan["model"] == preset and cfg.plan["gpus"] == gpus and cfg.plan["gpus_per_node"] == 8
    assert cfg.world_size() == gpus == cfg.trainer_size() + cfg.generator_size()
    assert (cfg.trainer_size(), cfg.generator_size()) == (trainer, generator)
    assert cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt == 2048  # LlamaRL's batch
    assert cfg.model.dtype == "bf16" and cfg.generator.fp8 and cfg.generator.tp == 8
    assert cfg.model.source.startswith("/checkpoints/Llama-3.1-")
    assert cfg.reward.function == "math" and cfg.data.train.endswith(".jsonl")
    assert cfg.rollout.max_new_tokens == 4096 and cfg.run.save_every > 0 and cfg.run.mode == "async"
    assert cfg.trainer.tp <= 8  # TP within a node; more model parallelism is PP
    preset_spec(preset).check_parallelism(cfg.trainer.tp, cfg.trainer.pp)  # even stages


def test_405b_dry_run_checks_1024_ranks_and_every_generator_shard():
    cfg = _config("llama3_405b.yaml")
    start = time.perf_counter()
    report = dry_run(cfg, "configs/llama3_405b.yaml")
    assert time.perf_counter() - start < 30
    out = report.to_json()
    assert out["world_size"] == 1024 and out["nodes"] == 128
    assert out["ranks_per_executor"] == {"trainer": 896, "generator": 128, "reward": 16}
    assert out["topology"]["groups"] == {"trainer_tp": 112, "trainer_dp": 112, "trainer_pp": 64, "generator_tp": 16}
    assert "every one of 1024 ranks is in exactly one executor" in out["checks"]
    assert "112 trainer TP groups, each within one node" in out["checks"]
    ws = out["weight_sync"]
    assert ws["senders"]["ranks"] == 896 and ws["receivers"]["ranks"] == 128 and ws["receivers"]["idle"] == 0
    assert ws["precision"] == "fp8" and ws["predicted_seconds"] > 0
    # independently of the dry run's own check: each generator rank's transfers add up to its shard
    plan, spec = report.sync_plan, preset_spec("llama3-405b")
    received = defaultdict(int)
    for (src, dst), transfers in plan.transfers.items():
        assert src < 896 <= dst < 1024  # trainer ranks send, generator ranks receive
        received[dst] += sum(t.numel for t in transfers)
    shard = [sum(t.covered_numel for t in sglang_rank_layout(spec, 8, tp_rank)) for tp_rank in range(8)]
    assert sorted(received) == list(range(896, 1024))
    assert all(received[896 + r * 8 + tp] == shard[tp] for r in range(16) for tp in range(8))
    # one replica holds Llama 3.1 405B's 405,853,388,800 parameters, its RMSNorm weights on every TP rank
    norms = (2 * spec.num_layers + 1) * spec.hidden_size
    assert sum(shard) == 405_853_388_800 + (8 - 1) * norms


@pytest.mark.parametrize("overrides,field", [
    (("trainer.tp=16", "trainer.pp=7"), "trainer.tp=16: TP group [0-15] spans nodes"),  # 896 ranks, TP across nodes
    (("trainer.dp=16",), "plan.gpus=1024: the config needs 1920 GPUs"),  # does not fit the allocation
    (("trainer.pp=4",), "trainer.tp=8 / trainer.pp=4"),  # 126 layers in 4 stages
    (("trainer.max_tokens_per_microbatch=4096",), "trainer.max_tokens_per_microbatch=4096"),
    (("plan.gpus_per_node=eight",), "plan.gpus_per_node"),
])
def test_broken_layouts_are_named(overrides, field):
    with pytest.raises(ConfigError) as err:
        dry_run(_config("llama3_405b.yaml", *overrides))
    assert field in str(err.value)


def test_plan_config_json_has_step_times_and_speedup(capsys):
    assert megarl_main(["plan", "--config", str(ROOT / "configs/llama3_405b.yaml"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    steps = out["predicted_step_seconds"]
    assert 0 < steps["configured"] < steps["synchronous_baseline"]
    assert out["configured"]["trainer"] == {"tp": 8, "pp": 14, "dp": 8, "micro_batch": 1, "recompute": "selective",
                                            "gpus": 896}
    assert out["configured"]["generator"]["replicas"] == 16 and out["configured"]["fits"]
    assert out["configured"]["weight_sync_method"] == "predict"
    assert out["speedup"] > 1 and out["configured"]["speedup"] > 1
    assert 126 % out["asynchronous"]["trainer"]["pp"] == 0  # the searched layout is one megarl runs
    assert 512 % out["asynchronous"]["generator"]["replicas"] == 0  # equal prompt shares


def test_plan_config_refuses_model_mode_flags(capsys):
    assert megarl_main(["plan", "--config", str(ROOT / "configs/llama3_8b.yaml"), "--gpus", "512"]) == 2
    assert "--gpus: not with --config; set plan.gpus" in capsys.readouterr().err


def test_search_never_recommends_uneven_pipeline_stages():
    assert pipeline_sizes(126, 16) == [1, 2, 3, 6, 7, 9, 14]
    assert pipeline_sizes(126, 16, uneven=True) == [1, 2, 3, 4, 6, 7, 8, 9, 14, 16]
    inputs = PlanInputs(model="llama3-405b", gpus=1024, weight_sync="estimate")
    assert all(126 % t.pp == 0 for t in trainer_layouts(build_costs(inputs), 16))
    assert 126 % plan_from_inputs(inputs).best_async.trainer.pp == 0
    fixed = FixedLayout(TrainerLayout(8, 16), GeneratorLayout(8), trainer_gpus=768)
    with pytest.raises(ConfigError, match="layout.trainer.pp=16 does not divide the 126 layers"):
        evaluate_layout(inputs, fixed)
    from dataclasses import replace

    assert evaluate_layout(replace(inputs, uneven_pp=True), fixed).trainer.pp == 16  # on request only
