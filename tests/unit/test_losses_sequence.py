"""Sample-aware losses and aggregation modes on a hand-built batch, in float64.

Three samples (response lengths 3, 2, 4) whose ratios exercise every branch:
token ratios above rho and outside the mask band, a sequence above the band,
both PPO clip sides, one GSPO-clipped sequence. Each case runs the loss hook's
own path (the loss, the KL/entropy terms, the aggregation weights) over the
batch split into 1, 2 and 3 micro-batches, sums (loss_sum) / N as Megatron
does, and compares the value and the gradients with respect to log pi and the
entropy with the objective written out by hand from its definition: 1e-10.
"""

import math

import pytest
import torch

from megarl.config import RolloutConfig, TrainerConfig, load_config
from megarl.errors import ConfigError
from megarl.rollout import Sample
from megarl.train import check_loss
from megarl.trainer.aggregation import overlong_penalty
from megarl.trainer.bound_loss import bind_loss
from megarl.trainer.hooks import aggregate, per_token_loss
from megarl.trainer.losses import LossInputs, aipo
from megarl.trainer.packing import plan_micro_batches
from megarl.trainer.policy_trainer import shape_batch
from megarl.trainer.stats import metrics_from_totals, micro_batch_stats, stat_fields
from tests.loss_references import AGG_MODES, RefSample, objective

TINY = "configs/tiny_cpu.yaml"
VERSION = 5
SAMPLES = [  # log pi, log mu, advantage, group, token versions
    ([-0.5, -1.2, -2.0], [-1.0, -1.0, -4.0], 1.0, 0, [5, 5, 4]),  # log r 0.5, -0.2, 2.0: mean 0.767
    ([-0.3, -0.9], [-0.25, -1.0], -0.5, 0, [3, 3]),  # log r -0.05, 0.1: mean 0.025
    ([-1.0, -0.7, -2.2, -0.4], [-1.1, -0.6, -1.0, -0.5], 0.8, 1, [5, 4, 4, 4]),  # 0.1, -0.1, -1.2, 0.1: -0.275
]
ENTROPY = [[1.5, 0.7, 2.2], [0.3, 1.1], [0.9, 1.8, 0.4, 2.6]]
SPLITS = [[[0, 1, 2]], [[0, 1], [2]], [[0], [1], [2]]]
S, N, M = 3, 9, 8  # sequences, response tokens, max_new_tokens (Dr.GRPO's constant)
BATCH = [RefSample(lp, mu, a, h) for (lp, mu, a, _, _), h in zip(SAMPLES, ENTROPY)]


def tokens():
    """(sample, log pi, log mu, A, entropy) per token, in batch order."""
    return [(i, lp, mu, s[2], h) for i, s in enumerate(SAMPLES) for lp, mu, h in zip(s[0], s[1], ENTROPY[i])]


def bound(loss="aipo", params=None, agg=None, **trainer):
    return bind_loss(
        TrainerConfig(loss=loss, loss_params=params or {}, loss_agg=agg, **trainer),
        RolloutConfig(max_new_tokens=M),
        lag_bound=0,
    )


def run_hook(loss, params=None, agg=None, entropy_coef=0.0, split=SPLITS[0]):
    """(step loss, d/d log pi, d/d entropy, clipped, masked) through the hook's path, split as given."""
    bound_loss = bound(loss, params, agg, entropy_coef=entropy_coef)
    logp = torch.tensor([lp for s in SAMPLES for lp in s[0]], dtype=torch.float64, requires_grad=True)
    entropy = torch.tensor([h for e in ENTROPY for h in e], dtype=torch.float64, requires_grad=True)
    offsets = [0, 3, 5, 9]
    total, clipped, masked = 0.0, {}, {}
    for mb in split:
        pos = [t for i in mb for t in range(offsets[i], offsets[i + 1])]
        x = LossInputs(
            logp[pos],
            torch.tensor([m for i in mb for m in SAMPLES[i][1]], dtype=torch.float64),
            torch.tensor([SAMPLES[i][2] for i in mb for _ in SAMPLES[i][0]], dtype=torch.float64),
            entropy=entropy[pos],
            sample_index=torch.tensor([k for k, i in enumerate(mb) for _ in SAMPLES[i][0]]),
            response_lengths=torch.tensor([len(SAMPLES[i][0]) for i in mb]),
            group_ids=torch.tensor([0] * len(mb)),
            step_sequences=S,
            step_tokens=N,
        )
        out, per_token, _ = per_token_loss(bound_loss, x)
        total = total + aggregate(bound_loss.agg, x, per_token, M)
        flags = [False] * len(pos)
        for p, c, m in zip(
            pos,
            flags if out.clipped is None else out.clipped.tolist(),
            flags if out.masked is None else out.masked.tolist(),
        ):
            clipped[p], masked[p] = c, bool(m)
    (total / N).backward()
    grad_h = entropy.grad.tolist() if entropy.grad is not None else [0.0] * N  # None: unused by the loss
    return (total / N).item(), logp.grad.tolist(), grad_h, [clipped[p] for p in range(N)], [masked[p] for p in range(N)]


