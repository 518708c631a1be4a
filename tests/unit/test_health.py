"""The health watch (megarl/health.py) on hand-made step records, each expectation computed by hand
in the comment beside it; the config section's checks; the fields metrics.jsonl and the progress line
get. A run through the real loop: tests/multiprocess/test_health.py."""

import math

import pytest

from megarl.config import HealthConfig, load_config
from megarl.errors import ConfigError
from megarl.health import HealthWatch, progress_text
from megarl.metrics import MetricsWriter

TINY = "configs/tiny_cpu.yaml"


def judge(rows, **cfg):
    """Each row a step's record (steps 1, 2, ...): the checks that flagged each step."""
    watch = HealthWatch(HealthConfig(**cfg))
    return [[f.check for f in watch.observe({"step": i + 1, **row}).flags] for i, row in enumerate(rows)], watch


def flagged_steps(rows, check, **cfg):
    verdicts, _ = judge(rows, **cfg)
    return [i + 1 for i, checks in enumerate(verdicts) if check in checks]


# -- reward ---------------------------------------------------------------------------------------


def test_the_tools_demo_reward_fall_is_flagged_a_step_after_it_starts():
    """The training rewards of the tools demo's fp32 collapse (issue 53), means only (no spread known).
    The best 3-step mean before each step: 0.73 (steps 1-3), then 0.74 (steps 3-5: 0.72, 0.75, 0.75).
    The mean of the last 2 steps: step 6 0.705, step 7 0.595 (> 0.74 - 0.2 = 0.54), step 8 0.515 and
    step 9 0.39 (< 0.54). The reward fell below its baseline at step 7 (0.53): flagged at 8 and 9."""
    rewards = [0.81, 0.66, 0.72, 0.75, 0.75, 0.66, 0.53, 0.50, 0.28]
    verdicts, watch = judge([{"reward_mean": r} for r in rewards])
    assert verdicts == [[]] * 7 + [["reward"], ["reward"]]
    assert watch.last.flags[0].message == (
        "reward: mean 0.39 over steps 8-9 is 0.35 below the best 3-step mean 0.74 (steps 3-5; health.reward_drop 0.2)"
    )
    # recovering: step 10 (0.75) still averages 0.515 with step 9; step 11 (0.75) is back at 0.75
    assert [watch.observe({"step": s, "reward_mean": 0.75}).status for s in (10, 11)] == ["degraded", "ok"]


def test_a_reward_gained_and_lost_is_flagged_from_its_best_run():
    """Baseline 0.1 (steps 1-3); steps 4-6 at 0.5 make 0.5 the best 3-step mean. Step 7: (0.5 + 0.25) / 2
    = 0.375, 0.125 below; step 8: 0.25, 0.25 below 0.5 -> flagged, though far above the baseline."""
    rewards = [0.1, 0.1, 0.1, 0.5, 0.5, 0.5, 0.25, 0.25]
    assert flagged_steps([{"reward_mean": r} for r in rewards], "reward") == [8]
    assert flagged_steps([{"reward_mean": r} for r in rewards], "reward", reward_drop=0.3) == []  # 0.25 is not > 0.3


def test_a_fall_within_the_noise_of_small_batches_is_not_flagged():
    """0.8 for 3 steps, then 0.5: a drop of 0.3 > reward_drop. Reward std 0.5 over 8 samples: each step's
    mean has variance 0.25 / 8 = 0.03125; the 3-step mean 0.03125 / 3, the 2-step mean 0.03125 / 2, so
    the standard error of the drop is sqrt(0.0104 + 0.0156) = 0.161 and 0.3 is 1.86 of them (< 3).
    With 800 samples per step it is 18.6 of them: flagged."""
    rows = [{"reward_mean": r, "reward_std": 0.5} for r in (0.8, 0.8, 0.8, 0.5, 0.5)]
    assert flagged_steps([dict(r, samples=8) for r in rows], "reward") == []
    assert flagged_steps([dict(r, samples=8) for r in rows], "reward", reward_z=1.5) == [5]  # 1.86 > 1.5
    verdicts, watch = judge([dict(r, samples=800) for r in rows])
    assert verdicts == [[], [], [], [], ["reward"]]  # step 4: (0.8 + 0.5) / 2 = 0.65, 0.15 below: not yet
    assert watch.last.flags[0].message.endswith("health.reward_drop 0.2, 18.6 standard errors)")


