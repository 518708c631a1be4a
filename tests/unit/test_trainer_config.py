"""The trainer's and optimizer's config sections: every value reaches Megatron or the loss, or is refused.

Loss parameters: for each built-in loss and each parameter, the per-token loss the
forward-step hook computes from a loaded config equals the loss's formula written
out here with the configured value, and differs from what the default would give
(so a dropped parameter fails). Megatron settings: the TransformerConfig and
optimizer a config builds carry its values.
"""

import math
from pathlib import Path

import pytest
import torch

from megarl.config import load_config
from megarl.errors import ConfigError
from megarl.executors.trainer import megatron_model_settings
from megarl.train import check_loss
from megarl.trainer.bound_loss import bind_loss
from megarl.trainer.hooks import per_token_loss
from megarl.trainer.losses import LossInputs

TINY = "configs/tiny_cpu.yaml"


# three tokens: log pi, log mu, advantage, log ref
LOGP = [-0.5, -1.5, -1.0]


MU = [-1.0, -1.0, -2.5]


ADV = [1.0, -1.0, 0.5]


REF = [-0.8, -1.2, -1.0]


def hook_loss(overrides):
    cfg = load_config(TINY, overrides)
    loss = bind_loss(cfg.trainer, cfg.rollout, lag_bound=0)
    x = LossInputs(
        torch.tensor(LOGP, dtype=torch.float64),
        torch.tensor(MU, dtype=torch.float64),
        torch.tensor(ADV, dtype=torch.float64),
        ref_logprobs=torch.tensor(REF, dtype=torch.float64),
    )
    return per_token_loss(loss, x)[1].tolist()


def aipo_ref(rho):
    return [-min(math.exp(lp - mu), rho) * a * lp for lp, mu, a in zip(LOGP, MU, ADV)]


def ppo_ref(eps, eps_high):
    out = []
    for lp, mu, a in zip(LOGP, MU, ADV):
        r = math.exp(lp - mu)
        out.append(-min(r * a, min(max(r, 1 - eps), 1 + eps_high) * a))
    return out


@pytest.mark.parametrize(
    "overrides, expected, default",
    [
        # ratios e^0.5 = 1.65, e^-0.5 = 0.61, e^1.5 = 4.48: rho 1.5 clips the first and the last
        (["trainer.loss_params={rho: 1.5}"], aipo_ref(1.5), aipo_ref(4.0)),
        (["trainer.loss=ppo_clip", "trainer.loss_params={eps: 0.45}"], ppo_ref(0.45, 0.45), ppo_ref(0.2, 0.2)),
        (["trainer.loss=ppo_clip", "trainer.loss_params={eps_high: 0.9}"], ppo_ref(0.2, 0.9), ppo_ref(0.2, 0.2)),
    ],
)
def test_each_loss_parameter_reaches_the_hook(overrides, expected, default):
    ours = hook_loss(overrides)
    assert ours == pytest.approx(expected, rel=1e-12, abs=0)
    assert ours != pytest.approx(default, rel=1e-6)  # the value changed the loss: dropping it would fail


def test_user_loss_parameters_reach_the_hook():
    name = "examples.losses.entropy_bonus:aipo_with_entropy_bonus"
    cfg = load_config(TINY, [f"trainer.loss={name}", "trainer.loss_params={entropy_coef: 0.3, rho: 1.5}"])
    loss = bind_loss(cfg.trainer, cfg.rollout, lag_bound=0)
    entropy = [2.0, 1.0, 0.5]
    x = LossInputs(
        torch.tensor(LOGP, dtype=torch.float64),
        torch.tensor(MU, dtype=torch.float64),
        torch.tensor(ADV, dtype=torch.float64),
        entropy=torch.tensor(entropy, dtype=torch.float64),
    )
    ours = per_token_loss(loss, x)[1].tolist()
    assert ours == pytest.approx([a - 0.3 * e for a, e in zip(aipo_ref(1.5), entropy)], rel=1e-12)


