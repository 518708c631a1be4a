"""The loop's health watch: each training step judged against the run's own first steps.

A run that degrades says so -- on the progress line, on stderr, in metrics.jsonl and in
summary.json -- instead of spending its budget in silence (issue 53: the tools demo's training
reward fell for five steps while entropy rose sixfold and KL(mu || pi) reached 0.15, and nothing
was said). Pure functions of the loop's per-step records (megarl/loop/records.py): no torch.

Each metric's baseline is the median of its first ``health.baseline_steps`` usable values in
the run: finite numbers; for the gradient norm also above 0 (a step whose groups all got one
reward has no gradient); for tool errors, steps with tool calls. A metric is judged once it has
its baseline, on the median of its last ``health.window`` usable values (the latest step's
among them): a step's ESS or KL can be one token's doing (a single token with an importance
ratio of 20 among 512 takes a step's ESS from 0.98 to 0.6), which is not a degradation; one
that lasts is flagged from its second step. A step is flagged by

    reward       the mean reward of its last reward_window steps below the best mean of
                 baseline_steps steps in a row before it (the baseline is the first such run)
                 by more than reward_drop and by more than reward_z standard errors of the two
                 means (each step's reward_std^2 / samples): a run that learned and then lost
                 it is flagged like one that fell from its start, and small batches' noise is
                 not a fall
    entropy      above entropy_rise x its baseline (a baseline under ENTROPY_FLOOR counts as
                 ENTROPY_FLOOR: a near-deterministic start would make noise a multiple);
                 falling entropy is what learning does and is not judged
    kl_mu_pi     KL(mu || pi) above its baseline + kl_rise
    ess          ESS below its baseline - ess_drop
    grad_norm    the step's gradient norm (before clipping) above grad_norm_spike x the median
                 of the baseline_steps usable norms before it: a spike is one step's, judged
                 alone and against the steps just before (RL's gradient norm grows as rewards
                 separate: 13.6x over 13 steps in a tiny run that learned)
    tool_errors  the failed fraction of the steps' tool calls above its baseline + tool_error_rise
    nonfinite    the optimizer step was skipped for a non-finite loss or gradient

A threshold of 0 turns its check off. ``HealthWatch.should_stop``: health.action=stop and the
last ``health.patience`` steps all flagged.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

from megarl.config import HealthConfig

ENTROPY_FLOOR = 0.01  # nats per token
CHECKS = ("reward", "entropy", "kl_mu_pi", "ess", "grad_norm", "tool_errors", "nonfinite")
# the checks against a baseline: check -> (its health field t, flagged(value v, baseline b, t), what is said
# of v, which is the median of {where})
RULES = {
    "entropy": (
        "entropy_rise",
        lambda v, b, t: v > t * max(b, ENTROPY_FLOOR),
        "entropy: {v:.3g} ({where}) is above {t:g} x its baseline {b:.3g} (at least %g)" % ENTROPY_FLOOR,
    ),
    "kl_mu_pi": (
        "kl_rise",
        lambda v, b, t: v > b + t,
        "KL(mu || pi): {v:.3g} ({where}) is above its baseline {b:.3g} + {t:g}",
    ),
    "ess": ("ess_drop", lambda v, b, t: v < b - t, "ESS: {v:.3g} ({where}) is below its baseline {b:.3g} - {t:g}"),
    "grad_norm": (
        "grad_norm_spike",
        lambda v, b, t: v > t * b,
        "gradient norm: {v:.3g} ({where}) is above {t:g} x {b:.3g}, the median of the steps before",
    ),
    "tool_errors": (
        "tool_error_rise",
        lambda v, b, t: v > b + t,
        "tool errors: {v:.3g} of the tool calls failed ({where}), above its baseline {b:.3g} + {t:g}",
    ),
}
ONE_STEP = ("grad_norm",)  # judged on the latest step alone
# judged against the steps just before, not the run's first: RL's gradient norm grows as a group's
# rewards separate (a tiny run that learned went from 0.039 to 0.535 in 13 steps, 13.6x, never spiking)
TRAILING = ("grad_norm",)


@dataclass(frozen=True)
class Flag:
    check: str  # one of CHECKS
    message: str  # the value, the threshold and where it comes from


@dataclass
class Verdict:
    step: int
    status: str  # baseline (the run's first baseline_steps steps) | ok | degraded
    flags: List[Flag] = field(default_factory=list)

    @property
    def degraded(self) -> bool:
        return bool(self.flags)

    def fields(self) -> dict:
        """The step's metrics.jsonl fields (strings are kept out of TensorBoard; health_degraded is its number)."""
        return {
            "health": self.status,
            "health_flags": ",".join(f.check for f in self.flags),
            "health_reasons": "; ".join(f.message for f in self.flags),
            "health_degraded": int(self.degraded),
        }