# -- against each metric's baseline ---------------------------------------------------------------


def test_entropy_is_flagged_when_it_rises_not_when_it_falls():
    # baseline: the median of 0.014, 0.016, 0.015 = 0.015; 3 x 0.015 = 0.045. The median of the last 3:
    # step 4 0.016, 5 0.04, 6 0.05 and 7 0.05 (flagged), 8 0.001 (falling: not judged a fault)
    rows = [{"entropy": e} for e in (0.014, 0.016, 0.015, 0.04, 0.05, 0.06, 0.001, 0.001)]
    assert flagged_steps(rows, "entropy") == [6, 7]
    # a near-deterministic start: the baseline 1e-6 counts as 0.01, so 3 x 0.01 = 0.03; medians from
    # step 4: 1e-6, 0.02, 0.02, 0.02, then 0.031 at step 8
    rows = [{"entropy": e} for e in (1e-6, 1e-6, 1e-6, 0.02, 0.02, 0.02, 0.031, 0.031)]
    assert flagged_steps(rows, "entropy") == [8]
    assert flagged_steps(rows, "entropy", entropy_rise=0) == []


def test_kl_and_ess_are_flagged_past_their_baselines():
    # async step 1 is on-policy: KL baseline, the median of 0, 0.004, 0.008 = 0.004, + 0.05 = 0.054;
    # ESS baseline, of 1, 0.99, 0.98 = 0.99, - 0.15 = 0.84. The medians of the last 3 steps: KL 0.008,
    # 0.05, 0.05, then 0.06 at step 7; ESS 0.98, 0.85, 0.85, then 0.83 at step 7
    kl = (0, 0.004, 0.008, 0.05, 0.05, 0.06, 0.06)
    ess = (1, 0.99, 0.98, 0.85, 0.85, 0.83, 0.83)
    rows = [{"kl_mu_pi": k, "ess": e} for k, e in zip(kl, ess)]
    verdicts, watch = judge(rows)
    assert verdicts == [[]] * 6 + [["kl_mu_pi", "ess"]]
    assert watch.last.flags[0].message == (
        "KL(mu || pi): 0.06 (median of steps 5-7) is above its baseline 0.004 + 0.05 (health.kl_rise)"
    )
    assert (
        watch.last.flags[1].message
        == "ESS: 0.83 (median of steps 5-7) is below its baseline 0.99 - 0.15 (health.ess_drop)"
    )
    assert judge(rows, kl_rise=0)[0][-1] == ["ess"]  # 0 turns a check off


def test_one_step_outlier_is_not_a_degradation():
    """One token with a large importance ratio takes a step's ESS far down: the median of 3 steps does not
    move (0.98, 0.98, 0.97 from step 4); judged step by step (window 1) it is flagged at once."""
    rows = [{"ess": e} for e in (1, 0.99, 0.98, 0.5, 0.98, 0.97)]
    assert flagged_steps(rows, "ess") == []
    assert flagged_steps(rows, "ess", window=1) == [4]


def test_a_gradient_norm_spike_against_steps_that_had_a_gradient():
    # steps 2 (no advantage: no gradient), 3 (skipped: NaN) and 8 are neither baseline nor judged; each
    # norm against 5 x the median of the 3 usable norms before it: step 6, 0.24 < 5 x 0.05; step 7,
    # 0.26 < 5 x 0.06; step 9, 0.3 < 5 x 0.24; step 10, 2.0 > 5 x 0.26 = 1.3
    norms = [0.04, 0.0, math.nan, 0.05, 0.06, 0.24, 0.26, 0.0, 0.3, 2.0]
    assert flagged_steps([{"grad_norm": g} for g in norms], "grad_norm") == [10]
    # against the run's first steps (0.05) instead, steps 7, 9 and 10 would all be past 0.25


