"""`megarl bench learning`'s arithmetic against hand computation and independent references: Student's t
quantile against the t table and mpmath, the Welch-Satterthwaite degrees of freedom and intervals by
hand, each CSV row from a run's records by hand, the CSVs read back exactly, and the table from them."""

import json
import math

import pytest

from megarl.bench import intervals, learning
from megarl.errors import ConfigError
from megarl.plot import _T975


def test_t_quantile_matches_the_t_table_and_the_normal_limit():
    for df, tabled in enumerate(_T975, start=1):
        assert intervals.t_quantile(0.975, df) == pytest.approx(tabled, abs=6e-5)
    assert intervals.t_quantile(0.975, 1e7) == pytest.approx(1.959964, abs=1e-5)
    assert intervals.t_quantile(0.95, 10) == pytest.approx(1.8125, abs=1e-4)  # the one-sided 95% table


def test_t_quantile_at_fractional_degrees_of_freedom_against_mpmath():
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 30
    for df in (1.3, 2.5, 5.5208, 11.37, 47.9):
        for p in (0.9, 0.975, 0.995):
            tail = lambda t: mpmath.betainc(df / 2, 0.5, 0, df / (df + t * t), regularized=True) - 2 * (1 - p)  # noqa: E731
            assert intervals.t_quantile(p, df) == pytest.approx(float(mpmath.findroot(tail, 2.0)), rel=1e-10)
    for a, b, x in ((0.5, 0.5, 0.3), (2.0, 0.5, 0.9), (30.0, 0.5, 0.99), (0.65, 0.5, 0.01)):
        reference = float(mpmath.betainc(a, b, 0, x, regularized=True))
        assert intervals.incomplete_beta(a, b, x) == pytest.approx(reference, rel=1e-12)


def test_welch_interval_by_hand():
    a, b = [1, 2, 3, 4], [2, 4, 6, 8, 10]
    # means 2.5 and 6; sample variances 5/3 and 10; squared standard errors 5/12 and 2, sum 29/12;
    # Welch-Satterthwaite: (29/12)^2 / ((5/12)^2 / 3 + 2^2 / 4) = (841/144) / (457/432) = 2523/457
    iv = intervals.welch_interval(a, b)
    assert iv.estimate == -3.5
    assert iv.se == pytest.approx(math.sqrt(29 / 12), rel=1e-14)
    assert iv.df == pytest.approx(2523 / 457, rel=1e-14)
    assert intervals.welch_df(5 / 3, 4, 10.0, 5) == pytest.approx(2523 / 457, rel=1e-14)
    t = (iv.high - iv.estimate) / iv.se
    assert t == pytest.approx(intervals.t_quantile(0.975, 2523 / 457), rel=1e-12)
    assert _T975[5] < t < _T975[4]  # between t(6) and t(5): 5.52 degrees of freedom
    assert iv.low == pytest.approx(-3.5 - t * math.sqrt(29 / 12)) and iv.low < 0 < iv.high
    # one arm without spread: its variance drops out and the df are the other arm's n - 1
    flat = intervals.welch_interval([0.4, 0.4], [0.5, 0.7])
    assert flat.estimate == pytest.approx(-0.2) and flat.df == pytest.approx(1.0) and flat.se == pytest.approx(0.1)
    assert flat.low == pytest.approx(-0.2 - 12.7062 * 0.1, abs=1e-4)
    # no spread at all: the difference itself; one seed: no interval
    still = intervals.welch_interval([1.0, 1.0], [0.5, 0.5])
    assert (still.estimate, still.low, still.high) == (0.5, 0.5, 0.5)
    assert math.isnan(intervals.welch_interval([1.0], [0.5, 0.7]).low)


def test_mean_interval_by_hand():
    iv = intervals.mean_interval([0.1, 0.4, 0.45, 0.9, 0.2])
    # mean 0.41; squared deviations 0.0961 + 0.0001 + 0.0016 + 0.2401 + 0.0441 = 0.382, / 4 = 0.0955;
    # standard error sqrt(0.0955 / 5); t(4) = 2.7764
    assert iv.estimate == pytest.approx(0.41) and iv.df == 4
    assert iv.high - iv.estimate == pytest.approx(2.7764 * math.sqrt(0.0955 / 5), abs=1e-5)
    one = intervals.mean_interval([0.3])
    assert one.estimate == 0.3 and math.isnan(one.low) and math.isnan(one.high)