def _number(record: dict, key: str) -> Optional[float]:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values)


class _Series:
    """A metric's usable values in the run: the median of its first ``size`` (its baseline) and of its
    last ``window`` (what is judged). ``trailing``: the baseline moves with the run instead -- the
    median of the ``size`` values before the one judged."""

    def __init__(self, size: int, window: int, trailing: bool = False):
        self.size, self.first, self.trailing = size, [], trailing
        self.last: deque = deque(maxlen=window)  # (step, value)
        self.before: deque = deque(maxlen=size)  # the values before the latest (trailing)

    @property
    def baseline(self) -> Optional[float]:
        return statistics.median(self.first) if len(self.first) == self.size else None

    def add(self, step: int, value: Optional[float]) -> Optional[Tuple[float, float, str]]:
        """(baseline, the median of the last values, which steps) to judge, once the baseline was
        complete before this value; None where there is nothing to judge."""
        if value is None:
            return None
        baseline = self.baseline
        if self.trailing and baseline is not None:
            baseline = statistics.median(self.before)
        self.last.append((step, value))
        self.before.append(value)
        if len(self.first) < self.size:
            self.first.append(value)
        if baseline is None:
            return None
        steps = [k for k, _ in self.last]
        where = f"step {steps[0]}" if len(steps) == 1 else f"median of steps {steps[0]}-{steps[-1]}"
        return baseline, statistics.median(v for _, v in self.last), where


