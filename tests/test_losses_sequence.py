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

from megarl.config import load_config
from megarl.errors import ConfigError
from megarl.rollout import Sample
from megarl.trainer.aggregation import overlong_penalty, resolve_agg
from megarl.trainer.hooks import LossConfig, aggregate, per_token_loss
from megarl.trainer.losses import LossInputs, bind_loss_params, resolve_loss
from megarl.trainer.packing import plan_micro_batches
from megarl.trainer.policy_trainer import shape_batch
from megarl.trainer.stats import metrics_from_totals, micro_batch_stats, stat_fields

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


def tokens():
    """(sample, log pi, log mu, A, entropy) per token, in batch order."""
    return [(i, lp, mu, s[2], h) for i, s in enumerate(SAMPLES) for lp, mu, h in zip(s[0], s[1], ENTROPY[i])]


def run_hook(loss, params=None, agg=None, entropy_coef=0.0, split=SPLITS[0]):
    """(step loss, d/d log pi, d/d entropy, clipped, masked) through the hook's path, split as given."""
    fn = resolve_loss(loss)
    cfg = LossConfig(
        name=loss,
        params=bind_loss_params(loss, params or {}),
        agg=resolve_agg(fn, agg),
        entropy_coef=entropy_coef,
        max_new_tokens=M,
    )
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
        out, per_token, _ = per_token_loss(fn, cfg, x)
        total = total + aggregate(cfg.agg, x, per_token, M)
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


# -- the objectives, written from their definitions ---------------------------------------------


def coefficient(agg, i):
    """c_i: the step's loss is sum_t c_{i(t)} l_t."""
    n_i = len(SAMPLES[i][0])
    return {
        "token_mean": 1 / N,
        "seq_mean_token_mean": 1 / (S * n_i),
        "seq_mean_token_sum": 1 / S,
        "seq_mean_token_sum_norm": 1 / (S * M),
    }[agg]


def seq_log_ratio(i):
    lp, mu = SAMPLES[i][0], SAMPLES[i][1]
    return sum(a - b for a, b in zip(lp, mu)) / len(lp)


def keep(i, lp, mu, c, level):
    if c is None:
        return True
    log_r = seq_log_ratio(i) if level == "sequence" else lp - mu
    return abs(log_r) <= math.log(c)


def aipo_ref(agg, rho=4.0, is_level="token", mask_c=None, mask_level="token"):
    value, grad = 0.0, []
    for i, lp, mu, a, _ in tokens():
        w = min(math.exp(seq_log_ratio(i) if is_level == "sequence" else lp - mu), rho)
        k = keep(i, lp, mu, mask_c, mask_level)
        value += coefficient(agg, i) * (-w * a * lp) * k
        grad.append(coefficient(agg, i) * -w * a * k)  # the weight carries no gradient
    return value, grad


def ppo_ref(agg, eps=0.2, eps_high=None, mask_c=None, mask_level="token"):
    eps_high = eps if eps_high is None else eps_high
    value, grad = 0.0, []
    for i, lp, mu, a, _ in tokens():
        r = math.exp(lp - mu)
        clip_r = min(max(r, 1 - eps), 1 + eps_high)
        k = keep(i, lp, mu, mask_c, mask_level)
        value += coefficient(agg, i) * -min(r * a, clip_r * a) * k
        # d(-r A)/d log pi = -r A where the unclipped term is the minimum; the clipped one is constant
        grad.append(coefficient(agg, i) * (-r * a if r * a <= clip_r * a else 0.0) * k)
    return value, grad


def gspo_ref(agg, eps=3e-4, eps_high=4e-4):
    value, grad = 0.0, []
    for i, _lp, _mu, a, _ in tokens():
        s = math.exp(seq_log_ratio(i))
        n_i = len(SAMPLES[i][0])
        clip_s = min(max(s, 1 - eps), 1 + eps_high)
        value += coefficient(agg, i) * -min(s * a, clip_s * a)
        # every token of sample i carries l_i; d s_i / d log pi_t = s_i / n_i for each of its n_i tokens
        grad.append(n_i * coefficient(agg, i) * (-a * s / n_i if s * a <= clip_s * a else 0.0))
    return value, grad


def gmpo_ref(agg, eps_low=0.4, eps_high=0.4):
    value, grad = 0.0, []
    for i, lp, mu, a, _ in tokens():
        n_i = len(SAMPLES[i][0])
        # clipped log-ratio: for A > 0 min(log r, clip), for A < 0 max(log r, clip)
        logs = [(x - y, min(max(x - y, -eps_low), eps_high)) for x, y in zip(SAMPLES[i][0], SAMPLES[i][1])]
        chosen = [min(r, c) if a > 0 else max(r, c) for r, c in logs]
        g = math.exp(sum(chosen) / n_i)
        value += coefficient(agg, i) * -a * g
        # the token's own log r is chosen (so has a gradient) unless capped on the side that helps
        live = lp - mu <= eps_high if a > 0 else lp - mu >= -eps_low
        grad.append(n_i * coefficient(agg, i) * (-a * g / n_i if live else 0.0))
    return value, grad