def test_a_gradient_norm_that_grows_as_the_run_learns_is_no_spike():
    """1.3x a step for 12 steps (0.04 -> 0.93, 23x its start): never more than 5 x the steps before."""
    norms = [0.04 * 1.3**k for k in range(13)]
    assert flagged_steps([{"grad_norm": g} for g in norms], "grad_norm") == []


def test_tool_errors_as_a_fraction_of_the_steps_tool_calls():
    # (errors, calls) per episode: rates 0.1, (no calls), 0.0, 0.2 -> baseline, their median 0.1, + 0.2 =
    # 0.3. Then 0.25, 0.35, 0.4: the medians of the last 3 rates 0.2, 0.25 and 0.35 (flagged)
    steps = [(0.1, 1.0), (0.0, 0.0), (0.0, 2.0), (0.4, 2.0), (0.5, 2.0), (0.7, 2.0), (0.8, 2.0)]
    rows = [{"episode_tool_errors": e, "episode_tool_calls": c} for e, c in steps]
    assert flagged_steps(rows, "tool_errors") == [7]


def test_a_step_skipped_for_a_non_finite_loss_is_flagged_at_once():
    rows = [
        {"skipped": True, "skip_reason": "non-finite loss (nan)"},  # within the baseline steps too
        {"skipped": True, "skip_reason": "no trained tokens in the batch"},  # nothing wrong with the run
        {"skipped": False, "skip_reason": ""},
    ]
    verdicts, watch = judge(rows)
    assert verdicts == [["nonfinite"], [], []]
    assert watch.summary()["flagged"] == {"nonfinite": {"first": 1, "steps": 1}}


# -- the run --------------------------------------------------------------------------------------


def test_stop_waits_for_patience_and_warn_never_stops():
    kl = [0, 0, 0, 0.1, 0, 0.1, 0.1, 0.1]  # step by step: flagged at 4, 6, 7, 8 (baseline 0 + 0.05)
    for action, patience, stops in (("stop", 2, [7, 8]), ("stop", 1, [4, 6, 7, 8]), ("warn", 2, [])):
        watch = HealthWatch(HealthConfig(action=action, patience=patience, window=1))
        said = []
        for i, k in enumerate(kl):
            watch.observe({"step": i + 1, "kl_mu_pi": k})
            if watch.should_stop:
                said.append(i + 1)
        assert said == stops, action
    assert [v.step for v in watch.streak] == [6, 7, 8] and watch.streak_checks() == ["kl_mu_pi"]


def test_a_resumed_run_picks_up_its_history_from_metrics_jsonl():
    """A relaunch from the checkpoint of step 6 reads metrics.jsonl: steps up to 6 (the last record of a
    step counts; evaluation records are not steps; step 7 was logged after the checkpoint and is
    trained again); then judges steps 7-9 as the run that never stopped did."""
    rows = [
        {"step": i + 1, "reward_mean": r} for i, r in enumerate([0.81, 0.66, 0.72, 0.75, 0.75, 0.66, 0.53, 0.5, 0.28])
    ]
    whole = HealthWatch(HealthConfig())
    for r in rows:
        whole.observe(r)
    relogged = [dict(rows[4], reward_mean=0.0)] + rows[4:7]  # step 5 logged twice, then up to 7
    logged = rows[:4] + relogged + [{"step": 6, "eval": True, "eval_accuracy": 0.5}]
    resumed = HealthWatch(HealthConfig())
    resumed.restore(logged, up_to=6)
    assert resumed.steps == 6
    for r in rows[6:]:
        resumed.observe(r)
    assert resumed.summary() == whole.summary() and resumed.rewards == whole.rewards
    assert whole.summary()["first_degraded_step"] == 8 and whole.summary()["status"] == "degraded"


