"""`megarl bench learning`: the seed papers' learning claims as a grid of short runs, variants x seeds.

Each variant is a set of config overrides on one task (configs/learning_cpu.yaml: a tiny model on
token ids, rewarded by synthetic_low_ids; a 40-step run takes ~12 s on 2 CPU cores), everything
else equal, the same samples per optimizer step:

    sync            synchronous on-policy, one optimizer step per generated batch
    sync_g4/g8      conventional RL with G optimizer steps per generated batch (PipelineRL's baseline)
    async_lag1..8   asynchronous, in-flight weight updates, AIPO, rollout.max_lag 1, 2, 4, 8
    async_lag8_no_correction  max_lag 8, the on-policy policy gradient (trainer.loss=reinforce: the
                    behaviour log-probs are ignored, the samples used as if the current policy's)
    async_lag8_ppo_clip       max_lag 8, the PPO/GRPO two-sided clip instead of AIPO
    async_lag8_no_inflight    max_lag 8, generator.inflight_updates=false (a generation finishes
                    under the weights it started with)

A run is WORKDIR/<variant>/seed<k> (run.seed = k), trained by `megarl train` one at a time (each
run needs a trainer and a generator process: on 2 cores they cannot be packed). The grid is
resumable: a run whose summary.json says it reached its last step is kept, any other is started
over. When the runs are done, the summary (stats below) is printed as one JSON line and written
with the plots and a markdown table into WORKDIR.

Statistics (per run, then over seeds; stats functions are pure and tested by hand):
    final reward    the mean of reward_mean over the run's last ``last`` steps
    interval        percentile bootstrap 95% interval of the mean over seeds (10,000 resamples)
    vs sync         difference of the variant's mean to the sync arm's, its interval the
                    percentile bootstrap of the difference, each arm's seeds resampled on their own
    lag             the trained tokens' lag distribution (tokens_lag<b> summed over every step and
                    seed), its mean; ESS and KL(mu || pi) the means over steps and seeds
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from megarl.errors import ConfigError
from megarl.metrics import read_metrics
from megarl.plot import t_band

DEFAULT_CONFIG = "configs/learning_cpu.yaml"
BOOTSTRAP_RESAMPLES = 10_000
# sync arms: the two ranks an async run splits into trainer + generator both train (DP2) and
# generate, so every arm uses the same two cores
_SYNC = ["run.mode=sync", "trainer.dp=2"]
_ASYNC8 = ["run.mode=async", "rollout.max_lag=8"]
VARIANTS: Dict[str, List[str]] = {
    "sync": _SYNC,
    "sync_g4": _SYNC + ["trainer.updates_per_batch=4"],
    "sync_g8": _SYNC + ["trainer.updates_per_batch=8"],
    "async_lag1": ["run.mode=async", "rollout.max_lag=1"],
    "async_lag2": ["run.mode=async", "rollout.max_lag=2"],
    "async_lag4": ["run.mode=async", "rollout.max_lag=4"],
    "async_lag8": _ASYNC8,
    "async_lag8_no_correction": _ASYNC8 + ["trainer.loss=reinforce"],
    "async_lag8_ppo_clip": _ASYNC8 + ["trainer.loss=ppo_clip"],
    "async_lag8_no_inflight": _ASYNC8 + ["generator.inflight_updates=false"],
}
BASELINE = "sync"
# Differences the papers draw between two non-baseline arms (a - b), reported where both ran
COMPARISONS = [
    ("async_lag8", "sync_g8"),  # PipelineRL Fig. 5b: in-flight updates vs G=8 conventional RL, same max lag
    ("async_lag8", "sync_g4"),
    ("async_lag8", "async_lag8_no_inflight"),  # the in-flight update itself, same max lag
    ("async_lag8", "async_lag8_no_correction"),  # LlamaRL Fig. 8: AIPO vs no correction at lag 8
    ("async_lag8", "async_lag8_ppo_clip"),  # AIPO's one-sided clip vs PPO's two-sided one
]


# -- statistics ------------------------------------------------------------------------------------


def _rng(seed: int):
    import numpy as np

    return np.random.default_rng(seed)


def bootstrap_mean_ci(values: Sequence[float], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> tuple:
    """Percentile bootstrap 95% interval of the mean of ``values`` (one value: that value twice)."""
    import numpy as np

    x = np.asarray(values, dtype=np.float64)
    if len(x) < 2:
        return (float(x.mean()), float(x.mean())) if len(x) else (math.nan, math.nan)
    means = x[_rng(seed).integers(0, len(x), size=(resamples, len(x)))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def bootstrap_diff_ci(
    a: Sequence[float], b: Sequence[float], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> tuple:
    """Percentile bootstrap 95% interval of mean(a) - mean(b), each arm resampled on its own."""
    import numpy as np

    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if len(x) < 2 or len(y) < 2:
        d = float(x.mean() - y.mean())
        return d, d
    rng = _rng(seed)
    dx = x[rng.integers(0, len(x), size=(resamples, len(x)))].mean(axis=1)
    dy = y[rng.integers(0, len(y), size=(resamples, len(y)))].mean(axis=1)
    return float(np.percentile(dx - dy, 2.5)), float(np.percentile(dx - dy, 97.5))


def final_reward(steps: Sequence[dict], last: int) -> float:
    """The mean reward_mean of a run's last ``last`` step records."""
    tail = [r["reward_mean"] for r in steps][-last:]
    if not tail:
        raise ConfigError("bench learning: a run recorded no step")
    return sum(tail) / len(tail)


