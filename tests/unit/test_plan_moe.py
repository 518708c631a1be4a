"""The planner on mixture-of-experts models: parameters, state and FLOPs counted by hand.

The references are independent of megarl's code: Qwen3-30B-A3B's model card (30.5B parameters,
3.3B activated) and products of its config.json fields written out below.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from megarl.config import load_config
from megarl.errors import ConfigError
from megarl.models.presets import preset_spec
from megarl.parallel_dims import ParallelDims
from megarl.plan import activations
from megarl.plan.config_plan import plan_config
from megarl.plan.costs import ModelShape
from megarl.plan.dry_run import dry_run
from megarl.plan.inputs import TrainerLayout, TrainerOptions
from megarl.weight_sync.layouts import sglang_rank_layout

ROOT = Path(__file__).resolve().parents[2]

# Qwen3-30B-A3B's config.json: hidden 2048, 48 layers (all MoE), 32 q / 4 kv heads of 128,
# 128 experts of width 768, top 8, vocabulary 151936, untied embeddings
H, L, E, K, F, V = 2048, 48, 128, 8, 768, 151936
EXPERT = 3 * H * F  # gate, up, down
ATTENTION = 32 * 128 * H + 2 * 4 * 128 * H + 32 * 128 * H  # q, k and v, o
ROUTER = E * H
EXPERTS_30B = L * E * EXPERT  # 28,991,029,248
DENSE_30B = L * (ATTENTION + ROUTER) + 2 * V * H  # attention, routers, embedding and output layer


def _shape():
    return ModelShape.from_spec(preset_spec("qwen3-30b-a3b"))


def test_qwen3_30b_a3b_counts_match_its_model_card_and_the_hand_count():
    s = _shape()
    assert s.expert_params == EXPERTS_30B == 28_991_029_248
    assert s.params == EXPERTS_30B + DENSE_30B == 30_531_911_680  # norms excluded
    assert round(s.params / 1e9, 1) == 30.5  # the model card's total
    # a token is multiplied by its top 8 experts per layer, not 128
    active = L * (ATTENTION + ROUTER + K * EXPERT)
    assert s.active_linear_params == active == 2_730_491_904
    assert round((active + 2 * V * H) / 1e9, 1) == 3.4  # the card's "3.3B activated" (+ norms, rounding)
    assert s.matmul_params == active + V * H  # the input embedding is a lookup, the output layer a matmul
    assert s.mlp_fraction == pytest.approx(L * K * EXPERT / active)  # 0.6636


def test_experts_are_sharded_over_ep_x_etp_and_the_dense_part_over_tp():
    s, options = _shape(), TrainerOptions()
    for ep, etp, dp in [(8, 1, 16), (4, 2, 16), (1, None, 16)]:
        layout = TrainerLayout(ParallelDims(tp=2, dp=dp, ep=ep, etp=etp), 1, "none")
        parts = activations.state_parts(s, layout, options)
        held = DENSE_30B / 2 + EXPERTS_30B / (ep * (etp or 2))
        assert parts["weights"] == pytest.approx(2.0 * held)
        assert parts["grads"] == pytest.approx(4.0 * held)
        # the distributed optimizer: dense state over DP (of the TP2 shard), experts' over EDP (of
        # the EP x ETP shard); both come to the stage's 32 ranks' even share
        assert parts["optimizer"] == pytest.approx(12.0 * (DENSE_30B + EXPERTS_30B) / 32)
    # EP8 holds 8 times fewer expert bytes than EP1 (ETP = TP = 2): the experts dominate the weights
    ep1 = activations.state_parts(s, TrainerLayout(ParallelDims(tp=2, dp=16), 1, "none"), options)
    ep8 = activations.state_parts(s, TrainerLayout(ParallelDims(tp=2, dp=16, ep=8, etp=1), 1, "none"), options)
    assert ep1["weights"] - ep8["weights"] == pytest.approx(2.0 * EXPERTS_30B * (1 / 2 - 1 / 8))
    with pytest.raises(ConfigError, match="FSDP state sharding of experts"):
        activations.state_parts(
            s, TrainerLayout(ParallelDims(tp=2, dp=16, ep=8, etp=1), 1, "none"), TrainerOptions(state_sharding="fsdp")
        )


def test_moe_activations_count_the_dispatched_tokens_of_the_top_k_experts():
    s = _shape()
    layout = TrainerLayout(ParallelDims(tp=2, dp=16, ep=8, etp=1), 1, "none")
    # per token per layer: top 8 experts, each keeping its dispatched input (h) and 3 f / etp
    assert activations.mlp_width(s, layout) == K * (H + 3 * F)
    dense = TrainerLayout(ParallelDims(tp=2, dp=16), 1, "none")
    assert activations.mlp_width(ModelShape.from_spec(preset_spec("llama3-8b")), dense) == 3 * 14336 / 2


def test_trainer_gpus_move_in_whole_expert_groups():
    layout = TrainerLayout(ParallelDims(tp=4, pp=2, dp=8, ep=32, etp=1), 1, "none")
    assert layout.m == 8 and layout.gpu_unit == 64  # each of 2 stages carves EP32 out of its ranks
    assert layout.on_gpus(512).dims.dp == 64
    with pytest.raises(ConfigError, match="trainer GPUs=496: trainer EP32 x ETP1 must divide .* multiple of 64"):
        layout.on_gpus(496)


@pytest.mark.parametrize("name,trainer_dp", [("qwen3_30b_a3b.yaml", 16), ("qwen3_235b_a22b.yaml", 64)])
def test_moe_configs_plan_fit_and_state_their_assumptions(name, trainer_dp):
    # the weight sync's time is estimated, not predicted: its 1024-rank plan for 235B takes minutes
    cfg = load_config(str(ROOT / "configs" / name), ["plan.weight_sync=estimate"])
    plan = plan_config(cfg, name)
    assert plan.configured.fits and plan.configured.trainer.dims.ep == cfg.trainer.ep
    # the balanced split moves the trainer in whole EP groups (the 235B config once failed here)
    assert plan.balanced is not None and plan.balanced.trainer.dims.dp == trainer_dp
    notes = "\n".join(plan.notes)
    assert "FLOPs are priced from the active ones" in notes and "all-to-all time is not priced" in notes


def test_30b_dry_run_sends_every_expert_element_once_to_each_generator_rank():
    cfg = load_config(str(ROOT / "configs" / "qwen3_30b_a3b.yaml"))
    report = dry_run(cfg, "configs/qwen3_30b_a3b.yaml")
    spec, trainer_ranks = preset_spec("qwen3-30b-a3b"), cfg.trainer_dims().world_size
    received = defaultdict(int)
    for (src, dst), transfers in report.sync_plan.transfers.items():
        assert src < trainer_ranks <= dst
        received[dst] += sum(t.numel for t in transfers)
    shard = [sum(t.covered_numel for t in sglang_rank_layout(spec, 8, tp_rank)) for tp_rank in range(8)]
    assert all(received[trainer_ranks + r * 8 + tp] == shard[tp] for r in range(4) for tp in range(8))
    # one replica holds the whole model once, plus SGLang's replicas at TP8: norms (2 per layer + the
    # final one of h, q/k norms of 128 per layer) and routers on every rank, each of the 4 KV heads on 2
    norms = (2 * L + 1) * H + 2 * L * 128
    replicated = 8 * norms + 7 * L * ROUTER + L * 2 * 4 * 128 * H
    assert sum(shard) == EXPERTS_30B + DENSE_30B + replicated == 30_722_342_912


def test_sequences_in_flight_follow_the_runs_max_lag():
    """The balanced split's b_g is capped by rollout.max_lag (not a separate planner default): at lag 1
    a 2048-sample batch over 64 replicas puts 32 in flight on each; at lag 4 the KV pool is the cap."""
    path = str(ROOT / "configs" / "qwen3_235b_a22b.yaml")
    lag1 = plan_config(load_config(path, ["plan.weight_sync=estimate"]), "235b")
    lag4 = plan_config(load_config(path, ["plan.weight_sync=estimate", "rollout.max_lag=4"]), "235b")
    assert lag1.balanced.sequences == 2048 // 64
    assert 2048 // 64 < lag4.balanced.sequences <= 4 * 2048 // 64
    assert lag4.balanced.generate_seconds < lag1.balanced.generate_seconds / 2
    pinned = plan_config(
        load_config(path, ["plan.weight_sync=estimate", "rollout.max_lag=4", "plan.max_lag_steps=1"]), "235b"
    )
    assert pinned.balanced.sequences == 2048 // 64  # plan.max_lag_steps still overrides