def test_the_percentile_bootstrap_of_a_mean_at_8_seeds_is_about_0_78_of_the_t_interval():
    """docs/learning.md's reason for t: the bootstrap distribution of the mean has the plug-in standard
    error sqrt((n - 1) / n) s / sqrt(n) and normal-like quantiles, against t(n - 1)'s s / sqrt(n)."""
    ratio = math.sqrt(7 / 8) * 1.959964 / intervals.t_quantile(0.975, 7)
    assert ratio == pytest.approx(0.775, abs=0.001)


# -- per run ----------------------------------------------------------------------------------------


def _step(k, reward, samples=32, **extra):
    return {"step": k, "reward_mean": reward, "samples": samples, "lag_max": 0, "stale_dropped": 0,
            **extra}  # fmt: skip


def _eval(k, accuracy, greedy, sampled, passed, n=8, k_samples=4, prefix="eval_"):
    return {"step": k, "eval": True, f"{prefix}accuracy": accuracy, f"{prefix}greedy_reward_mean": greedy,
            f"{prefix}reward_mean@{k_samples}": sampled, f"{prefix}pass@{k_samples}": passed, f"{prefix}n": n}  # fmt: skip


CONFIG = {"data": {"eval": ["repeat:8:0:heldout"], "eval_samples": 4}, "rollout": {"temperature": 0.7}}


def _run():
    records = [
        _eval(0, 0.25, 0.4, 0.3, 0.5),
        _step(1, 0.1, tokens_lag0=30, tokens_lag1=10, kl_mu_pi_lag0=0.0, kl_mu_pi_lag1=0.02, kl_mu_pi=0.005,
              ess=1.0, lag_max=1, filtered_groups=1, truncated_frac=0.5, mixed_version_frac=0.0),
        _step(2, 0.5, tokens_lag0=10, tokens_lag1=30, kl_mu_pi_lag0=0.0, kl_mu_pi_lag1=0.04, kl_mu_pi=0.03,
              ess=0.9, lag_max=1, filtered_groups=0, truncated_frac=0.0, mixed_version_frac=0.5, lag_handover_waits=2),
        _step(3, 0.7, samples=16, tokens_lag0=0, tokens_lag1=20, tokens_lag2=20, kl_mu_pi_lag0=float("nan"),
              kl_mu_pi_lag1=0.01, kl_mu_pi_lag2=0.1, kl_mu_pi=float("nan"), ess=0.8, lag_max=2, filtered_groups=2,
              truncated_frac=0.25, mixed_version_frac=0.25, lag_handover_waits=3, stale_dropped=1),
        _eval(3, 0.5, 0.6, 0.45, 0.75),
    ]  # fmt: skip
    rollouts = [
        {"versions": [0, 0, 0], "reward": 1.0, "response_tokens": [5, 6, 2]},
        {"versions": [0, 1, 1], "reward": 0.0, "response_tokens": [5, 2]},  # mean 2/3: version 1
        {"versions": [1, 2], "reward": 0.5, "response_tokens": [5] * 9 + [2]},  # mean 1.5: version 2 (half up)
        {"versions": [2, 2, 2, 2], "reward": 0.25, "response_tokens": [5, 5, 5, 2]},
    ]
    answers = [{"response_tokens": [1, 2]}, {"response_tokens": [1, 1, 1, 2]}]
    return records, rollouts, answers


