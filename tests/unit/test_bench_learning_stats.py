"""`megarl bench learning`'s statistics against independent references: the bootstrap intervals
against the exact bootstrap distribution (every resample enumerated), the per-run numbers by hand."""

import itertools
import math

import pytest

from megarl.bench import learning
from megarl.bench.learning import VariantResult, bootstrap_diff_ci, bootstrap_mean_ci, final_reward


def _exact_percentiles(values, q=(2.5, 97.5)):
    """Percentiles of the exact bootstrap distribution of the mean: all n^n resamples, equally likely."""
    means = sorted(sum(c) / len(c) for c in itertools.product(values, repeat=len(values)))

    def pct(p):  # numpy's default (linear) percentile of the sorted list
        pos = p / 100 * (len(means) - 1)
        lo = math.floor(pos)
        return means[lo] + (means[min(lo + 1, len(means) - 1)] - means[lo]) * (pos - lo)

    return tuple(pct(p) for p in q)


def test_bootstrap_mean_interval_matches_the_exact_bootstrap_distribution():
    values = [0.1, 0.4, 0.45, 0.9, 0.2]  # 3,125 resamples enumerated
    lo, hi = bootstrap_mean_ci(values, resamples=40_000)
    # the exact distribution is discrete (jumps of 0.01 near its tails): at 40k resamples each end lies
    # between the exact 2nd and 3rd (97th and 98th) percentiles; the interval is ~0.47 wide
    p2, p3, p97, p98 = _exact_percentiles(values, q=(2.0, 3.0, 97.0, 98.0))
    assert p2 <= lo <= p3 and p97 <= hi <= p98
    assert hi - lo > 0.4  # and it is an interval, not a point


def test_bootstrap_difference_interval_matches_the_exact_distribution_of_the_difference():
    a, b = [0.8, 0.9, 0.6, 0.7], [0.3, 0.5, 0.4, 0.1]
    diffs = sorted(
        sum(x) / 4 - sum(y) / 4 for x in itertools.product(a, repeat=4) for y in itertools.product(b, repeat=4)
    )
    lo, hi = bootstrap_diff_ci(a, b, resamples=40_000)
    assert lo == pytest.approx(diffs[int(0.025 * len(diffs))], abs=0.01)
    assert hi == pytest.approx(diffs[int(0.975 * len(diffs))], abs=0.01)
    assert lo > 0  # these two arms differ


def test_one_seed_gives_no_interval():
    assert bootstrap_mean_ci([0.3]) == (0.3, 0.3)


def _step(reward, samples=32, **extra):
    return {"reward_mean": reward, "samples": samples, "time_step": 0.5, **extra}


def test_final_reward_lag_distribution_and_kl_by_lag_by_hand():
    run_a = [
        _step(0.1, tokens_lag0=30, tokens_lag1=10, kl_mu_pi_lag0=0.0, kl_mu_pi_lag1=0.02, ess=1.0),
        _step(0.5, tokens_lag0=10, tokens_lag1=30, kl_mu_pi_lag0=0.0, kl_mu_pi_lag1=0.04, ess=0.9),
        _step(0.7, tokens_lag0=0, tokens_lag1=40, kl_mu_pi_lag0=float("nan"), kl_mu_pi_lag1=0.01, ess=0.8),
    ]
    run_b = [_step(0.2, tokens_lag0=40, kl_mu_pi_lag0=0.0, ess=1.0) for _ in range(3)]
    assert final_reward(run_a, 2) == pytest.approx(0.6)
    # tokens: lag 0: 30 + 10 + 0 + 120 = 160, lag 1: 80 -> 2/3, 1/3
    dist = learning.lag_distribution([run_a, run_b])
    assert dist == pytest.approx({0: 160 / 240, 1: 80 / 240})
    # lag 1: (0.02*10 + 0.04*30 + 0.01*40) / 80; lag 0: 0 (the NaN step had no lag-0 tokens)
    assert learning.kl_by_lag([run_a, run_b]) == pytest.approx({0: 0.0, 1: 1.8 / 80})
    res = VariantResult("async", [run_a, run_b], [0, 1], [10.0, 12.0])
    base = VariantResult("sync", [run_b, run_b], [0, 1], [8.0, 8.0])
    s = res.summary(2, base)
    assert s["final_rewards"] == pytest.approx([0.6, 0.2]) and s["final_reward"] == pytest.approx(0.4)
    assert s["lag_mean"] == pytest.approx(1 / 3)
    assert s["ess"] == pytest.approx((1.0 + 0.9 + 0.8 + 3.0) / 6)
    assert s["vs_sync"] == pytest.approx(0.2) and s["wall_s"] == 11.0
    assert "vs_sync" not in base.summary(2, base)


