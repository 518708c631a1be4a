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
from megarl.parallel_dims import ParallelDims
from megarl.plan.dry_run import dry_run
from megarl.plan.inputs import FixedLayout, PlanInputs, TrainerLayout, generator_dims
from megarl.plan.llamarl_model import build_costs, evaluate_layout, pipeline_sizes, plan_from_inputs, trainer_layouts
from megarl.weight_sync.layouts import sglang_rank_layout

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {  # file -> (preset, GPUs, trainer ranks, generator ranks)
    "llama3_8b.yaml": ("llama3-8b", 256, 128, 128),
    "llama3_70b.yaml": ("llama3-70b", 256, 192, 64),
    "llama3_405b.yaml": ("llama3-405b", 1024, 768, 256),
}


def _config(name: str, *overrides: str):
    return load_config(str(ROOT / "configs" / name), overrides)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_llama_configs_load_and_validate(name):
    preset, gpus, trainer, generator = CONFIGS[name]
    cfg = _config(name)
    assert cfg.plan["model"] == preset and cfg.plan["gpus"] == gpus and cfg.plan["gpus_per_node"] == 8
    assert cfg.layout().world_size == gpus == cfg.trainer_dims().world_size + cfg.generator_dims().world_size
    assert (cfg.trainer_dims().world_size, cfg.generator_dims().world_size) == (trainer, generator)
    assert cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt == 2048  # LlamaRL's batch
    assert cfg.model.dtype == "bf16" and cfg.generator.fp8 and cfg.generator.tp == 8
    assert cfg.model.source.startswith("/checkpoints/Llama-3.1-")
    assert cfg.reward.function == "math" and cfg.data.train.endswith(".jsonl")
    assert cfg.rollout.max_new_tokens == 4096 and cfg.run.save_every > 0 and cfg.run.mode == "async"
    assert cfg.trainer.tp <= 8  # TP within a node; more model parallelism is PP
    preset_spec(preset).check_parallelism(cfg.trainer.tp, cfg.trainer.pp)  # even stages
    assert "recompute" not in cfg.plan and cfg.generator.backend == "sglang"
    assert cfg.trainer.sequence_parallel  # every layout here has TP > 1 and TE on its GPUs


def test_405b_dry_run_checks_1024_ranks_and_every_generator_shard():
    cfg = _config("llama3_405b.yaml")
    start = time.perf_counter()
    report = dry_run(cfg, "configs/llama3_405b.yaml")
    assert time.perf_counter() - start < 30
    out = report.to_json()
    assert out["world_size"] == 1024 and out["nodes"] == 128
    assert out["ranks_per_executor"] == {"trainer": 768, "generator": 256, "reward": 32}
    # TP8 x PP6 x DP16: 768 / 8 TP groups, 768 / 16 DP groups, 768 / 6 PP groups
    assert out["topology"]["groups"] == {"trainer_tp": 96, "trainer_dp": 48, "trainer_pp": 128, "generator_tp": 32}
    assert "every one of 1024 ranks is in exactly one executor" in out["checks"]
    assert "96 trainer TP groups, each within one node" in out["checks"]
    ws = out["weight_sync"]
    assert ws["senders"]["ranks"] == 768 and ws["receivers"]["ranks"] == 256 and ws["receivers"]["idle"] == 0
    assert ws["precision"] == "fp8" and ws["predicted_seconds"] > 0
    # independently of the dry run's own check: each generator rank's transfers add up to its shard
    plan, spec = report.sync_plan, preset_spec("llama3-405b")
    received = defaultdict(int)
    for (src, dst), transfers in plan.transfers.items():
        assert src < 768 <= dst < 1024  # trainer ranks send, generator ranks receive
        received[dst] += sum(t.numel for t in transfers)
    shard = [sum(t.covered_numel for t in sglang_rank_layout(spec, 8, tp_rank)) for tp_rank in range(8)]
    assert sorted(received) == list(range(768, 1024))
    assert all(received[768 + r * 8 + tp] == shard[tp] for r in range(32) for tp in range(8))
    # one replica holds Llama 3.1 405B's 405,853,388,800 parameters, its RMSNorm weights on every TP rank
    norms = (2 * spec.num_layers + 1) * spec.hidden_size
    assert sum(shard) == 405_853_388_800 + (8 - 1) * norms