@pytest.mark.parametrize(
    "estimator, kl",
    [
        ("k1", [lp - r for lp, r in zip(LOGP, REF)]),
        ("k2", [0.5 * (lp - r) ** 2 for lp, r in zip(LOGP, REF)]),
        ("k3", [math.exp(r - lp) - (r - lp) - 1 for lp, r in zip(LOGP, REF)]),
    ],
)
def test_kl_coef_and_estimator_reach_the_hook(estimator, kl):
    ours = hook_loss(["trainer.kl_coef=0.25", f"trainer.kl_estimator={estimator}"])
    assert ours == pytest.approx([a + 0.25 * k for a, k in zip(aipo_ref(4.0), kl)], rel=1e-12)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.rho=2.0"], "trainer.rho: moved to trainer.loss_params.rho"),
        (["trainer.lr=1e-5"], "trainer.lr: moved to optimizer.lr"),
        (["trainer.recompute_granularity=full"], "full needs trainer.recompute_method"),
        (
            ["trainer.recompute_method=uniform"],
            "trainer.recompute_method: used only with trainer.recompute_granularity=full",
        ),
        (["trainer.recompute_granularity=some"], "trainer.recompute_granularity: 'some' is not one of"),
        (["trainer.recompute_modules=[mlp]"], "trainer.recompute_modules: used only with"),
        (["trainer.vpp=2"], "trainer.vpp=2: .*needs trainer.pp > 1"),
        (["trainer.kl_estimator=k5"], "trainer.kl_estimator: 'k5'"),
        (["optimizer.min_lr=1e-5"], "optimizer.min_lr: used only with lr_decay_style linear | cosine"),
        (["optimizer.lr_decay_style=cosine", "optimizer.min_lr=1.0"], "optimizer.min_lr=1.0 is above optimizer.lr"),
        (["optimizer.lr_decay_style=cosine", "optimizer.lr_warmup_iters=3"], "lr_warmup_iters=3 must be below"),
        (["optimizer.lr_decay_style=step"], "optimizer.lr_decay_style: 'step' is not one of"),
        (["optimizer.sgd_momentum=0.5"], "optimizer.sgd_momentum: not used by optimizer.optimizer=adam"),
        (
            ["optimizer.overlap_param_gather=true"],
            "optimizer.overlap_param_gather: needs use_distributed_optimizer and",
        ),
        (["optimizer.lr_warmup_init=1e-4"], "optimizer.lr_warmup_init: used only with optimizer.lr_warmup_iters > 0"),
        (["run.mode=sync", "trainer.pp=2", "trainer.vpp=2", "rollout.prompts_per_step=2"], "trainer.vpp: sync"),
        (["run.mode=sync", "trainer.updates_per_batch=0"], "trainer.updates_per_batch: must be >= 1, got 0"),
        (["trainer.updates_per_batch=4"], r"trainer.updates_per_batch=4: .*\(run.mode=sync\)"),
        (["run.mode=sync", "generator.inflight_updates=false"], "generator.inflight_updates=false: sync mode never"),
    ],
)
def test_bad_trainer_and_optimizer_settings_are_refused_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, overrides)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.loss=grpo_v9"], "trainer.loss: 'grpo_v9' is unknown"),
        (["trainer.loss=no_such_pkg:f"], "trainer.loss: cannot import module 'no_such_pkg'"),
        (["trainer.loss_params={eps: 0.2}"], r"trainer.loss_params.eps: loss 'aipo' has no such parameter"),
        (["trainer.loss=ppo_clip", "trainer.loss_params={eps: 2}"], r"trainer.loss_params.eps: must be in \(0, 1\)"),
    ],
)
def test_bad_loss_settings_are_refused_naming_the_field_before_any_rank_starts(overrides, message):
    # the loss is looked up once, by the resolver the trainer uses; `megarl train` calls it before it launches
    with pytest.raises(ConfigError, match=f"{TINY}: {message}"):
        check_loss(load_config(TINY, overrides), TINY)