# -- the objectives, written from their definitions (tests/loss_references.py) ---------------------


def ref(loss, agg, params=None, entropy_coef=0.0):
    """(value, d/d log pi per token) of the definition over BATCH."""
    r = objective(loss, params or {}, agg, BATCH, M, entropy_coef=entropy_coef)
    return r.value, [g for per_sample in r.grad_logp for g in per_sample]


CASES = [  # (id, loss, params, loss_agg (None: the loss's own), entropy_coef, reference, expected clip / mask)
    ("aipo", "aipo", {}, None, 0.0, ref("aipo", "token_mean"), [2], []),
    (
        "aipo-seq-tis",
        "aipo",
        {"rho": 2.0, "is_level": "sequence"},
        "seq_mean_token_sum",
        0.0,
        ref("aipo", "seq_mean_token_sum", {"rho": 2.0, "is_level": "sequence"}),
        [0, 1, 2],
        [],
    ),
    (
        "aipo-token-mis",
        "aipo",
        {"mask_c": 1.5},
        "token_mean",
        0.0,
        ref("aipo", "token_mean", {"mask_c": 1.5}),
        [],
        [0, 2, 7],
    ),
    (
        "aipo-seq-mis",
        "aipo",
        {"mask_c": 1.5, "mask_level": "sequence"},
        "seq_mean_token_mean",
        0.0,
        ref("aipo", "seq_mean_token_mean", {"mask_c": 1.5, "mask_level": "sequence"}),
        [],
        [0, 1, 2],
    ),
    ("ppo", "ppo_clip", {}, "seq_mean_token_mean", 0.0, ref("ppo_clip", "seq_mean_token_mean"), [0, 2], []),
    (
        "ppo-seq-mis",
        "ppo_clip",
        {"eps_high": 0.28, "mask_c": 1.5, "mask_level": "sequence"},
        "token_mean",
        0.0,
        ref("ppo_clip", "token_mean", {"eps_high": 0.28, "mask_c": 1.5, "mask_level": "sequence"}),
        [],
        [0, 1, 2],
    ),
    ("dr_grpo", "dr_grpo", {}, None, 0.0, ref("ppo_clip", "seq_mean_token_sum_norm"), [0, 2], []),
    ("gspo", "gspo", {}, None, 0.0, ref("gspo", "seq_mean_token_mean"), [0, 1, 2], []),
    (
        "gspo-token-mean",
        "gspo",
        {"eps": 0.1, "eps_high": 0.2},
        "token_mean",
        0.0,
        ref("gspo", "token_mean", {"eps": 0.1, "eps_high": 0.2}),
        [0, 1, 2],
        [],
    ),
    (
        "gmpo-user",
        "examples.losses.gmpo:gmpo",
        {"eps_low": 0.3},
        None,
        0.0,
        ref("examples.losses.gmpo:gmpo", "seq_mean_token_mean", {"eps_low": 0.3}),
        [0, 2],
        [],
    ),
]