def test_the_summary_names_the_baselines_and_what_flagged():
    rows = [{"reward_mean": 0.5, "kl_mu_pi": k, "entropy": 1.0} for k in (0.0, 0.03, 0.03, 0.2)]
    _, watch = judge(rows, window=1)  # baselines: medians; KL 0.2 > 0.03 + 0.05 at step 4
    assert watch.summary() == {
        "status": "degraded",
        "action": "warn",
        "steps_judged": 4,
        "steps_degraded": 1,
        "first_degraded_step": 4,
        "last_step": "degraded",
        "flagged": {"kl_mu_pi": {"first": 4, "steps": 1}},
        "baseline": pytest.approx(
            {"entropy": 1.0, "kl_mu_pi": 0.03, "ess": None, "grad_norm": None, "tool_errors": None, "reward": 0.5}
        ),
    }
    _, short = judge(rows[:2])  # a run that ends inside its baseline steps is not judged
    assert short.summary()["status"] == "baseline" and short.summary()["baseline"]["reward"] is None


# -- what is written ------------------------------------------------------------------------------


def test_metrics_fields_and_the_progress_line(tmp_path):
    watch = HealthWatch(HealthConfig(baseline_steps=1, window=1))
    first = watch.observe({"step": 1, "kl_mu_pi": 0.0, "ess": 1.0})
    bad = watch.observe({"step": 2, "kl_mu_pi": 0.5, "ess": 0.5})
    good = watch.observe({"step": 3, "kl_mu_pi": 0.01, "ess": 0.99})
    assert first.fields() == {"health": "baseline", "health_flags": "", "health_reasons": "", "health_degraded": 0}
    assert bad.fields()["health_flags"] == "kl_mu_pi,ess" and bad.fields()["health_degraded"] == 1
    assert bad.fields()["health_reasons"].startswith("KL(mu || pi): 0.5 (step 2) is above its baseline 0 + 0.05")
    writer = MetricsWriter(tmp_path, 10, progress=False)
    shown = [writer.progress_fields({"step": v.step, **v.fields()}).get("health") for v in (first, bad, good)]
    writer.close()
    assert shown == ["baseline", "DEGRADED:kl_mu_pi,ess", "ok"]
    assert progress_text({"step": 1, "reward_mean": 0.5}) is None  # a record from before the watch


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["health.action=rollback"], "health.action: rollback is not offered: a run resumed from its last good"),
        (["health.action=pause"], "health.action: 'pause' is not one of"),
        (["health.baseline_steps=0"], "health.baseline_steps: must be >= 1"),
        (["health.window=0"], "health.window: must be >= 1"),
        (
            [
                "health.entropy_rise=0",
                "health.kl_rise=0",
                "health.ess_drop=0",
                "health.tool_error_rise=0",
                "health.window=5",
            ],
            "health.window: the medians of entropy, KL, ESS and tool errors; every one of those checks is off",
        ),
        (["health.kl_rise=-0.1"], r"health.kl_rise: must be a finite number >= 0 \(0: off\), got -0.1"),
        (["health.reward_drop=nan"], "health.reward_drop: must be a finite number"),
        (["health.entropy_rise=1"], r"health.entropy_rise: a multiple of the baseline, must be > 1 \(or 0: off\)"),
        (["health.grad_norm_spike=0.5"], "health.grad_norm_spike: a multiple of the baseline"),
        (["health.ess_drop=1"], "health.ess_drop: ESS is at most 1"),
        (["health.patience=3"], "health.patience: used only with health.action=stop"),
        (["health.reward_drop=0", "health.reward_window=4"], "health.reward_window: used only with health.reward_drop"),
        (["health.reward_drop=0", "health.reward_z=2"], "health.reward_z: used only with health.reward_drop"),
        (["health.tool_error_rise=0.3"], "health.tool_error_rise: judges episodes' tool calls"),
        (["health.warn=true"], "health.warn: unknown field"),
    ],
)
def test_bad_health_settings_are_refused_when_the_config_loads(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, overrides)


def test_health_settings_load():
    cfg = load_config(TINY, ["health.action=stop", "health.patience=3", "health.kl_rise=0", "health.reward_drop=0.1"])
    assert (cfg.health.action, cfg.health.patience, cfg.health.kl_rise, cfg.health.reward_drop) == ("stop", 3, 0.0, 0.1)
    assert cfg.to_dict()["health"]["reward_window"] == 2  # RUN_DIR/config.json records the section
    assert load_config(TINY, ["rollout.tools=calculator", "rollout.max_turns=2", "health.tool_error_rise=0.3"])