@pytest.mark.parametrize(
    "overrides,field",
    [
        (("trainer.tp=16", "trainer.pp=3", "trainer.vpp=1"), "trainer.tp=16: TP group [0-15] spans nodes"),  # 768 ranks
        (("trainer.dp=32",), "plan.gpus=1024: the config needs 1792 GPUs"),  # does not fit the allocation
        (("trainer.pp=4", "trainer.vpp=1"), "trainer.tp=8 / trainer.pp=4"),  # 126 layers in 4 stages
        (("trainer.max_tokens_per_microbatch=4096",), "trainer.max_tokens_per_microbatch=4096"),
        (("plan.gpus_per_node=eight",), "plan.gpus_per_node"),
    ],
)
def test_broken_layouts_are_named(overrides, field):
    with pytest.raises(ConfigError) as err:
        dry_run(_config("llama3_405b.yaml", *overrides))
    assert field in str(err.value)


def test_plan_config_json_has_step_times_and_speedup(capsys):
    assert megarl_main(["plan", "--config", str(ROOT / "configs/llama3_405b.yaml"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    steps = out["predicted_step_seconds"]
    assert 0 < steps["configured"] < steps["synchronous_baseline"]
    # the trainer's own settings, as configs/llama3_405b.yaml sets them (Megatron-LM's names)
    trainer = out["configured"]["trainer"]
    assert {
        k: trainer[k]
        for k in (
            "tp",
            "pp",
            "dp",
            "gpus",
            "sequence_parallel",
            "cp",
            "vpp",
            "recompute",
            "recompute_method",
            "recompute_num_layers",
            "micro_batch_tokens",
        )
    } == {
        "tp": 8,
        "pp": 6,
        "dp": 16,
        "gpus": 768,
        "sequence_parallel": True,
        "cp": 1,
        "vpp": 3,
        "recompute": "full",
        "recompute_method": "block",
        "recompute_num_layers": 6,
        "micro_batch_tokens": 4608,
    }
    assert out["configured"]["generator"]["replicas"] == 32 and out["configured"]["fits"]
    assert out["configured"]["memory"]["generator"]["layout"].startswith("TP8 fp8 x64")
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
    assert all(126 % t.dims.pp == 0 for t in trainer_layouts(build_costs(inputs), 16))
    assert 126 % plan_from_inputs(inputs).best_async.trainer.dims.pp == 0
    fixed = FixedLayout(TrainerLayout(ParallelDims(tp=8, pp=16, dp=6)), generator_dims(tp=8, gpus=1024 - 768))
    with pytest.raises(ConfigError, match="layout.trainer.pp=16 does not divide the 126 layers"):
        evaluate_layout(inputs, fixed)
    from dataclasses import replace

    assert evaluate_layout(replace(inputs, uneven_pp=True), fixed).trainer.dims.pp == 16  # on request only


# -- one source of truth: the planner prices what the trainer runs ------------------------------------


def test_configured_layout_is_the_trainers_settings():
    from megarl.plan.config_plan import inputs_from_config, trainer_layout

    cfg = _config("llama3_405b.yaml")
    inputs = inputs_from_config(cfg)
    t = trainer_layout(cfg, inputs)
    assert t.dims == cfg.trainer_dims() == ParallelDims(tp=8, pp=6, dp=16, vpp=3)  # the trainer's own dims
    assert t.sequence_parallel
    assert (t.recompute, t.recompute_method, t.recompute_num_layers) == ("full", "block", 6)
    assert t.micro_batch_tokens == cfg.trainer.max_tokens_per_microbatch == 4608
    assert inputs.generator_backend == "sglang" and inputs.generator_mem_fraction == cfg.generator.sglang_mem_fraction
    assert inputs.trainer_options.state_sharding == "optimizer"  # optimizer.use_distributed_optimizer
    # Megatron's recompute_granularity None is no recomputation, not the old default "selective"
    off = trainer_layout(
        _config(
            "llama3_405b.yaml",
            "trainer.recompute_granularity=null",
            "trainer.recompute_method=null",
            "trainer.recompute_num_layers=null",
        ),
        inputs,
    )
    assert off.recompute == "none"
    plain = inputs_from_config(_config("llama3_405b.yaml", "optimizer.use_distributed_optimizer=false"))
    assert plain.trainer_options.state_sharding == "none"


def test_plan_recompute_field_is_refused_naming_the_trainer_field():
    with pytest.raises(ConfigError, match="plan.recompute: .*trainer.recompute_granularity"):
        from megarl.plan.config_plan import plan_section

        plan_section(_config("llama3_405b.yaml", "plan.recompute=selective"))


_NO_RECOMPUTE = (
    "trainer.recompute_granularity=null",
    "trainer.recompute_method=null",
    "trainer.recompute_num_layers=null",
)


def test_a_config_that_does_not_fit_is_refused_naming_activations(capsys):
    # configs/llama3_405b.yaml with recomputation off: PP rank 0 holds 6 micro-batches of 21 layers
    code = megarl_main(["plan", "--config", str(ROOT / "configs/llama3_405b.yaml"), *_NO_RECOMPUTE])
    err = capsys.readouterr().err
    assert code == 2
    assert "PP rank 0: activations" in err and "overflows the 80 GB GPU" in err
    assert "trainer.recompute_granularity=full" in err  # the remedy, priced: it fits
    # the same with sequence parallelism off too: the remedy list starts with it
    code = megarl_main(
        ["plan", "--config", str(ROOT / "configs/llama3_405b.yaml"), *_NO_RECOMPUTE, "trainer.sequence_parallel=false"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "activations" in err and "fits with trainer.sequence_parallel=true" in err


def test_prepare_only_refuses_a_config_that_does_not_fit(monkeypatch):
    """`megarl train --prepare-only` checks the layout before converting anything (no SP here: this
    machine has no Transformer Engine, which megarl train refuses first)."""
    import megarl.model_source
    from megarl.train import train

    def no_conversion(*a, **k):
        raise AssertionError("prepare_model ran for a layout that does not fit")

    monkeypatch.setattr(megarl.model_source, "prepare_model", no_conversion)
    with pytest.raises(ConfigError, match=r"trainer TP8xPP6 VPP3 mb1 no recompute, PP rank 0: activations"):
        train(
            str(ROOT / "configs/llama3_405b.yaml"),
            ["trainer.sequence_parallel=false", *_NO_RECOMPUTE],
            prepare_only=True,
        )


def test_prepare_only_skips_the_planner_for_cpu_configs(monkeypatch, capsys):
    import megarl.model_source
    import megarl.plan.config_plan
    from megarl.models.presets import preset_spec
    from megarl.train import train

    class Prepared:
        checkpoint, tokenizer, spec = "/tmp/none", "smollm2", preset_spec("tiny").to_dict()

    def no_planner(cfg):
        raise AssertionError("a config without a plan: section was planned")

    monkeypatch.setattr(megarl.model_source, "prepare_model", lambda model, **k: Prepared())
    monkeypatch.setattr(megarl.plan.config_plan, "check_config_fits", no_planner)
    assert train(str(ROOT / "configs/tiny_cpu.yaml"), [], prepare_only=True) == {}
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["world_size"] == 3


def test_generator_backend_changes_memory_and_time():
    """The torch engine allocates max_running x max_seq_len KV slots at start; SGLang holds what is in
    flight within sglang_mem_fraction. Hand-computed for the 8B config (TP8: one of the 8 KV heads)."""
    from megarl.plan.config_plan import check_config_fits

    kv_per_token = 32 * 2 * 1 * 128 * 2  # layers x (K, V) x KV heads per rank x head_dim x bf16 bytes
    torch = check_config_fits(_config("llama3_8b.yaml", "generator.backend=torch"))
    assert torch.generator_memory.parts["kv_cache"] == 128 * 4608 * kv_per_token
    sglang = check_config_fits(_config("llama3_8b.yaml", "generator.sglang_mem_fraction=0.5"))
    assert sglang.generator_memory.parts["reserved"] == pytest.approx(0.5 * 80e9)
    # 128 sequences at the mean in-flight context of uniform [512, 4096] responses: 512 + E[L^2] / (2 E[L])
    mean_sq = sum(x * x for x in range(512, 4097)) / 3585
    assert sglang.generator_memory.parts["kv_cache"] == pytest.approx(128 * (512 + mean_sq / (2 * 2304)) * kv_per_token)
    assert torch.generate_seconds > 4 * sglang.generate_seconds  # eager kernels, fp8 dequantised per matmul


def test_plan_config_json_carries_the_paper_scenario(capsys):
    assert (
        megarl_main(["plan", "--config", str(ROOT / "configs/llama3_70b.yaml"), "--json", "plan.weight_sync=estimate"])
        == 0
    )
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    sc = out["paper_scenario"]
    assert sc["scenario"] == "llamarl-70b" and sc["paper_speedup"] == 3.98
    assert sc["predicted_speedup"] == pytest.approx(3.98, rel=0.15)  # LlamaRL Table 3, the 15%