@pytest.mark.parametrize("split", SPLITS, ids=["1mb", "2mb", "3mb"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_loss_and_aggregation_against_the_definition(case, split):
    _, loss, params, agg, coef, (ref_value, ref_grad), clipped, masked = case
    value, grad, _, got_clipped, got_masked = run_hook(loss, params, agg, coef, split)
    assert value == pytest.approx(ref_value, rel=1e-10, abs=1e-12)
    assert grad == pytest.approx(ref_grad, rel=1e-10, abs=1e-12)
    assert [t for t, c in enumerate(got_clipped) if c] == clipped
    assert [t for t, m in enumerate(got_masked) if m] == masked


@pytest.mark.parametrize("agg", AGG_MODES)
def test_entropy_bonus_reaches_value_and_gradient(agg):
    value, grad_logp, grad_h, _, _ = run_hook("reinforce", {}, agg, 0.25, SPLITS[1])
    r = objective("reinforce", {}, agg, BATCH, M, entropy_coef=0.25)
    assert value == pytest.approx(r.value, rel=1e-10)
    assert grad_logp == pytest.approx([g for x in r.grad_logp for g in x], rel=1e-10)
    assert grad_h == pytest.approx([g for x in r.grad_entropy for g in x], rel=1e-10)
    assert grad_h != pytest.approx([0.0] * N)  # the bonus has a gradient of its own


def test_the_modes_differ_on_this_batch():
    # a mode silently replaced by another would still pass the cases above only if they coincide here
    values = [objective("reinforce", {}, a, BATCH, M).value for a in AGG_MODES]
    assert min(abs(x - y) for i, x in enumerate(values) for y in values[i + 1 :]) > 1e-3


# -- packing: what the loss sees ------------------------------------------------------------------


def batch_samples(finish=("stop", "stop", "stop")):
    out = []
    for (lp, mu, a, g, ver), f in zip(SAMPLES, finish):
        out.append(Sample([7] * (4 + g), [11] * len(lp), mu, ver, reward=a, group_id=g, finish_reason=f))
    return out


@pytest.mark.parametrize("dp, budget", [(1, 64), (1, 8), (2, 8), (3, 8)])
def test_packing_carries_samples_lags_and_step_totals(dp, budget):
    samples = batch_samples()
    adv = [s.reward for s in samples]
    seen = []
    for rank in range(dp):
        plan = plan_micro_batches(samples, adv, rank, dp, budget, False, False, version=VERSION)
        for mb in plan.micro_batches:
            on = mb.loss_mask[0] > 0
            assert (mb.step_sequences, mb.step_tokens) == (S, N)
            ids = mb.sample_ids[0][on].tolist()
            for k, i in enumerate(mb.sample_indices):  # each sample whole, contiguous, in this micro-batch
                assert ids.count(k) == len(SAMPLES[i][0]) == mb.response_lengths[k].item()
                assert mb.group_ids[k].item() == SAMPLES[i][3]
            lags = mb.lags[0][on].tolist()
            assert lags == [VERSION - v for i in mb.sample_indices for v in SAMPLES[i][4]]
            seen += mb.sample_indices
    assert sorted(seen) == [0, 1, 2]


# -- overlong --------------------------------------------------------------------------------------


def test_overlong_penalty_is_dapos():
    # max 16, buffer 4: nothing up to 12, then -1/4 per token down to -1 at 16
    assert [overlong_penalty(n, 16, 4) for n in (5, 12, 13, 14, 16, 17)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]


def test_overlong_mask_and_penalty_shape_the_batch():
    samples = batch_samples(finish=("length", "stop", "stop"))  # lengths 3, 2, 4; rewards 1.0, -0.5, 0.8
    kept, adv, info = shape_batch(
        samples, bind_loss(TrainerConfig(overlong="mask"), RolloutConfig(max_new_tokens=3), lag_bound=0)
    )
    assert kept == samples[1:] and info["overlong_masked"] == 1 and info["truncated_frac"] == pytest.approx(1 / 3)
    assert adv == pytest.approx([-0.75, 0.0])  # sample 0's reward still in group 0's baseline
    # penalty, max 4 buffer 2: lengths 3 -> -0.5, 2 -> 0, 4 -> -1
    penalty = bind_loss(TrainerConfig(overlong="penalty", overlong_buffer=2), RolloutConfig(max_new_tokens=4), 0)
    kept, adv, info = shape_batch(samples, penalty)
    assert kept == samples and info["overlong_penalty_mean"] == pytest.approx(-0.5)
    assert adv == pytest.approx([0.5 - 0.0, -0.5 - 0.0, 0.0])  # group 0: 0.5 vs -0.5; group 1 alone
    kept, adv, info = shape_batch(samples, bound())
    assert adv == pytest.approx([0.75, -0.75, 0.0]) and info["overlong_masked"] == 0


# -- mismatch statistics ----------------------------------------------------------------------------


def test_lag_buckets_separate_staleness_from_numerics():
    max_lag = 2
    x = LossInputs(
        torch.tensor([t[1] for t in tokens()], dtype=torch.float64),
        torch.tensor([t[2] for t in tokens()], dtype=torch.float64),
        torch.tensor([t[3] for t in tokens()], dtype=torch.float64),
        entropy=torch.tensor([t[4] for t in tokens()], dtype=torch.float64),
        sample_index=torch.tensor([t[0] for t in tokens()]),
        response_lengths=torch.tensor([3, 2, 4]),
        lags=torch.tensor([VERSION - v for s in SAMPLES for v in s[4]]),
    )
    out = aipo(x, rho=4.0, mask_c=1.5)
    stats = micro_batch_stats(x, out, torch.tensor(0.0), torch.zeros(N), max_lag)
    m = metrics_from_totals(stats, max_lag)
    assert len(stats) == len(stat_fields(max_lag))
    buckets = {0: [], 1: [], 2: []}
    for (_i, lp, mu, _, _), s_ver in zip(tokens(), [v for s in SAMPLES for v in s[4]]):
        buckets[VERSION - s_ver].append(math.exp(lp - mu))
    for b, ratios in buckets.items():
        assert m[f"tokens_lag{b}"] == len(ratios)
        kl = sum(r - 1 - math.log(r) for r in ratios) / len(ratios)
        mean = sum(ratios) / len(ratios)
        std = math.sqrt(sum((r - mean) ** 2 for r in ratios) / len(ratios))
        assert m[f"kl_mu_pi_lag{b}"] == pytest.approx(kl, rel=1e-12)
        assert m[f"ratio_mean_lag{b}"] == pytest.approx(mean, rel=1e-12)
        assert m[f"ratio_std_lag{b}"] == pytest.approx(std, rel=1e-9)
    # token mask: tokens 0, 2 (sample 0) and 7 (sample 2); no clipped token is left unmasked
    assert m["mask_frac"] == pytest.approx(3 / N) and m["mask_seq_frac"] == pytest.approx(2 / 3)
    assert m["clip_frac"] == 0.0 and m["clip_seq_frac"] == 0.0
    ratios = [math.exp(lp - mu) for _, lp, mu, _, _ in tokens()]
    assert m["ess"] == pytest.approx(sum(ratios) ** 2 / (N * sum(r * r for r in ratios)), rel=1e-12)


# -- configuration ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.entropy_coef=-0.1"], "trainer.entropy_coef: an entropy bonus, must be >= 0"),
        (["trainer.overlong=cut"], "trainer.overlong: 'cut' is not one of"),
        (
            ["trainer.overlong=penalty"],
            r"trainer.overlong_buffer: .*must be in \[1, rollout.max_new_tokens=16\], got 0",
        ),
        (["trainer.overlong=penalty", "trainer.overlong_buffer=17"], "overlong_buffer: .*got 17"),
        (["trainer.overlong_buffer=4"], "trainer.overlong_buffer: used only with trainer.overlong=penalty"),
    ],
)
def test_bad_loss_field_values_are_refused_when_the_config_loads(overrides, message):
    # ranges and choices that need no loss: the config itself refuses them
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, overrides)