def test_sequence_and_context_parallel_are_refused_where_transformer_engine_cannot_run(monkeypatch):
    from megarl.trainer import features
    from megarl.trainer.features import check_trainer_runs_here, transformer_engine_available

    if transformer_engine_available():
        pytest.skip("needs a machine without Transformer Engine on CUDA (every CPU machine)")
    sp = load_config(TINY, ["trainer.sequence_parallel=true", "trainer.tp=2"])
    if not features._cuda_available():
        check_trainer_runs_here(sp)  # on CPU: megatron_patches/torch_norm_sp.py runs it
    with monkeypatch.context() as gpu_without_te:  # a CUDA machine without the transformer_engine package
        gpu_without_te.setattr(features, "_cuda_available", lambda: True)
        gpu_without_te.setattr(features.importlib.util, "find_spec", lambda name: None)
        with pytest.raises(ConfigError, match="trainer.sequence_parallel: needs Transformer Engine on GPUs"):
            check_trainer_runs_here(sp)
    for overrides, message in [
        (["trainer.cp=2"], "trainer.cp=2: context parallelism runs in Transformer Engine"),
        (["optimizer.overlap_grad_reduce=true"], "optimizer.overlap_grad_reduce: .*on CPU"),
    ]:
        cfg = load_config(TINY, overrides)  # a consistent config: `megarl plan` reads it anywhere
        with pytest.raises(ConfigError, match=message):
            check_trainer_runs_here(cfg)


def test_recompute_settings_reach_megatron():
    from megarl.models.megatron_model import transformer_config
    from megarl.models.presets import preset_spec

    cfg = load_config(
        TINY, ["trainer.recompute_granularity=full", "trainer.recompute_method=block", "trainer.recompute_num_layers=1"]
    )
    config = transformer_config(preset_spec("tiny"), **megatron_model_settings(cfg.trainer))
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == ("full", "block", 1)
    cfg = load_config(TINY, ["trainer.recompute_granularity=selective", "trainer.recompute_modules=[core_attn,mlp]"])
    config = transformer_config(preset_spec("tiny"), **megatron_model_settings(cfg.trainer))
    assert config.recompute_granularity == "selective" and config.recompute_modules == ["core_attn", "mlp"]