def entropy_bonus_ref(agg, coef):
    value = sum(coefficient(agg, i) * -coef * h for i, _, _, _, h in tokens())
    return value, [coefficient(agg, i) * -coef for i, _, _, _, _ in tokens()]


def reinforce_ref(agg):
    return (
        sum(coefficient(agg, i) * -a * lp for i, lp, _, a, _ in tokens()),
        [coefficient(agg, i) * -a for i, _, _, a, _ in tokens()],
    )


CASES = [  # (id, loss, params, loss_agg (None: the loss's own), entropy_coef, reference, expected clip / mask)
    ("aipo", "aipo", {}, None, 0.0, aipo_ref("token_mean"), [2], []),
    (
        "aipo-seq-tis",
        "aipo",
        {"rho": 2.0, "is_level": "sequence"},
        "seq_mean_token_sum",
        0.0,
        aipo_ref("seq_mean_token_sum", rho=2.0, is_level="sequence"),
        [0, 1, 2],
        [],
    ),
    ("aipo-token-mis", "aipo", {"mask_c": 1.5}, "token_mean", 0.0, aipo_ref("token_mean", mask_c=1.5), [], [0, 2, 7]),
    (
        "aipo-seq-mis",
        "aipo",
        {"mask_c": 1.5, "mask_level": "sequence"},
        "seq_mean_token_mean",
        0.0,
        aipo_ref("seq_mean_token_mean", mask_c=1.5, mask_level="sequence"),
        [],
        [0, 1, 2],
    ),
    ("ppo", "ppo_clip", {}, "seq_mean_token_mean", 0.0, ppo_ref("seq_mean_token_mean"), [0, 2], []),
    (
        "ppo-seq-mis",
        "ppo_clip",
        {"eps_high": 0.28, "mask_c": 1.5, "mask_level": "sequence"},
        "token_mean",
        0.0,
        ppo_ref("token_mean", eps_high=0.28, mask_c=1.5, mask_level="sequence"),
        [],
        [0, 1, 2],
    ),
    ("dr_grpo", "dr_grpo", {}, None, 0.0, ppo_ref("seq_mean_token_sum_norm"), [0, 2], []),
    ("gspo", "gspo", {}, None, 0.0, gspo_ref("seq_mean_token_mean"), [0, 1, 2], []),
    (
        "gspo-token-mean",
        "gspo",
        {"eps": 0.1, "eps_high": 0.2},
        "token_mean",
        0.0,
        gspo_ref("token_mean", eps=0.1, eps_high=0.2),
        [0, 1, 2],
        [],
    ),
    (
        "gmpo-user",
        "examples.losses.gmpo:gmpo",
        {"eps_low": 0.3},
        None,
        0.0,
        gmpo_ref("seq_mean_token_mean", eps_low=0.3),
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


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
def test_entropy_bonus_reaches_value_and_gradient(agg):
    value, grad_logp, grad_h, _, _ = run_hook("reinforce", {}, agg, 0.25, SPLITS[1])
    (pg_value, pg_grad), (h_value, h_grad) = reinforce_ref(agg), entropy_bonus_ref(agg, 0.25)
    assert value == pytest.approx(pg_value + h_value, rel=1e-10)
    assert grad_logp == pytest.approx(pg_grad, rel=1e-10) and grad_h == pytest.approx(h_grad, rel=1e-10)


def test_the_modes_differ_on_this_batch():
    # a mode silently replaced by another would still pass the cases above only if they coincide here
    values = [
        reinforce_ref(a)[0]
        for a in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
    ]
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
    kept, adv, info = shape_batch(samples, LossConfig(overlong="mask", max_new_tokens=3))
    assert kept == samples[1:] and info["overlong_masked"] == 1 and info["truncated_frac"] == pytest.approx(1 / 3)
    assert adv == pytest.approx([-0.75, 0.0])  # sample 0's reward still in group 0's baseline
    # penalty, max 4 buffer 2: lengths 3 -> -0.5, 2 -> 0, 4 -> -1
    kept, adv, info = shape_batch(samples, LossConfig(overlong="penalty", max_new_tokens=4, overlong_buffer=2))
    assert kept == samples and info["overlong_penalty_mean"] == pytest.approx(-0.5)
    assert adv == pytest.approx([0.5 - 0.0, -0.5 - 0.0, 0.0])  # group 0: 0.5 vs -0.5; group 1 alone
    kept, adv, info = shape_batch(samples, LossConfig())
    assert adv == pytest.approx([0.75, -0.75, 0.0]) and info["overlong_masked"] == 0


# -- mismatch statistics ----------------------------------------------------------------------------


def test_lag_buckets_separate_staleness_from_numerics():
    max_lag = 2
    fn = resolve_loss("aipo")
    x = LossInputs(
        torch.tensor([t[1] for t in tokens()], dtype=torch.float64),
        torch.tensor([t[2] for t in tokens()], dtype=torch.float64),
        torch.tensor([t[3] for t in tokens()], dtype=torch.float64),
        entropy=torch.tensor([t[4] for t in tokens()], dtype=torch.float64),
        sample_index=torch.tensor([t[0] for t in tokens()]),
        response_lengths=torch.tensor([3, 2, 4]),
        lags=torch.tensor([VERSION - v for s in SAMPLES for v in s[4]]),
    )
    out = fn(x, rho=4.0, mask_c=1.5)
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
        (["trainer.loss_agg=seq_mean"], r"trainer.loss_agg: 'seq_mean' is not one of"),
        (
            ["trainer.loss=dr_grpo", "trainer.normalize_advantage_std=true"],
            "trainer.normalize_advantage_std: .*Dr.GRPO",
        ),
        (["trainer.loss=dr_grpo", "trainer.loss_agg=token_mean"], "defined by its aggregation"),
        (["trainer.loss=gspo", "trainer.loss_params={rho: 2}"], r"loss_params.rho: loss 'gspo' has no such parameter"),
        (["trainer.loss_params={mask_level: sequence}"], "mask_level: used only with trainer.loss_params.mask_c"),
        (["trainer.loss_params={mask_c: 0.9}"], r"mask_c: the band is \[1/c, c\], must be > 1"),
        (["trainer.loss_params={is_level: seq}"], "is_level: 'seq' is not one of"),
        (["trainer.entropy_coef=-0.1"], "trainer.entropy_coef: an entropy bonus, must be >= 0"),
        (["trainer.overlong=cut"], "trainer.overlong: 'cut' is not one of"),
        (
            ["trainer.overlong=penalty"],
            r"trainer.overlong_buffer: .*must be in \[1, rollout.max_new_tokens=16\], got 0",
        ),
        (["trainer.overlong=penalty", "trainer.overlong_buffer=17"], "overlong_buffer: .*got 17"),
        (["trainer.overlong_buffer=4"], "trainer.overlong_buffer: used only with trainer.overlong=penalty"),
        (["trainer.loss=examples.losses.gmpo:gmpo", "trainer.loss_params={eps_low: -1}"], "eps_low must be > 0"),
    ],
)
def test_bad_loss_settings_are_refused_when_the_config_loads(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, overrides)


