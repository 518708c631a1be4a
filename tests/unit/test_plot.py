"""`megarl plot`: the figures' lines are the runs' metrics (read here independently from
metrics.jsonl), the x axes are the step, the samples trained so far and the step time summed, an
evaluation is drawn at the step it followed, the PNGs are images with something drawn, and bad
input is named by file and line."""

import json

import matplotlib.image
import matplotlib.pyplot
import pytest

from megarl.cli import main
from megarl.errors import MegarlError
from megarl.plot import draw, read_run


def write_run(path, steps, evals=()):
    path.mkdir(parents=True)
    lines = [json.dumps(r) for r in steps] + [json.dumps({"eval": True, **r}) for r in evals]
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return path


def steps(rewards, samples=8, seconds=2.0, kl=1e-3):
    return [
        {"step": k + 1, "reward_mean": r, "samples": samples, "time_step": seconds + k, "kl_mu_pi": kl * (k + 1),
         "lag_mean": 0.5 * k, "lag_max": k, "ess": 1 - 0.01 * k}
        for k, r in enumerate(rewards)
    ]  # fmt: skip


def test_lines_are_the_runs_metrics_on_each_x_axis(tmp_path):
    a = write_run(tmp_path / "a", steps([0.1, 0.4, 0.7]), evals=[{"step": 0, "eval_accuracy": 0.2},
                                                                 {"step": 3, "eval_accuracy": 0.5}])  # fmt: skip
    b = write_run(tmp_path / "b", steps([0.2, float("nan"), 0.3, 0.6], samples=16, seconds=1.0),
                  evals=[{"step": 4, "eval_heldout_accuracy": 0.3, "eval_ood_accuracy": 0.1, "eval_ood_n": 9}])  # fmt: skip
    runs = [read_run(a), read_run(b)]
    fig = draw(runs, "step")
    ra, rb = fig["reward"].axes[0].lines
    assert (list(ra.get_xdata()), list(ra.get_ydata())) == ([1, 2, 3], [0.1, 0.4, 0.7])
    assert (list(rb.get_xdata()), list(rb.get_ydata())) == ([1, 3, 4], [0.2, 0.3, 0.6])  # the NaN is left out
    assert [line.get_label() for line in fig["reward"].axes[0].lines] == ["a", "b"]
    ev, heldout, ood = fig["eval"].axes[0].lines  # run a: one set; run b: two named sets
    assert (list(ev.get_xdata()), list(ev.get_ydata())) == ([0, 3], [0.2, 0.5])
    assert (heldout.get_label(), list(heldout.get_ydata())) == ("b", [0.3])
    assert (ood.get_label(), list(ood.get_ydata()), ood.get_linestyle()) == ("b (eval_ood_accuracy)", [0.1], "--")
    assert fig["kl"].axes[0].get_yscale() == "log"

    by_samples = draw(runs, "samples")
    assert list(by_samples["reward"].axes[0].lines[1].get_xdata()) == [16, 48, 64]
    assert list(by_samples["eval"].axes[0].lines[0].get_xdata()) == [0.0, 24.0]  # before step 1; after step 3
    by_time = draw(runs, "time")
    assert list(by_time["time"].axes[0].lines[0].get_xdata()) == [2.0, 5.0, 9.0]  # 2 + 3 + 4 s
    assert list(by_time["time"].axes[0].lines[0].get_ydata()) == [2.0, 3.0, 4.0]


def test_the_cli_writes_pngs_and_names_what_has_no_data(tmp_path, capsys):
    a = write_run(tmp_path / "a", [{"step": 1, "reward_mean": 0.0}, {"step": 2, "reward_mean": 1.0}])
    assert main(["plot", str(a), "--label", "mine"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["plots"]) == {"reward"} and set(out["no_data"]) == {"eval", "kl", "lag", "ess", "time"}
    image = matplotlib.image.imread(a / "plots" / "reward.png")
    assert image.shape == (400, 700, 4) and image[..., :3].std() > 0.01


def test_bad_input_is_named(tmp_path):
    with pytest.raises(MegarlError, match=r"megarl plot: .*missing/metrics.jsonl does not exist"):
        read_run(tmp_path / "missing")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"step": 1}\n{"step": \n')
    with pytest.raises(MegarlError, match=r"bad/metrics.jsonl:2: not JSON"):
        read_run(tmp_path / "bad")


def test_band_is_the_mean_of_runs_that_share_a_label_with_a_students_t_interval(tmp_path, capsys):
    # three seeds of one setting and one run of another; seed b has no reward at step 2 (NaN), so
    # the band holds steps 1 and 3 only, where all three recorded one
    a = write_run(tmp_path / "a", steps([0.1, 0.4, 0.7]))
    b = write_run(tmp_path / "b", steps([0.3, float("nan"), 0.5], seconds=4.0))
    c = write_run(tmp_path / "c", steps([0.2, 0.6, 0.9]))
    d = write_run(tmp_path / "d", steps([0.0, 0.1]))
    runs = [read_run(a, "s"), read_run(b, "s"), read_run(d, "other"), read_run(c, "s")]
    ax = draw(runs, "step", band=True)["reward"].axes[0]
    seeds, other = ax.lines
    assert (seeds.get_label(), other.get_label()) == ("s (n=3)", "other")
    assert list(seeds.get_xdata()) == [1, 3] and list(other.get_ydata()) == [0.0, 0.1]
    assert list(seeds.get_ydata()) == pytest.approx([0.2, 0.7])
    # the band: mean -+ t(0.975, 2 df) * sd / sqrt(3); t from a printed table (4.302653), sd by hand:
    # step 1: values 0.1, 0.3, 0.2 -> sd 0.1; step 3: 0.7, 0.5, 0.9 -> sd 0.2
    (band,) = ax.collections
    ys = band.get_paths()[0].vertices[:, 1]
    half = [4.302653 * 0.1 / 3**0.5, 4.302653 * 0.2 / 3**0.5]
    assert min(ys) == pytest.approx(0.2 - half[0], abs=1e-4) and max(ys) == pytest.approx(0.7 + half[1], abs=1e-4)
    # on the time axis a band step's x is the runs' mean: step 3 ends at 2+3+4, 4+5+6 and 2+3+4 s
    by_time = draw(runs, "time", band=True)["reward"].axes[0].lines[0]
    assert list(by_time.get_xdata()) == pytest.approx([(2 + 4 + 2) / 3, (9 + 15 + 9) / 3])
    # without --band every run is its own line
    assert len(draw(runs, "step")["reward"].axes[0].lines) == 4
    assert main(["plot", str(a), str(b), "--label", "x", "--label", "y", "--band"]) == 2
    assert "--band draws runs that share a --label as one line" in capsys.readouterr().err
    assert main(["plot", str(a), str(b), "--band"]) == 2  # each run named by its directory: no group
    matplotlib.pyplot.close("all")