def test_a_runs_row_by_hand():
    records, rollouts, answers = _run()
    row = learning.run_row("async", 3, records, rollouts, answers, CONFIG, 12.5, last=2)
    assert list(row) == learning.RUN_COLUMNS
    expected = {
        "arm": "async", "seed": 3, "steps": 3, "samples": 80, "heldout_n": 8, "eval_samples": 4,
        "eval_temperature": 0.7,
        "heldout_greedy_accuracy": 0.5, "heldout_greedy_reward": 0.6, "heldout_sampled_reward": 0.45,
        "heldout_pass_at_k": 0.75,
        "start_greedy_accuracy": 0.25, "start_greedy_reward": 0.4, "start_sampled_reward": 0.3,
        "heldout_greedy_tokens_mean": 3.0,  # (2 + 4) / 2
        # no validation set evaluated
        "validation_n": 0, "validation_greedy_accuracy": math.nan, "validation_greedy_reward": math.nan,
        "validation_sampled_reward": math.nan, "validation_start_greedy_accuracy": math.nan,
        "train_reward_last": 0.6, "train_reward_last_steps": 2,  # (0.5 + 0.7) / 2: the last 2 steps
        # tokens: lag 0: 40, lag 1: 60, lag 2: 20 -> (60 + 40) / 120
        "lag_mean": 100 / 120, "lag_max": 2,
        "kl_mu_pi": (0.005 + 0.03) / 2,  # the NaN step left out
        "ess": 0.9, "mixed_version_frac": 0.25,
        "lag_handover_waits": 5, "stale_dropped": 1,  # 2 + 3 waits over the steps; the last step's running total of drops
        "filtered_groups": 3,
        "truncated_frac": (0.5 * 32 + 0.0 * 32 + 0.25 * 16) / 80,
        # trained lengths 3, 2, 10, 4: sorted 2 3 4 10; p50 between 3 and 4; p95 at 2.85 of 3 gaps
        "train_tokens_mean": 19 / 4, "train_tokens_p50": 3.5, "train_tokens_p95": 4 + 0.85 * 6, "train_tokens_max": 10,
        "wall_s": 12.5,
    }  # fmt: skip
    assert row == pytest.approx(expected, nan_ok=True)
    # a named set's metrics (eval_<name>_accuracy, ...) are read as the one unnamed set's
    named = {"data": {"eval": ["held=repeat:8:0:heldout"], "eval_samples": 4}, "rollout": {"temperature": 0.7}}
    renamed = [
        {k.replace("eval_", "eval_held_") if k.startswith("eval_") else k: v for k, v in r.items()} for r in records
    ]
    assert learning.run_row("async", 3, renamed, rollouts, answers, named, 12.5, 2) == pytest.approx(
        expected, nan_ok=True
    )
    # beside a validation set, the set named heldout is the held-out one, its answers alone are measured, and the
    # validation set's scores fill their columns
    both = {"data": {"eval": ["validation=repeat:4:0:validation", "heldout=repeat:8:0:heldout"], "eval_samples": 4},
            "rollout": {"temperature": 0.7}}  # fmt: skip
    two_sets = [
        {**{k.replace("eval_", "eval_heldout_") if k.startswith("eval_") else k: v for k, v in r.items()},
         **({f"eval_validation_{k[5:]}": v * 0.5 for k, v in r.items() if k.startswith("eval_")} if r.get("eval") else {})}
        for r in records
    ]  # fmt: skip
    marked = [{"set": "heldout", **a} for a in answers] + [{"set": "validation", "response_tokens": [1] * 30}]
    row = learning.run_row("async", 3, two_sets, rollouts, marked, both, 12.5, 2)
    assert row == pytest.approx(
        {
            **expected,
            "validation_n": 4,
            "validation_greedy_accuracy": 0.25,
            "validation_greedy_reward": 0.3,
            "validation_sampled_reward": 0.225,
            "validation_start_greedy_accuracy": 0.125,
        }  # fmt: skip
    )
    unnamed = {**both, "data": {**both["data"], "eval": ["validation=repeat:4:0:validation", "repeat:8:0:heldout"]}}
    with pytest.raises(ConfigError, match="one must be named heldout"):
        learning.run_row("async", 3, two_sets, rollouts, marked, unnamed, 12.5, 2)
    with pytest.raises(ConfigError, match="no held-out evaluation at step 0 and its last step"):
        learning.run_row("async", 3, records[:-1], rollouts, answers, CONFIG, 12.5, 2)