LOSS_REFUSALS = [
    (["trainer.loss_agg=seq_mean"], r"trainer.loss_agg: 'seq_mean' is not one of"),
    (
        ["trainer.loss=dr_grpo", "trainer.normalize_advantage_std=true"],
        "trainer.normalize_advantage_std: .*Dr.GRPO",
    ),
    (["trainer.loss=dr_grpo", "trainer.loss_agg=token_mean"], "trainer.loss_agg: .*defined by its aggregation"),
    (["trainer.loss=gspo", "trainer.loss_params={rho: 2}"], r"loss_params.rho: loss 'gspo' has no such parameter"),
    (["trainer.loss_params={mask_level: sequence}"], "mask_level: used only with trainer.loss_params.mask_c"),
    (["trainer.loss_params={mask_c: 0.9}"], r"mask_c: the band is \[1/c, c\], must be > 1"),
    (["trainer.loss_params={is_level: seq}"], "is_level: 'seq' is not one of"),
    (["trainer.loss=examples.losses.gmpo:gmpo", "trainer.loss_params={eps_low: -1}"], "eps_low must be > 0"),
    (["trainer.loss=examples.losses.gmpo:nope"], "trainer.loss: module 'examples.losses.gmpo' has no attribute 'nope'"),
]


@pytest.mark.parametrize("overrides, message", LOSS_REFUSALS)
def test_bad_loss_settings_are_refused_before_any_rank_starts(overrides, message):
    # a setting that needs the loss looked up: `megarl train` binds the loss before it launches a rank
    cfg = load_config(TINY, overrides)  # the config alone does not look the loss up
    with pytest.raises(ConfigError, match=f"{TINY}: .*{message}"):
        check_loss(cfg, TINY)