def lag_distribution(runs: Sequence[Sequence[dict]]) -> Dict[int, float]:
    """Trained tokens per lag (tokens_lag<b> summed over every step of every run), as fractions."""
    counts: Dict[int, int] = {}
    for steps in runs:
        for r in steps:
            for key, v in r.items():
                if key.startswith("tokens_lag"):
                    b = int(key[len("tokens_lag") :])
                    counts[b] = counts.get(b, 0) + int(v)
    total = sum(counts.values())
    return {b: counts[b] / total for b in sorted(counts)} if total else {}


def _mean_of(runs: Sequence[Sequence[dict]], key: str) -> float:
    vals = [r[key] for steps in runs for r in steps if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return sum(vals) / len(vals) if vals else math.nan


def kl_by_lag(runs: Sequence[Sequence[dict]]) -> Dict[int, float]:
    """KL(mu || pi) of the tokens of each lag, token-weighted over every step of every run."""
    num: Dict[int, float] = {}
    den: Dict[int, int] = {}
    for steps in runs:
        for r in steps:
            for key, k in r.items():
                if key.startswith("tokens_lag") and k:
                    b = int(key[len("tokens_lag") :])
                    kl = r.get(f"kl_mu_pi_lag{b}")
                    if isinstance(kl, (int, float)) and math.isfinite(kl):
                        num[b] = num.get(b, 0.0) + kl * k
                        den[b] = den.get(b, 0) + k
    return {b: num[b] / den[b] for b in sorted(den)}


@dataclass
class VariantResult:
    name: str
    runs: List[List[dict]]  # each seed's step records
    seeds: List[int]
    wall_s: List[float]

    def summary(self, last: int, baseline: Optional["VariantResult"]) -> dict:
        finals = [final_reward(steps, last) for steps in self.runs]
        dist = lag_distribution(self.runs)
        out = {
            "n_seeds": len(finals),
            "seeds": self.seeds,
            "final_reward": sum(finals) / len(finals),
            "final_reward_ci95": list(bootstrap_mean_ci(finals)),
            "final_rewards": finals,
            "lag_mean": sum(b * f for b, f in dist.items()),
            "lag_distribution": {str(b): f for b, f in dist.items()},
            "ess": _mean_of(self.runs, "ess"),
            "kl_mu_pi": _mean_of(self.runs, "kl_mu_pi"),
            "kl_mu_pi_by_lag": {str(b): v for b, v in kl_by_lag(self.runs).items()},
            "mixed_version_frac": _mean_of(self.runs, "mixed_version_frac"),
            "stale_dropped": _mean_of([[steps[-1]] for steps in self.runs], "stale_dropped"),
            "wall_s": sum(self.wall_s) / len(self.wall_s),
        }
        if baseline is not None and baseline is not self:
            base = [final_reward(steps, last) for steps in baseline.runs]
            out["vs_" + baseline.name] = out["final_reward"] - sum(base) / len(base)
            out["vs_" + baseline.name + "_ci95"] = list(bootstrap_diff_ci(finals, base))
        return out


# -- the grid --------------------------------------------------------------------------------------


def run_dir(workdir: Path, variant: str, seed: int) -> Path:
    return workdir / variant / f"seed{seed}"


def _finished(out: Path, steps: int) -> bool:
    summary = out / "summary.json"
    if not summary.exists():
        return False
    records = [r for r in read_metrics(out / "metrics.jsonl") if not r.get("eval")]
    return json.loads(summary.read_text()).get("stop_reason") == "steps" and len(records) == steps


def run_grid(
    config: str = DEFAULT_CONFIG,
    variants: Sequence[str] = tuple(VARIANTS),
    seeds: Sequence[int] = tuple(range(8)),
    overrides: Sequence[str] = (),
    workdir: str = "runs/bench_learning",
    last: int = 5,
    plots: bool = True,
    log=print,
) -> dict:
    # imported here: `megarl bench learning --help` and the statistics need no torch
    from megarl.bench.async_vs_sync import _own_thread_split
    from megarl.config import load_config
    from megarl.train import train

    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ConfigError(f"bench learning: unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    if last < 1:
        raise ConfigError(f"bench learning: --last must be >= 1, got {last}")
    root = Path(workdir)
    steps = load_config(config, list(overrides)).run.steps
    if last > steps:
        raise ConfigError(f"bench learning: --last {last} is more than the runs' {steps} steps")
    results: Dict[str, VariantResult] = {}
    total, done = len(variants) * len(seeds), 0
    for name in variants:
        res = results[name] = VariantResult(name, [], [], [])
        for seed in seeds:
            out = run_dir(root, name, seed)
            done += 1
            if _finished(out, steps):
                log(f"bench learning [{done}/{total}] {name} seed {seed}: done before, kept")
            else:
                if out.exists():
                    shutil.rmtree(out)  # a run cut short: started over, not resumed from a checkpoint
                start = time.perf_counter()
                args = list(overrides) + VARIANTS[name] + [f"run.seed={seed}", f"run.output_dir={out}"]
                args += ["run.progress=false", "run.save_every=0"]
                with _own_thread_split():
                    train(config, args)
                log(f"bench learning [{done}/{total}] {name} seed {seed}: {time.perf_counter() - start:.0f} s")
            records = [r for r in read_metrics(out / "metrics.jsonl") if not r.get("eval")]
            res.runs.append(records)
            res.seeds.append(seed)
            res.wall_s.append(json.loads((out / "summary.json").read_text())["wall_s"])
    summary = summarize(results, last)
    summary["config"], summary["overrides"], summary["steps"] = config, list(overrides), steps
    root.mkdir(parents=True, exist_ok=True)
    (root / "summary.json").write_text(json.dumps(summary, indent=1))
    (root / "table.md").write_text(table(summary))
    if plots:
        summary["plots"] = [str(p) for p in plot(results, root)]
    print(json.dumps(summary), flush=True)
    return summary


def summarize(results: Dict[str, VariantResult], last: int) -> dict:
    baseline = results.get(BASELINE)
    comparisons = []
    for a, b in COMPARISONS:
        if a in results and b in results:
            fa = [final_reward(steps, last) for steps in results[a].runs]
            fb = [final_reward(steps, last) for steps in results[b].runs]
            diff = sum(fa) / len(fa) - sum(fb) / len(fb)
            comparisons.append({"a": a, "b": b, "diff": diff, "diff_ci95": list(bootstrap_diff_ci(fa, fb))})
    return {
        "last_steps": last,
        "interval": f"percentile bootstrap 95%, {BOOTSTRAP_RESAMPLES} resamples over seeds",
        "variants": {name: r.summary(last, baseline) for name, r in results.items()},
        "comparisons": comparisons,
    }


def table(summary: dict) -> str:
    """The summary as a markdown table, one row per variant."""
    vs = "vs_" + BASELINE
    lines = [
        f"| variant | seeds | final reward (last {summary['last_steps']} steps) [95% CI] | vs {BASELINE} [95% CI] | "
        "mean lag | ESS | KL(mu‖pi) | mixed-version samples | s per run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, v in summary["variants"].items():
        lo, hi = v["final_reward_ci95"]
        diff = f"{v[vs]:+.3f} [{v[vs + '_ci95'][0]:+.3f}, {v[vs + '_ci95'][1]:+.3f}]" if vs in v else "—"
        lines.append(
            f"| {name} | {v['n_seeds']} | {v['final_reward']:.3f} [{lo:.3f}, {hi:.3f}] | {diff} | "
            f"{v['lag_mean']:.2f} | {v['ess']:.3f} | {v['kl_mu_pi']:.2e} | {v['mixed_version_frac']:.2f} | "
            f"{v['wall_s']:.0f} |"
        )
    if summary.get("comparisons"):
        lines += ["", "| a - b | difference of final rewards [95% CI] |", "|---|---|"]
        for c in summary["comparisons"]:
            lo, hi = c["diff_ci95"]
            lines.append(f"| {c['a']} - {c['b']} | {c['diff']:+.3f} [{lo:+.3f}, {hi:+.3f}] |")
    return "\n".join(lines) + "\n"


# -- plots -----------------------------------------------------------------------------------------


# Each reward panel is one of the papers' comparisons; variants outside them get an "other" panel.
REWARD_PANELS = [
    (
        "staleness: async with AIPO vs sync (LlamaRL Fig. 6)",
        ["sync", "async_lag1", "async_lag2", "async_lag4", "async_lag8"],
    ),
    (
        "G steps per batch vs in-flight updates (PipelineRL Fig. 5b)",
        ["sync", "sync_g4", "sync_g8", "async_lag8", "async_lag8_no_inflight"],
    ),
    (
        "off-policy correction at max lag 8 (LlamaRL Fig. 8)",
        ["sync", "async_lag8", "async_lag8_no_correction", "async_lag8_ppo_clip"],
    ),
]


def reward_panels(names: Sequence[str]) -> List[tuple]:
    """The panels to draw for these variants: each paper comparison with two or more of them present,
    then any variant no kept panel shows, then none if nothing is left."""
    panels = [(title, [n for n in members if n in names]) for title, members in REWARD_PANELS]
    panels = [(title, members) for title, members in panels if len(members) >= 2]
    shown = {n for _, members in panels for n in members}
    rest = [n for n in names if n not in shown]
    if rest:
        panels.append(("other variants", rest))
    return panels


def plot(results: Dict[str, VariantResult], root: Path) -> List[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    # one colour per variant in every panel
    palette = plt.get_cmap("tab10").colors
    known = list(VARIANTS) + [n for n in results if n not in VARIANTS]
    colour = {name: palette[known.index(name) % len(palette)] for name in results}

    curves = {}
    for name, r in results.items():
        n = min(len(steps) for steps in r.runs)
        rewards = [[s["reward_mean"] for s in steps[:n]] for steps in r.runs]
        samples = np.cumsum([s["samples"] for s in r.runs[0][:n]])
        # wall time: each run's reward on a common grid up to the shortest run's end
        times = [np.cumsum([s["time_step"] for s in steps[:n]]) for steps in r.runs]
        grid = np.linspace(0.0, min(t[-1] for t in times), 60)
        on_grid = [np.interp(grid, t, y) for t, y in zip(times, rewards)]
        curves[name] = (samples, t_band(rewards), grid, t_band(on_grid), len(r.runs))

    written = []
    panels = reward_panels(list(results))
    cols = 2
    rows = math.ceil((len(panels) + 1) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(13, 4.4 * rows), squeeze=False)
    flat = list(axes.flat)
    for ax, (title, members) in zip(flat, panels):
        for name in members:
            samples, (mean, lo, hi), _, _, seeds = curves[name]
            ax.plot(samples, mean, color=colour[name], label=f"{name} (n={seeds})")
            ax.fill_between(samples, lo, hi, color=colour[name], alpha=0.15)
        ax.set(xlabel="samples trained", ylabel="reward (mean of the step's samples)", title=title)
        ax.legend(fontsize=7, loc="upper left")
    ax_t = flat[len(panels)]
    for name, (_, _, grid, (mean, lo, hi), _) in curves.items():
        ax_t.plot(grid, mean, color=colour[name], label=name)
        ax_t.fill_between(grid, lo, hi, color=colour[name], alpha=0.10)
    ax_t.set(
        xlabel="wall time (s, sum of time_step; the trainer and the generator share the cores)",
        title="every variant vs wall time",
    )
    ax_t.legend(fontsize=6, loc="upper left")
    for ax in flat[len(panels) + 1 :]:
        ax.set_visible(False)
    fig.suptitle("reward, mean over seeds with a 95% t-band")
    fig.tight_layout()
    written.append(root / "reward.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, (ax_kl, ax_ess) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name, r in results.items():
        # lag 0 is the same weights (KL 0 to rounding): from lag 1 on, on a linear scale
        by_lag = {b: kl for b, kl in kl_by_lag(r.runs).items() if b >= 1}
        if by_lag:
            ax_kl.plot(list(by_lag), list(by_lag.values()), marker="o", color=colour[name], label=name)
        dist = lag_distribution(r.runs)
        ess = [_mean_of([steps], "ess") for steps in r.runs]
        lo, hi = bootstrap_mean_ci(ess)
        mean_ess = sum(ess) / len(ess)
        ax_ess.errorbar(
            [sum(b * f for b, f in dist.items())],
            [mean_ess],
            yerr=[[mean_ess - lo], [hi - mean_ess]],
            fmt="o",
            color=colour[name],
        )
        ax_ess.annotate(name, (sum(b * f for b, f in dist.items()), mean_ess), fontsize=7)
    ax_kl.set(xlabel="lag of the token (versions)", ylabel="KL(mu || pi)", title="KL(mu || pi) by lag, lag >= 1")
    ax_kl.legend(fontsize=7)
    ax_ess.set(xlabel="mean lag of the trained tokens", ylabel="ESS (fraction)", title="ESS vs lag (bootstrap 95%)")
    fig.tight_layout()
    written.append(root / "ess_kl_lag.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written