def test_curves_by_generating_version_and_kl_by_lag_by_hand():
    records, rollouts, _ = _run()
    assert learning.sample_version([3, 4]) == 4 and learning.sample_version([3, 3, 4]) == 3
    assert learning.curve_rows("async", 3, rollouts) == [
        {"arm": "async", "seed": 3, "version": 0, "samples": 1, "reward_mean": 1.0},
        {"arm": "async", "seed": 3, "version": 1, "samples": 1, "reward_mean": 0.0},
        {"arm": "async", "seed": 3, "version": 2, "samples": 2, "reward_mean": 0.375},
    ]
    steps = [r for r in records if not r.get("eval")]
    rows = learning.lag_rows("async", 3, steps)
    assert [(r["lag"], r["tokens"]) for r in rows] == [(0, 40), (1, 60), (2, 20)]
    # lag 1: (0.02 x 10 + 0.04 x 30 + 0.01 x 20) / 60; lag 0: 0 (the NaN step had no lag-0 tokens)
    assert [r["kl_mu_pi"] for r in rows] == pytest.approx([0.0, 1.6 / 60, 0.1])


# -- the CSVs and what is made from them -----------------------------------------------------------


def _rows(arm, greedy, sampled, start=0.25):
    rows = []
    for seed, (g, s) in enumerate(zip(greedy, sampled)):
        records, rollouts, answers = _run()
        row = learning.run_row(arm, seed, records, rollouts, answers, CONFIG, 10.0 + seed, 2)
        row.update(heldout_greedy_accuracy=g, heldout_sampled_reward=s, start_greedy_accuracy=start)
        rows.append(row)
    return rows


def test_the_csvs_read_back_exactly_and_the_table_comes_from_them(tmp_path):
    rows = _rows("sync", [0.5, 0.7], [0.3, 0.4]) + _rows("async", [0.4, 0.4], [0.2 / 3, 0.1])
    curves = learning.curve_rows("sync", 0, _run()[1]) + learning.curve_rows("async", 0, _run()[1])
    lags = learning.lag_rows("sync", 0, [r for r in _run()[0] if not r.get("eval")])
    learning.write_csv(tmp_path / "runs.csv", rows, learning.RUN_COLUMNS)
    learning.write_csv(tmp_path / "curves.csv", curves, learning.CURVE_COLUMNS)
    learning.write_csv(tmp_path / "lags.csv", lags, learning.LAG_COLUMNS)
    # exactly: floats written by repr (json compares the nan of a run without a validation set as text)
    assert json.dumps(learning.read_csv(tmp_path / "runs.csv")) == json.dumps(rows)
    assert learning.read_csv(tmp_path / "curves.csv") == curves
    assert learning.read_csv(tmp_path / "lags.csv") == lags
    summary = learning.report(tmp_path, learning.TASKS["repeat"], plots=False)
    text = (tmp_path / "table.md").read_text()
    assert text == learning.table(summary, rows)
    sync_row = next(line for line in text.splitlines() if line.startswith("| sync | 2 |"))
    async_row = next(line for line in text.splitlines() if line.startswith("| async | 2 |"))
    # sync: mean 0.6, t(1) x 0.1 = 1.27062 either side; async - sync: -0.2, Welch df 1 (async has no
    # spread), se 0.1 -> the same half-width
    assert "| 0.250 | 0.600 [-0.671, 1.871] | — |" in sync_row
    assert "| 0.400 [0.400, 0.400] | -0.200 [-1.471, +1.071] |" in async_row
    diff = summary["arms"]["async"]["heldout_greedy_accuracy"]["vs_sync"]
    assert diff["diff"] == pytest.approx(-0.2) and diff["df"] == pytest.approx(1.0)
    # the sampled reward: async 1/3 x 0.2 and 0.1 against 0.3 and 0.4
    sampled = summary["arms"]["async"]["heldout_sampled_reward"]["vs_sync"]
    check = intervals.welch_interval([0.2 / 3, 0.1], [0.3, 0.4])
    assert sampled["diff"] == pytest.approx(check.estimate)
    assert sampled["ci95"] == pytest.approx([check.low, check.high])
    assert "(4 per prompt, T 0.7)" in text and "8 prompts" in text
    # the diagnostics table: the old measure with its interval, lag, exclusions, lengths
    train = next(line for line in text.splitlines() if line.startswith("| async | 0.600"))
    assert "| 0.83 (2) | 5.0 / 1.0 / 3.0 | 3.5 / 9.1 / 10.0 | 3.0 |" in train
    # the comparison repeat's task draws where both arms ran
    assert summary["comparisons"] == []  # async_no_exclusion did not run
    assert (tmp_path / "summary.json").exists()