def test_loss_settings_reach_the_loss_config():
    from megarl.executors.trainer import loss_config

    cfg = load_config(
        TINY,
        [
            "trainer.loss=gspo",
            "trainer.entropy_coef=0.01",
            "trainer.overlong=penalty",
            "trainer.overlong_buffer=4",
            "rollout.max_lag=3",
        ],
    )
    loss = loss_config(cfg)
    assert (loss.agg, loss.entropy_coef, loss.overlong, loss.overlong_buffer, loss.max_new_tokens, loss.max_lag) == (
        None,
        0.01,
        "penalty",
        4,
        16,
        3,
    )
    assert resolve_agg(resolve_loss(loss.name), loss.agg) == "seq_mean_token_mean"
    assert loss_config(load_config(TINY, ["run.mode=sync"])).max_lag == 0
    assert loss_config(load_config(TINY, ["trainer.loss=gspo", "trainer.loss_agg=token_mean"])).agg == "token_mean"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_an_empty_micro_batch_contributes_nothing(case):
    # a DP rank with fewer bins than the others gets empty rows: every loss must give 0, not fail
    _, loss, params, agg, coef, _, _, _ = case
    fn = resolve_loss(loss)
    cfg = LossConfig(name=loss, params=bind_loss_params(loss, params), agg=resolve_agg(fn, agg), max_new_tokens=M)
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
    out, per_token, kl = per_token_loss(fn, cfg, x)
    assert aggregate(cfg.agg, x, per_token, M).item() == 0.0
    stats = micro_batch_stats(x, out, torch.tensor(0.0), kl, 2)
    assert stats.abs().sum().item() == 0.0 and len(stats) == len(stat_fields(2))
