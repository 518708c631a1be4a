"""``megarl plot RUN [RUN ...]``: the curves of training runs from their ``metrics.jsonl``, several
runs overlaid, as PNG files (matplotlib, no display needed). TensorBoard reads the same runs; this
is for a report, a pull request or a terminal without a browser.

One figure per quantity, a line per run: reward (``reward_mean``), the in-training greedy
accuracy of each evaluated set where the runs evaluated (``eval_accuracy``, ``eval_<set>_accuracy``), KL(mu || pi) of the trained
tokens (log scale: it spans orders of magnitude between on- and off-policy), lag (mean solid, max
dashed), effective sample size, and seconds per step. The x axis is the step, the samples trained
so far, or the wall time (``--x step | samples | time``: the sum of ``time_step``, so a resumed
run's gap is not counted). A quantity no run recorded is left out and named.

``--band``: runs that share a ``--label`` (seeds of one setting) are drawn as one line, their mean at
each step every one of them recorded, inside a 95% band of Student's t over the runs (the exact
quantile: with 3 seeds it is 4.30 standard errors wide on each side, not the normal 1.96). The x of
such a step is the runs' mean x there (their samples or seconds may differ).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from megarl.errors import MegarlError

EVAL_ACCURACY = re.compile(r"eval_(?:[a-z][a-z0-9_]*_)?accuracy")
X_AXES = {"step": "step", "samples": "samples trained", "time": "wall time (s, sum of time_step)"}


# Student's t, 97.5% quantile (a two-sided 95% interval), by degrees of freedom 1..30 (standard tables)
_T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
         2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
         2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)  # fmt: skip


def t_quantile_975(df: int) -> float:
    """Student's t 97.5% quantile: the table to 30 degrees of freedom, then a Cornish-Fisher expansion
    (within 1e-4 of the exact value there)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959963984540054
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def t_band(rows: Sequence[Sequence[float]]) -> tuple:
    """(mean, low, high) per column of equal-length rows (one per run): the mean over the rows with a
    95% Student's t interval (mean, mean, mean for a single row)."""
    n = len(rows)
    mean = [sum(col) / n for col in zip(*rows)]
    if n < 2:
        return mean, mean, mean
    t = t_quantile_975(n - 1)
    half = [t * math.sqrt(sum((v - m) ** 2 for v in col) / (n - 1) / n) for col, m in zip(zip(*rows), mean)]
    return mean, [m - h for m, h in zip(mean, half)], [m + h for m, h in zip(mean, half)]


@dataclass(frozen=True)
class Panel:
    name: str  # the PNG's stem
    title: str
    keys: tuple  # metrics drawn (the first solid, the others dashed)
    log_y: bool = False
    eval: bool = False  # drawn from the evaluation records


PANELS = (
    Panel("reward", "reward (mean of the step's samples)", ("reward_mean",)),
    Panel("eval", "held-out greedy accuracy (in-training evaluation)", ("eval_accuracy",), eval=True),
    Panel("kl", "KL(mu || pi) of the trained tokens", ("kl_mu_pi",), log_y=True),
    Panel("lag", "policy lag of the trained tokens (mean, max dashed)", ("lag_mean", "lag_max")),
    Panel("ess", "effective sample size (fraction)", ("ess",)),
    Panel("time", "seconds per step", ("time_step",)),
)


@dataclass
class Run:
    label: str
    steps: List[dict]  # the step records, in order
    evals: List[dict] = field(default_factory=list)  # the evaluation records ("eval": true)


def read_run(path: Path, label: Optional[str] = None) -> Run:
    """A run directory (or its metrics.jsonl): its step and evaluation records; a line that is not
    JSON is named by file and line."""
    path = Path(path)
    file = path if path.suffix == ".jsonl" else path / "metrics.jsonl"
    if not file.exists():
        raise MegarlError(f"megarl plot: {file} does not exist (a run directory holds metrics.jsonl)")
    steps, evals = [], []
    for n, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise MegarlError(f"megarl plot: {file}:{n}: not JSON ({exc.msg})") from None
        (evals if record.get("eval") else steps).append(record)
    name = label or (file.parent.name if file.name == "metrics.jsonl" else file.stem)
    return Run(name, steps, evals)


def x_values(run: Run, records: List[dict], axis: str) -> List[float]:
    """Each record's x: its step, the samples trained up to and including it, or the step time summed."""
    if axis == "step":
        return [r["step"] for r in records]
    key = "samples" if axis == "samples" else "time_step"
    total, at_step = 0.0, {}
    for r in run.steps:
        total += r.get(key) or 0.0
        at_step[r["step"]] = total
    # an evaluation after step k is drawn at step k's x (the run before its first step: 0)
    return [at_step.get(r["step"], 0.0) for r in records]


