"""``megarl plot RUN [RUN ...]``: the curves of training runs from their ``metrics.jsonl``, several
runs overlaid, as PNG files (matplotlib, no display needed). TensorBoard reads the same runs; this
is for a report, a pull request or a terminal without a browser.

One figure per quantity, a line per run: reward (``reward_mean``), the in-training greedy
accuracy of each evaluated set where the runs evaluated (``eval_accuracy``, ``eval_<set>_accuracy``), KL(mu || pi) of the trained
tokens (log scale: it spans orders of magnitude between on- and off-policy), lag (mean solid, max
dashed), effective sample size, and seconds per step. The x axis is the step, the samples trained
so far, or the wall time (``--x step | samples | time``: the sum of ``time_step``, so a resumed
run's gap is not counted). A quantity no run recorded is left out and named.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from megarl.errors import MegarlError

EVAL_ACCURACY = re.compile(r"eval_(?:[a-z][a-z0-9_]*_)?accuracy")
X_AXES = {"step": "step", "samples": "samples trained", "time": "wall time (s, sum of time_step)"}


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


def draw(runs: Sequence[Run], axis: str = "step") -> Dict[str, object]:
    """{panel name: matplotlib Figure} for every panel some run has data for."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt

    if axis not in X_AXES:
        raise MegarlError(f"megarl plot: --x {axis!r}; one of {', '.join(X_AXES)}")
    figures = {}
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for panel in PANELS:
        drawn = [(i, run, series(run, panel, axis)) for i, run in enumerate(runs)]
        if not any(s for _, _, s in drawn):
            continue
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        for i, run, by_key in drawn:
            for k, (key, (xs, ys)) in enumerate(by_key.items()):
                label = run.label if k == 0 else f"{run.label} ({key})"
                ax.plot(xs, ys, color=colours[i % len(colours)], linestyle="-" if k == 0 else "--", label=label,
                        marker="o" if len(xs) < 20 else None, markersize=3)  # fmt: skip
        if panel.log_y and all(y > 0 for _, _, s in drawn for _, ys in s.values() for y in ys):
            ax.set_yscale("log")
        ax.set_title(panel.title)
        ax.set_xlabel(X_AXES[axis])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        figures[panel.name] = fig
    return figures


def plot_runs(paths: Sequence[str], out: Optional[str] = None, axis: str = "step", labels=None) -> Dict[str, Path]:
    """Writes OUT/<panel>.png (OUT: the first run's directory / plots) and returns the paths."""
    import matplotlib.pyplot as plt

    labels = list(labels or [])
    if labels and len(labels) != len(paths):
        raise MegarlError(f"megarl plot: {len(labels)} --label for {len(paths)} runs")
    runs = [read_run(Path(p), labels[i] if labels else None) for i, p in enumerate(paths)]
    empty = [r.label for r in runs if not r.steps]
    if empty:
        raise MegarlError(f"megarl plot: no step records in {', '.join(empty)}")
    first = Path(paths[0])
    out_dir = Path(out) if out else (first if first.is_dir() else first.parent) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, fig in draw(runs, axis).items():
        written[name] = out_dir / f"{name}.png"
        fig.savefig(written[name])
        plt.close(fig)
    missing = [p.name for p in PANELS if p.name not in written]
    print(json.dumps({"plots": {k: str(v) for k, v in written.items()}, "no_data": missing}))
    return written