def test_the_table_has_a_row_per_variant_with_its_numbers():
    run = [_step(0.25, tokens_lag0=8, kl_mu_pi_lag0=0.0, ess=1.0, kl_mu_pi=0.0, mixed_version_frac=0.0)]
    results = {
        "sync": VariantResult("sync", [run, run], [0, 1], [5.0, 5.0]),
        "async_lag2": VariantResult("async_lag2", [[dict(r, reward_mean=0.5) for r in run]] * 2, [0, 1], [4.0, 4.0]),
    }
    text = learning.table(learning.summarize(results, 1))
    rows = [line for line in text.splitlines() if line.startswith("| sync") or line.startswith("| async")]
    assert len(rows) == 2
    assert "0.250 [0.250, 0.250] | —" in rows[0]
    assert "0.500 [0.500, 0.500] | +0.250 [+0.250, +0.250]" in rows[1]


def test_unknown_variants_and_bad_last_are_refused():
    from megarl.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown variant"):
        learning.run_grid(variants=["async_lag3"])
    with pytest.raises(ConfigError, match="--last 99 is more than the runs' 40 steps"):
        learning.run_grid(variants=["sync"], last=99)


def test_pairwise_comparisons_are_reported_only_where_both_arms_ran():
    def variant(name, rewards):
        runs = [[_step(r, tokens_lag0=8, kl_mu_pi_lag0=0.0, ess=1.0)] for r in rewards]
        return VariantResult(name, runs, list(range(len(rewards))), [1.0] * len(rewards))

    results = {
        "sync_g8": variant("sync_g8", [0.2, 0.4]),
        "async_lag8": variant("async_lag8", [0.5, 0.9]),
        "async_lag8_ppo_clip": variant("async_lag8_ppo_clip", [0.1, 0.1]),
    }
    summary = learning.summarize(results, 1)
    pairs = {(c["a"], c["b"]): c for c in summary["comparisons"]}
    assert set(pairs) == {("async_lag8", "sync_g8"), ("async_lag8", "async_lag8_ppo_clip")}
    assert pairs[("async_lag8", "sync_g8")]["diff"] == pytest.approx(0.7 - 0.3)
    # each arm's 2 seeds resampled on its own: (a mean in {0.5, 0.7, 0.9}) - (b mean in {0.2, 0.3, 0.4})
    lo, hi = pairs[("async_lag8", "sync_g8")]["diff_ci95"]
    assert 0.1 - 1e-9 <= lo < 0.4 < hi <= 0.7 + 1e-9
    assert "| async_lag8 - sync_g8 | +0.400 [" in learning.table(summary)


def test_reward_panels_group_the_papers_comparisons_and_keep_every_variant():
    panels = learning.reward_panels(list(learning.VARIANTS))
    assert [len(members) for _, members in panels] == [5, 5, 4]
    assert {n for _, members in panels for n in members} == set(learning.VARIANTS)
    # a panel needs two of its variants; one left over lands in "other variants"
    assert learning.reward_panels(["sync", "sync_g4"]) == [
        (learning.REWARD_PANELS[1][0], ["sync", "sync_g4"]),
    ]
    assert learning.reward_panels(["sync_g8"]) == [("other variants", ["sync_g8"])]