def series(run: Run, panel: Panel, axis: str) -> Dict[str, tuple]:
    """{metric: (xs, ys)} of one run in one panel: records that hold a finite value of the metric."""
    records = run.evals if panel.eval else run.steps
    keys = panel.keys
    if panel.eval:  # one set: eval_accuracy; named sets: eval_<name>_accuracy (data.eval)
        keys = tuple(dict.fromkeys(k for r in records for k in r if EVAL_ACCURACY.fullmatch(k)))  # data.eval's order
    out = {}
    for key in keys:
        kept = [r for r in records if isinstance(r.get(key), (int, float)) and r[key] == r[key]]
        if kept:
            out[key] = (x_values(run, kept, axis), [float(r[key]) for r in kept])
    return out


def groups(runs: Sequence[Run]) -> List[List[Run]]:
    """Runs that share a label, in the order the labels first appear."""
    by_label: Dict[str, List[Run]] = {}
    for run in runs:
        by_label.setdefault(run.label, []).append(run)
    return list(by_label.values())


def band_series(group: Sequence[Run], panel: Panel, axis: str) -> Dict[str, tuple]:
    """{metric: (xs, (mean, low, high))} of a group of runs in one panel, at the steps where every run of
    the group holds a finite value of the metric; x is the runs' mean x at that step."""
    out = {}
    per_run = [(series(run, panel, "step"), series(run, panel, axis)) for run in group]
    keys = dict.fromkeys(k for by_step, _ in per_run for k in by_step)
    for key in keys:
        if not all(key in by_step for by_step, _ in per_run):
            continue
        at = [dict(zip(by_step[key][0], zip(by_x[key][0], by_step[key][1]))) for by_step, by_x in per_run]
        common = sorted(set.intersection(*(set(a) for a in at)))
        if not common:
            continue
        xs = [sum(a[s][0] for a in at) / len(at) for s in common]
        out[key] = (xs, t_band([[a[s][1] for s in common] for a in at]))
    return out


def draw(runs: Sequence[Run], axis: str = "step", band: bool = False) -> Dict[str, object]:
    """{panel name: matplotlib Figure} for every panel some run has data for; with ``band``, runs that
    share a label are one line, their mean with a 95% t-band (the module's docstring)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt

    if axis not in X_AXES:
        raise MegarlError(f"megarl plot: --x {axis!r}; one of {', '.join(X_AXES)}")
    figures = {}
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    lines = [[run] for run in runs] if not band else groups(runs)
    for panel in PANELS:
        drawn = []  # (colour index, label, {metric: (xs, (mean, low, high))})
        for i, group in enumerate(lines):
            if len(group) == 1:
                by_key = {k: (xs, (ys, ys, ys)) for k, (xs, ys) in series(group[0], panel, axis).items()}
                drawn.append((i, group[0].label, by_key))
            else:
                drawn.append((i, f"{group[0].label} (n={len(group)})", band_series(group, panel, axis)))
        if not any(s for _, _, s in drawn):
            continue
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        for i, name, by_key in drawn:
            colour = colours[i % len(colours)]
            for k, (key, (xs, (ys, low, high))) in enumerate(by_key.items()):
                label = name if k == 0 else f"{name} ({key})"
                ax.plot(xs, ys, color=colour, linestyle="-" if k == 0 else "--", label=label,
                        marker="o" if len(xs) < 20 else None, markersize=3)  # fmt: skip
                if low is not ys:
                    ax.fill_between(xs, low, high, color=colour, alpha=0.15, linewidth=0)
        if panel.log_y and all(y > 0 for _, _, s in drawn for _, (_, lo, _) in s.values() for y in lo):
            ax.set_yscale("log")
        ax.set_title(panel.title)
        ax.set_xlabel(X_AXES[axis])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        figures[panel.name] = fig
    return figures


def plot_runs(
    paths: Sequence[str], out: Optional[str] = None, axis: str = "step", labels=None, band: bool = False
) -> Dict[str, Path]:
    """Writes OUT/<panel>.png (OUT: the first run's directory / plots) and returns the paths."""
    import matplotlib.pyplot as plt

    labels = list(labels or [])
    if labels and len(labels) != len(paths):
        raise MegarlError(f"megarl plot: {len(labels)} --label for {len(paths)} runs")
    runs = [read_run(Path(p), labels[i] if labels else None) for i, p in enumerate(paths)]
    if band and len({r.label for r in runs}) == len(runs):
        raise MegarlError("megarl plot: --band draws runs that share a --label as one line; no two runs share one")
    empty = [r.label for r in runs if not r.steps]
    if empty:
        raise MegarlError(f"megarl plot: no step records in {', '.join(empty)}")
    first = Path(paths[0])
    out_dir = Path(out) if out else (first if first.is_dir() else first.parent) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, fig in draw(runs, axis, band).items():
        written[name] = out_dir / f"{name}.png"
        fig.savefig(written[name])
        plt.close(fig)
    missing = [p.name for p in PANELS if p.name not in written]
    print(json.dumps({"plots": {k: str(v) for k, v in written.items()}, "no_data": missing}))
    return written