CONFIGS = sorted(Path(__file__).resolve().parents[2].glob("configs/*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads(path):
    # strict loading: a misspelt field or a value a section refuses (e.g. an overlong_buffer above
    # max_new_tokens) in a shipped config would otherwise surface only when a user launches it
    assert load_config(str(path)).run.output_dir


def test_expert_settings_need_experts_and_fp8_expert_shapes_are_checked():
    """Every family trains; expert parallelism on a dense model, fp8 generators of a MoE model whose
    expert shards SGLang cannot block-quantise, and fp8 experts in sync mode are refused naming the
    field (a check that lets them through, or names another field, fails)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    from megarl.models.spec import ModelSpec
    from megarl.trainer.features import check_model_trains

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    shape.update(num_key_value_heads=2)
    moe = ModelSpec.from_hf_config(
        Qwen3MoeConfig(**shape, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    )
    ep_fields = ["trainer.ep=2", "trainer.etp=1", "generator.ep=2", "generator.tp=2"]  # tiny_cpu: trainer.tp=2
    ep = load_config(TINY, [*ep_fields, "trainer.sequence_parallel=true"])
    for config in (LlamaConfig, Qwen2Config, Qwen3Config):
        check_model_trains(ModelSpec.from_hf_config(config(**shape)), load_config(TINY))
        with pytest.raises(ConfigError, match=r"trainer.ep=2: model_type '\w+' has no experts"):
            check_model_trains(ModelSpec.from_hf_config(config(**shape)), ep)
    generator_ep = load_config(TINY, ["generator.ep=2", "generator.tp=2"])
    with pytest.raises(ConfigError, match=r"generator.ep=2: model_type 'qwen3' has no experts"):
        check_model_trains(ModelSpec.from_hf_config(Qwen3Config(**shape)), generator_ep)
    check_model_trains(moe, ep)
    # Megatron's MoELayer trains at TP > 1 only with sequence parallelism
    with pytest.raises(ConfigError, match=r"trainer.sequence_parallel: Megatron's MoE layers train at trainer.tp=2"):
        check_model_trains(moe, load_config(TINY, ep_fields))
    check_model_trains(moe, load_config(TINY, [*ep_fields, "trainer.tp=1", "trainer.dp=2"]))
    # fp8 experts: SGLang's block-fp8 FusedMoE needs each expert's shard in whole 128-row blocks (16 is not)
    fp8 = load_config(TINY, ["generator.fp8=true", "trainer.sequence_parallel=true"])
    with pytest.raises(
        ConfigError, match=r"generator.fp8: each expert's intermediate shard is moe_intermediate_size 16"
    ):
        check_model_trains(moe, fp8)
    aligned = dict(shape, hidden_size=128, num_attention_heads=2, head_dim=128)
    aligned_moe = ModelSpec.from_hf_config(
        Qwen3MoeConfig(**aligned, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256)
    )
    check_model_trains(aligned_moe, fp8)
    with pytest.raises(
        ConfigError, match=r"generator.fp8: sync \(colocated\) mode does not block-quantise stacked experts"
    ):
        check_model_trains(
            aligned_moe, load_config(TINY, ["generator.fp8=true", "run.mode=sync", "trainer.sequence_parallel=true"])
        )


def test_sync_mode_refuses_expert_parallelism():
    """Sync mode copies each rank's shards into its own engine by TP x PP: experts split over EP
    would be missing from it."""
    for overrides in (["trainer.ep=2", "trainer.dp=2"], ["generator.ep=2", "generator.tp=2"]):
        with pytest.raises(ConfigError, match="trainer.ep / trainer.etp / generator.ep: sync"):
            load_config(TINY, ["run.mode=sync", *overrides])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.moe_router_load_balancing_type=seq_aux_loss"], "trainer.moe_router_load_balancing_type"),
        (["trainer.moe_router_load_balancing_type=aux_loss"], "trainer.moe_aux_loss_coeff: the aux loss needs"),
        (["trainer.moe_aux_loss_coeff=0.01"], "trainer.moe_aux_loss_coeff: the aux loss needs"),
        (["trainer.moe_aux_loss_coeff=-1"], "trainer.moe_aux_loss_coeff: must be >= 0"),
        (["trainer.moe_z_loss_coeff=0"], "trainer.moe_z_loss_coeff: must be > 0"),
        (["trainer.moe_token_dispatcher_type=flex"], "trainer.moe_token_dispatcher_type"),
    ],
)
def test_bad_moe_training_settings_are_refused_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, overrides)


def test_moe_training_settings_reach_megatron_and_dense_models_refuse_them():
    """The trainer's MoE fields become Megatron's TransformerConfig fields of a model with experts (its
    defaults equal what megarl builds such a model with); on a dense model each one is refused."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    from megarl.models.megatron_model import transformer_config
    from megarl.models.spec import ModelSpec
    from megarl.trainer.features import check_model_trains, check_trainer_runs_here

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    shape.update(num_key_value_heads=2)
    moe = ModelSpec.from_hf_config(
        Qwen3MoeConfig(**shape, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    )
    dense = ModelSpec.from_hf_config(Qwen3Config(**shape))
    fields = ["moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_token_dispatcher_type"]
    default = transformer_config(moe, **megatron_model_settings(load_config(TINY).trainer))
    assert [getattr(default, k) for k in fields] == ["none", 0.0, None, "alltoall"]
    assert default.calculate_per_token_loss  # read by the routers when built: the aux losses' scale
    cfg = load_config(
        TINY,
        [
            "trainer.moe_router_load_balancing_type=aux_loss",
            "trainer.moe_aux_loss_coeff=0.01",
            "trainer.moe_z_loss_coeff=0.001",
            "trainer.moe_token_dispatcher_type=allgather",
        ],
    )
    config = transformer_config(moe, **megatron_model_settings(cfg.trainer))
    assert [getattr(config, k) for k in fields] == ["aux_loss", 0.01, 0.001, "allgather"]
    for overrides in (
        ["trainer.moe_router_load_balancing_type=aux_loss", "trainer.moe_aux_loss_coeff=0.01"],
        ["trainer.moe_z_loss_coeff=0.001"],
        ["trainer.moe_token_dispatcher_type=allgather"],
    ):
        with pytest.raises(ConfigError, match=f"{overrides[0]}: model_type 'qwen3' has no experts"):
            check_model_trains(dense, load_config(TINY, overrides))
    with pytest.raises(
        ConfigError, match="trainer.moe_grouped_gemm: runs the local experts through Transformer Engine"
    ):
        check_trainer_runs_here(load_config(TINY, ["trainer.moe_grouped_gemm=true"]))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["rollout.max_turns=3"], r"rollout.max_turns: > 1 needs rollout.tools, rollout.env or rollout.agent"),
        (
            [
                "rollout.agent=tests.agents_for_tests:two_call_agent",
                "rollout.tools=[calculator]",
                "rollout.max_turns=3",
            ],
            r"rollout.agent: the agent runs its own tools and turns; rollout.tools would too",
        ),
        (["rollout.agent=two_call_agent"], r"rollout.agent: 'two_call_agent' is not a dotted path"),
        (["rollout.tools=[calculator]"], r"rollout.tools: needs rollout.max_turns >= 2"),
        (["rollout.env=tests.episode_envs_for_tests:two_tool_turns"], r"rollout.env: needs rollout.max_turns >= 2"),
        (
            [
                "rollout.tools=[calculator]",
                "rollout.env=tests.episode_envs_for_tests:two_tool_turns",
                "rollout.max_turns=3",
            ],
            r"rollout.tools: an environment \(rollout.env\) answers its own tool calls",
        ),
        (
            ["rollout.tools=[search]", "rollout.max_turns=3"],
            r"rollout.tools: no tool 'search'; built in: calculator, python",
        ),
        (["rollout.tools=[calculator]", "rollout.max_turns=0"], r"rollout.max_turns: must be >= 1"),
        (["rollout.tools=[calculator]", "rollout.max_turns=3", "rollout.env_timeout_s=0"], r"rollout.env_timeout_s"),
        (
            ["rollout.tools=[calculator]", "rollout.max_turns=3", "trainer.moe_enable_routing_replay=true"],
            r"trainer.moe_enable_routing_replay: routes of multi-turn episodes",
        ),
        (["generator.kv_park_timeout_s=5"], r"generator.kv_park_timeout_s: parks the KV cache of an episode"),
        (
            ["rollout.tools=[calculator]", "rollout.max_turns=3", "generator.kv_park_timeout_s=-1"],
            r"generator.kv_park_timeout_s: must be >= 0",
        ),
        (
            ["rollout.tools=[calculator]", "rollout.max_turns=3", "generator.tp=2"],
            r"generator.tp: episodes \(rollout.tools / rollout.env / rollout.agent\) on the torch engine need",
        ),
        (
            [
                "rollout.tools=[calculator]",
                "rollout.max_turns=3",
                "generator.backend=sglang",
                "generator.kv_park_timeout_s=5",
            ],
            r"generator.kv_park_timeout_s: SGLang's radix cache keeps an episode's prefix",
        ),
    ],
)
def test_episode_settings_that_mean_nothing_are_refused(overrides, message):
    load_config(TINY, ["rollout.tools=[calculator]", "rollout.max_turns=3"])  # the valid combinations load
    load_config(TINY, ["rollout.agent=tests.agents_for_tests:two_call_agent"])  # an agent may make one call
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, overrides)


def test_eval_sets_are_one_spec_or_named_specs():
    from megarl.config import eval_sets

    one = load_config(TINY, ["data.eval=arithmetic:8:5:heldout:64:1"])
    assert eval_sets(one.data) == [("", "arithmetic:8:5:heldout:64:1")]
    two = load_config(TINY, ["data.eval=[heldout=arithmetic:8:5:heldout:64:1,ood=arithmetic-ood:8:1]"])
    assert eval_sets(two.data) == [("heldout", "arithmetic:8:5:heldout:64:1"), ("ood", "arithmetic-ood:8:1")]
    assert eval_sets(load_config(TINY).data) == []
    with pytest.raises(ConfigError, match=r"data.eval\[1\]: 'arithmetic-ood:8:1': name each of several sets"):
        load_config(TINY, ["data.eval=[heldout=arithmetic:8:5,arithmetic-ood:8:1]"])
    with pytest.raises(ConfigError, match="data.eval: two sets named 'a'"):
        load_config(TINY, ["data.eval=[a=arithmetic:8:5,a=arithmetic-ood:8:1]"])