def test_the_plots_are_drawn_from_the_csvs_alone(tmp_path):
    rows = _rows("sync", [0.5, 0.7], [0.3, 0.4]) + _rows("async", [0.4, 0.5], [0.2, 0.1])
    curves = [c for arm in ("sync", "async") for seed in (0, 1) for c in learning.curve_rows(arm, seed, _run()[1])]
    steps = [s for s in _run()[0] if not s.get("eval")]
    lags = [r for arm in ("sync", "async") for r in learning.lag_rows(arm, 0, steps)]
    for name, data, columns in (("runs", rows, learning.RUN_COLUMNS), ("curves", curves, learning.CURVE_COLUMNS),
                                ("lags", lags, learning.LAG_COLUMNS)):  # fmt: skip
        learning.write_csv(tmp_path / f"{name}.csv", data, columns)
    summary = learning.report(tmp_path, learning.TASKS["synthetic"])
    for png in ("reward_by_version.png", "heldout.png", "ess_kl_lag.png"):
        assert str(tmp_path / png) in summary["plots"]
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    version, mean, lo, hi = learning.version_curve(learning.read_csv(tmp_path / "curves.csv"), "sync")
    assert version == [0, 1, 2] and mean == pytest.approx([1.0, 0.0, 0.375]) and lo == pytest.approx(mean)


def test_report_only_needs_the_csvs(tmp_path):
    with pytest.raises(ConfigError, match="runs.csv is missing"):
        learning.run_grid("repeat", workdir=str(tmp_path), report_only=True)


# -- arms --------------------------------------------------------------------------------------------


def test_arms_are_config_overrides_and_an_arm_can_be_added_or_replaced():
    repeat = learning.TASKS["repeat"]
    assert list(learning.select_arms(repeat, [], [])) == [
        "sync",
        "async",
        "async_drop",
        "async_keep",
        "async_mask",
        "async_no_exclusion",
        "sync_g3",
    ]
    arms = learning.select_arms(repeat, [], ["async_new: run.mode=async rollout.max_lag=2 'rollout.env_timeout_s=9'"])
    assert arms["async_new"] == ["run.mode=async", "rollout.max_lag=2", "rollout.env_timeout_s=9"]
    assert list(arms)[-1] == "async_new"
    replaced = learning.select_arms(repeat, ["sync", "async"], ["async: run.mode=async rollout.max_lag=4"])
    assert replaced == {"sync": ["run.mode=sync", "trainer.dp=2"], "async": ["run.mode=async", "rollout.max_lag=4"]}
    for bad in ("no_colon run.mode=sync", "bad name: run.mode=sync", "empty:", "x: notanoverride"):
        with pytest.raises(ConfigError, match="expected 'NAME: key=value"):
            learning.parse_arm(bad)
    with pytest.raises(ConfigError, match="unknown arm"):
        learning.select_arms(repeat, ["async_lag3"], [])


def test_unknown_tasks_arms_and_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="unknown --task"):
        learning.run_grid("arithmetic")
    with pytest.raises(ConfigError, match="unknown arm"):
        learning.run_grid(arms=["async_lag3"])
    with pytest.raises(ConfigError, match="--last 99 is more than the runs' 40 steps"):
        learning.run_grid(arms=["sync"], last=99)
    with pytest.raises(ConfigError, match="data.eval_samples must be >= 2"):
        learning.run_grid(arms=["sync"], overrides=["data.eval_samples=1"])
    with pytest.raises(ConfigError, match="run.time_budget_min must be 0"):
        learning.run_grid(arms=["sync"], overrides=["run.time_budget_min=5"])
    with pytest.raises(ConfigError, match="trains 10 steps, another 40"):
        learning.run_grid(arms=["sync", "other"], extra_arms=["other: run.steps=10"])


