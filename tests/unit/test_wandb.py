"""Weights & Biases next to TensorBoard (run.wandb): the same metric names and values, a relaunch
continuing the same W&B run, and clear refusals (bad fields, no wandb package).

Two kinds of test: a fake ``wandb`` module written into a temporary directory and put first on
sys.path (it records every call; these always run, wandb installed or not), and the real wandb
in offline mode (no network), whose run file is read back record by record (skipped where the
``wandb`` extra is not installed: ``pip install -e '.[wandb]'``). The reference for what W&B
must receive is the TensorBoard event file, read with TensorBoard's own EventAccumulator.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from megarl.config import load_config
from megarl.errors import ConfigError
from megarl.metrics import WANDB_RUN_FILE, MetricsWriter

ROOT = Path(__file__).resolve().parents[2]


TINY = str(ROOT / "configs" / "tiny_cpu.yaml")


RECORDS = [  # as the controller writes them: numbers, a string, a bool, a NaN
    {
        "step": 1,
        "loss": 0.5,
        "reward_mean": 0.25,
        "mode": "async",
        "weight_sync_verified": True,
        "kl_mu_pi": float("nan"),
        "samples": 8,
    },
    {
        "step": 2,
        "loss": 0.125,
        "reward_mean": 0.75,
        "mode": "async",
        "weight_sync_verified": True,
        "kl_mu_pi": 1e-7,
        "samples": 8,
    },
]


SCALARS = {"step", "loss", "reward_mean", "kl_mu_pi", "samples"}


FAKE_WANDB = '''
"""A stand-in for wandb: records every call megarl makes."""
calls = []
fail = None


class _Run:
    def log(self, data):
        calls.append(("log", dict(data)))

    def define_metric(self, name, step_metric=None):
        calls.append(("define_metric", name, step_metric))

    def finish(self):
        calls.append(("finish",))


def init(**kwargs):
    calls.append(("init", kwargs))
    if fail:
        raise RuntimeError(fail)
    return _Run()
'''


def _tensorboard_scalars(out: Path) -> dict:
    """{tag: {step: value}} from every event file under out/tensorboard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict = {}
    for events in sorted((out / "tensorboard").glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            for ev in acc.Scalars(tag):
                scalars.setdefault(tag, {})[ev.step] = ev.value
    return scalars


@pytest.fixture
def fake_wandb(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "wandb" or m.startswith("wandb.")]:
        monkeypatch.delitem(sys.modules, name)
    (tmp_path / "fake" / "wandb").mkdir(parents=True)
    (tmp_path / "fake" / "wandb" / "__init__.py").write_text(FAKE_WANDB)
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    import wandb

    assert Path(wandb.__file__).parent == tmp_path / "fake" / "wandb"
    yield wandb
    sys.modules.pop("wandb", None)  # the fake must not outlive its test (monkeypatch restores a real one)


def test_run_wandb_fields_are_checked_by_name():
    cfg = load_config(TINY, ["run.wandb.project=rl", "run.wandb.mode=disabled"])
    assert cfg.run.wandb == {"project": "rl", "name": None, "entity": None, "mode": "disabled"}
    cases = [
        (["run.wandb.mode=offline"], "run.wandb.project: required"),
        (
            ["run.wandb.project=rl", "run.wandb.projekt=rl"],
            "run.wandb.projekt: unknown field (known: project, name, entity, mode)",
        ),
        (["run.wandb.project=rl", "run.wandb.mode=cloud"], "run.wandb.mode: 'cloud' is not one of"),
        (["run.wandb=rl"], "run.wandb: expected a mapping"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_config(TINY, overrides)
    with pytest.raises(ConfigError, match=r"run.wandb.name: expected a non-empty string"):
        load_config(TINY, ["run.wandb.project=rl", "run.wandb.name="])


def test_without_the_wandb_package_the_config_is_refused_saying_what_to_install(monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m == "wandb" or m.startswith("wandb.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"run.wandb: the wandb package is not installed; `pip install wandb`"):
        load_config(TINY, ["run.wandb.project=rl", "run.wandb.mode=offline"])
    # disabled needs no package: the section can stay in a config used on such a machine
    cfg = load_config(TINY, ["run.wandb.project=rl", "run.wandb.mode=disabled"])
    writer = MetricsWriter(tmp_path, 1, progress=False, wandb=cfg.run.wandb)
    writer.write(RECORDS[0])
    writer.close()
    assert writer.wandb is None and not (tmp_path / WANDB_RUN_FILE).exists()


def test_wandb_gets_tensorboard_s_scalars_under_the_same_names(fake_wandb, tmp_path):
    out = tmp_path / "run"
    section = {"project": "rl", "mode": "offline"}
    writer = MetricsWriter(out, 2, progress=False, wandb=section, run_config={"run": {"steps": 2}})
    for record in RECORDS:
        writer.write(record)
    writer.close()
    (kind, init), *rest = fake_wandb.calls
    assert kind == "init"
    run_id = (out / WANDB_RUN_FILE).read_text().strip()
    assert init == {
        "project": "rl",
        "entity": None,
        "name": "run",
        "mode": "offline",
        "dir": str(out),
        "id": run_id,
        "resume": "allow",
        "config": {"run": {"steps": 2}},
    }
    # every metric against megarl's step, not W&B's own counter (a fallback logs a step again)
    assert rest[:2] == [("define_metric", "step", None), ("define_metric", "*", "step")]
    logged = [c[1] for c in rest if c[0] == "log"]
    assert rest[-1] == ("finish",) and len(logged) == 2
    tb = _tensorboard_scalars(out)
    assert set(tb) == SCALARS and all(set(log) <= SCALARS for log in logged)
    for record, log in zip(RECORDS, logged):
        step = record["step"]
        assert log == {k: v for k, v in record.items() if k in tb and step in tb[k]}
        for key, value in log.items():  # TensorBoard stores float32
            assert math.isclose(tb[key][step], value, rel_tol=1e-6), key
    assert "kl_mu_pi" not in logged[0] and logged[1]["kl_mu_pi"] == 1e-7  # NaN left out, as in TensorBoard

    # a relaunch in the same directory continues the same W&B run
    fake_wandb.calls.clear()
    MetricsWriter(out, 4, 2, progress=False, wandb=section).close()
    assert fake_wandb.calls[0][1]["id"] == run_id


def test_a_wandb_run_that_cannot_start_stops_the_writer_naming_run_wandb(fake_wandb, tmp_path):
    fake_wandb.fail = "api_key not configured (no-tty)"
    with pytest.raises(ConfigError, match=r"run.wandb: wandb.init failed in mode 'online': api_key not configured"):
        MetricsWriter(tmp_path, 1, progress=False, wandb={"project": "rl"})
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before anything was written