def test_megarl_train_binds_the_loss_before_it_prepares_the_run(tmp_path):
    from megarl.train import train

    # prepare_only: without the check this would prepare the (random) model and return
    with pytest.raises(ConfigError, match="trainer.loss: 'grpo_v9' is unknown"):
        train(TINY, ["trainer.loss=grpo_v9", f"run.output_dir={tmp_path}"], prepare_only=True)


def test_loss_settings_reach_the_bound_loss():
    cfg = load_config(
        TINY,
        [
            "trainer.loss=gspo",
            "trainer.entropy_coef=0.01",
            "trainer.overlong=penalty",
            "trainer.overlong_buffer=4",
            "trainer.kl_coef=0.5",
            "trainer.kl_estimator=k2",
            "trainer.advantage_estimator=rloo",
            "rollout.temperature=0.7",
        ],
    )
    loss = bind_loss(cfg.trainer, cfg.rollout, lag_bound=3)
    assert (loss.name, loss.agg, dict(loss.params)) == ("gspo", "seq_mean_token_mean", {"eps": 3e-4, "eps_high": 4e-4})
    assert (loss.entropy_coef, loss.overlong, loss.overlong_buffer, loss.max_new_tokens, loss.lag_bound) == (
        0.01,
        "penalty",
        4,
        16,
        3,
    )
    assert (loss.kl_coef, loss.kl_estimator, loss.advantage_estimator, loss.temperature) == (0.5, "k2", "rloo", 0.7)
    assert bind_loss(cfg.trainer, cfg.rollout, lag_bound=3).fn is loss.fn
    assert bound("gspo", agg="token_mean").agg == "token_mean"
    with pytest.raises(TypeError):  # bound once: its parameters are read-only
        loss.params["eps"] = 0.5


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_an_empty_micro_batch_contributes_nothing(case):
    # a DP rank with fewer bins than the others gets empty rows: every loss must give 0, not fail
    _, loss, params, agg, coef, _, _, _ = case
    bound_loss = bound(loss, params, agg)
    empty = torch.zeros(0, dtype=torch.float64)
    none = torch.zeros(0, dtype=torch.long)
    x = LossInputs(
        empty.clone().requires_grad_(),
        empty,
        empty,
        entropy=empty,
        sample_index=none,
        response_lengths=none,
        group_ids=none,
        lags=none,
        step_sequences=S,
        step_tokens=N,
    )
    out, per_token, kl = per_token_loss(bound_loss, x)
    assert aggregate(bound_loss.agg, x, per_token, M).item() == 0.0
    stats = micro_batch_stats(x, out, torch.tensor(0.0), kl, 2)
    assert stats.abs().sum().item() == 0.0 and len(stats) == len(stat_fields(2))