def test_reward_panels_group_the_papers_comparisons_and_keep_every_arm():
    panels = learning.reward_panels(list(learning.SYNTHETIC_ARMS), learning.SYNTHETIC_PANELS)
    assert [len(members) for _, members in panels] == [5, 5, 4]
    assert {n for _, members in panels for n in members} == set(learning.SYNTHETIC_ARMS)
    assert learning.reward_panels(["sync", "sync_g4"], learning.SYNTHETIC_PANELS) == [
        (learning.SYNTHETIC_PANELS[1][0], ["sync", "sync_g4"]),
    ]
    assert learning.reward_panels(["sync_g8"], learning.SYNTHETIC_PANELS) == [("every arm", ["sync_g8"])]
    assert learning.reward_panels(["sync", "async"], ()) == [("every arm", ["sync", "async"])]


def test_a_workdir_holds_one_tasks_grid_and_a_run_counts_only_as_its_arm_trained_it(tmp_path):
    assert learning.workdir_task(tmp_path, None) == "synthetic"
    (tmp_path / learning.BENCH_FILE).write_text('{"task": "repeat"}')
    assert learning.workdir_task(tmp_path, None) == "repeat" == learning.workdir_task(tmp_path, "repeat")
    with pytest.raises(ConfigError, match="holds a --task repeat grid, not synthetic"):
        learning.workdir_task(tmp_path, "synthetic")
    run = tmp_path / "async" / "seed0"
    (run / "eval").mkdir(parents=True)
    (run / "eval" / "step_2.jsonl").write_text("")
    (run / "summary.json").write_text('{"stop_reason": "steps"}')
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 2, "eval": true}\n')
    identity = {"config": "c.yaml", "overrides": ["run.mode=async"]}
    assert not learning._finished(run, 2, identity)  # no record of how it was trained
    (run / learning.RUN_FILE).write_text('{"config": "c.yaml", "overrides": ["run.mode=async"]}')
    assert learning._finished(run, 2, identity)
    assert not learning._finished(run, 2, {"config": "c.yaml", "overrides": ["run.mode=async", "rollout.max_lag=4"]})
    assert not learning._finished(run, 3, identity)  # fewer steps than the runs now train
    (run / "summary.json").write_text('{"stop_reason": "preempted"}')
    assert not learning._finished(run, 2, identity)


def test_validation_scores_get_their_own_intervals_and_table_where_every_run_has_them():
    rows = _rows("sync", [0.5, 0.7], [0.3, 0.4]) + _rows("async", [0.4, 0.4], [0.2, 0.1])
    without = learning.summarize(rows, "heldout_greedy_accuracy", "sync")
    assert math.isnan(without["arms"]["sync"]["validation_greedy_accuracy"])  # a plain mean of nan, no interval
    assert "validation set" not in learning.table(without, rows)
    for row, v in zip(rows, [0.2, 0.4, 0.5, 0.6]):
        row.update(validation_n=64, validation_greedy_accuracy=v, validation_sampled_reward=v / 2,
                   validation_start_greedy_accuracy=0.1)  # fmt: skip
    summary = learning.summarize(rows, "heldout_greedy_accuracy", "sync", [("async", "sync")])
    val = summary["arms"]["async"]["validation_greedy_accuracy"]
    check = intervals.welch_interval([0.5, 0.6], [0.2, 0.4])
    assert val["mean"] == pytest.approx(0.55) and val["vs_sync"]["diff"] == pytest.approx(check.estimate)
    assert val["vs_sync"]["ci95"] == pytest.approx([check.low, check.high])
    assert summary["comparisons"][0]["validation_sampled_reward"]["diff"] == pytest.approx(0.275 - 0.15)
    text = learning.table(summary, rows)
    assert "The validation set (64 prompts" in text
    assert next(line for line in text.splitlines() if line.startswith("| async | 0.100 | 0.550 ["))