class HealthWatch:
    def __init__(self, cfg: HealthConfig):
        self.cfg = cfg
        self.series = {
            name: _Series(cfg.baseline_steps, 1 if name in ONE_STEP else cfg.window, trailing=name in TRAILING)
            for name in RULES
        }
        self.rewards: List[Tuple[int, float, float]] = []  # (step, mean, variance of the mean) of every step
        self.best: Optional[List[Tuple[int, float, float]]] = None  # the best run of baseline_steps rewards so far
        self.steps = 0
        self.streak: List[Verdict] = []  # the flagged steps in a row up to the last (none: the last was not)
        self.flagged: Dict[str, List[int]] = {}  # check -> the steps it flagged
        self.degraded_steps: List[int] = []
        self.last: Optional[Verdict] = None

    # -- judging ------------------------------------------------------------------------------

    def observe(self, record: dict) -> Verdict:
        """Judge one step's record (metrics.jsonl's keys) and take it into the run's history."""
        step = int(record["step"])
        self.steps += 1
        flags = [f for f in (self._reward(record), *self._against_baselines(record), self._nonfinite(record)) if f]
        status = "degraded" if flags else "baseline" if self.steps <= self.cfg.baseline_steps else "ok"
        verdict = Verdict(step, status, flags)
        self.streak = self.streak + [verdict] if flags else []
        for f in flags:
            self.flagged.setdefault(f.check, []).append(step)
        if flags:
            self.degraded_steps.append(step)
        self.last = verdict
        return verdict

    @property
    def should_stop(self) -> bool:
        return self.cfg.action == "stop" and len(self.streak) >= self.cfg.patience

    def streak_checks(self) -> List[str]:
        """The checks that flagged the steps of the current streak, in CHECKS order."""
        seen = {f.check for v in self.streak for f in v.flags}
        return [c for c in CHECKS if c in seen]

    def _reward(self, record: dict) -> Optional[Flag]:
        mean = _number(record, "reward_mean")
        if mean is None:
            return None
        std, n = _number(record, "reward_std"), _number(record, "samples")
        # the variance of the step's mean reward; 0 where the record has no spread (older metrics.jsonl)
        self.rewards.append((int(record["step"]), mean, std * std / n if std is not None and n else 0.0))
        c, b = self.cfg, self.cfg.baseline_steps
        flag = None
        if c.reward_drop and self.best is not None:  # the best run of b steps before this one
            best, now = self.best, self.rewards[-min(c.reward_window, len(self.rewards)) :]
            best_mean, now_mean = _mean(x[1] for x in best), _mean(x[1] for x in now)
            se = math.sqrt(sum(x[2] for x in best) / len(best) ** 2 + sum(x[2] for x in now) / len(now) ** 2)
            drop = best_mean - now_mean
            if drop > c.reward_drop and drop > c.reward_z * se:
                noise = f", {drop / se:.1f} standard errors" if se else ""  # records without reward_std: none known
                flag = Flag(
                    "reward",
                    f"reward: mean {now_mean:.3g} over steps {now[0][0]}-{now[-1][0]} is {drop:.3g} below the best "
                    f"{b}-step mean {best_mean:.3g} (steps {best[0][0]}-{best[-1][0]}; health.reward_drop "
                    f"{c.reward_drop:g}{noise})",
                )
        window = self.rewards[-b:]
        if len(window) == b and (self.best is None or _mean(x[1] for x in window) > _mean(x[1] for x in self.best)):
            self.best = window  # the first is the baseline; a later one must be higher to take its place
        return flag

    def _against_baselines(self, record: dict) -> List[Flag]:
        step = int(record["step"])
        grad = _number(record, "grad_norm")
        calls, errors = _number(record, "episode_tool_calls"), _number(record, "episode_tool_errors")
        values = {
            "entropy": _number(record, "entropy"),
            "kl_mu_pi": _number(record, "kl_mu_pi"),
            "ess": _number(record, "ess"),
            "grad_norm": grad if grad else None,  # 0: no advantage anywhere, no gradient to compare
            "tool_errors": errors / calls if calls and errors is not None else None,
        }
        flags = []
        for name, (setting, flagged, says) in RULES.items():
            threshold, judged = getattr(self.cfg, setting), self.series[name].add(step, values[name])
            if threshold and judged is not None and flagged(judged[1], judged[0], threshold):
                baseline, value, where = judged
                flags.append(
                    Flag(name, f"{says.format(v=value, b=baseline, t=threshold, where=where)} (health.{setting})")
                )
        return flags

    @staticmethod
    def _nonfinite(record: dict) -> Optional[Flag]:
        reason = record.get("skip_reason") or ""
        if record.get("skipped") and "non-finite" in reason:
            return Flag("nonfinite", f"optimizer step skipped: {reason}")
        return None

    # -- the run ------------------------------------------------------------------------------

    def restore(self, records: Iterable[dict], up_to: int) -> None:
        """The history of a resumed run: its metrics.jsonl records up to the checkpoint's step ``up_to``
        (a relaunch logs again the steps after it; the last record of each step counts)."""
        by_step = {r["step"]: r for r in records if not r.get("eval") and 0 < r.get("step", 0) <= up_to}
        for step in sorted(by_step):
            self.observe(by_step[step])

    def summary(self) -> dict:
        """summary.json's ``health``: degraded if any step of the run was."""
        c = self.cfg
        baselines = {name: series.baseline for name, series in self.series.items()}
        first = self.rewards[: c.baseline_steps]
        baselines["reward"] = _mean(x[1] for x in first) if len(first) == c.baseline_steps else None
        return {
            "status": "degraded" if self.degraded_steps else "ok" if self.steps > c.baseline_steps else "baseline",
            "action": c.action,
            "steps_judged": self.steps,
            "steps_degraded": len(self.degraded_steps),
            "first_degraded_step": self.degraded_steps[0] if self.degraded_steps else None,
            "last_step": self.last.status if self.last else None,
            "flagged": {name: {"first": steps[0], "steps": len(steps)} for name, steps in self.flagged.items()},
            "baseline": baselines,
        }


def progress_text(record: dict) -> Optional[str]:
    """The progress line's health field: ok, baseline, or DEGRADED:<the checks that flagged>."""
    status = record.get("health")
    if status is None:
        return None
    return f"DEGRADED:{record.get('health_flags', '')}" if status == "degraded" else status
