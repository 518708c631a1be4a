"""Weights & Biases next to TensorBoard (run.wandb): the same metric names and values, a relaunch
continuing the same W&B run, and clear refusals (bad fields, no wandb package).

Two kinds of test: a fake ``wandb`` module written into a temporary directory and put first on
sys.path (it records every call; these always run, wandb installed or not), and the real wandb
in offline mode (no network), whose run file is read back record by record (skipped where the
``wandb`` extra is not installed: ``pip install -e '.[wandb]'``). The reference for what W&B
must receive is the TensorBoard event file, read with TensorBoard's own EventAccumulator.
"""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megarl.metrics import WANDB_RUN_FILE
from tests.unit.test_wandb import RECORDS, ROOT, SCALARS, _tensorboard_scalars


def _wandb_records(path: Path):
    """The records of a .wandb run file: W&B's LevelDB-style log (':W&B' header, 32 KiB blocks,
    each record a crc32 / length / type header then protobuf bytes, split FIRST/MIDDLE/LAST)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending + chunk)
            pending = b""
            yield record
        elif kind in (2, 3):  # FIRST, MIDDLE
            pending += chunk


WRITE_OFFLINE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from megarl.metrics import MetricsWriter
    out, records, start = Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
    writer = MetricsWriter(out, 4, start, progress=False, wandb={"project": "megarl-test", "mode": "offline"})
    for record in records:
        writer.write(record)
    writer.close()
""")


def test_real_wandb_offline_logs_what_tensorboard_logs_and_a_relaunch_continues_the_run(tmp_path):
    pytest.importorskip("wandb")
    out = tmp_path / "run"
    second = [
        {"step": 2, "loss": 0.0625, "reward_mean": 1.0, "samples": 8},  # a fallback: step 2 again
        {"step": 3, "loss": 0.03125, "reward_mean": 0.5, "samples": 8},
    ]
    for records, start in ((RECORDS, 0), (second, 1)):
        proc = subprocess.run(
            [sys.executable, "-c", WRITE_OFFLINE, str(out), json.dumps(records), str(start)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env={**__import__("os").environ, "WANDB_SILENT": "true"},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    run_id = (out / WANDB_RUN_FILE).read_text().strip()
    run_files = sorted((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [f.name for f in run_files] == [f"run-{run_id}.wandb"] * 2  # one W&B run, logged twice
    history, metrics = [], []
    for f in run_files:
        for record in _wandb_records(f):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                assert (record.run.run_id, record.run.project) == (run_id, "megarl-test")
            elif kind == "metric":
                metrics.append((record.metric.name or record.metric.glob_name, record.metric.step_metric))
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                history.append({k: v for k, v in items.items() if not k.startswith("_")})  # W&B's _step, _runtime
    assert ("*", "step") in metrics
    expected = [
        {k: v for k, v in r.items() if k in SCALARS and not (isinstance(v, float) and math.isnan(v))}
        for r in RECORDS + second
    ]
    assert history == expected
    tb = _tensorboard_scalars(out)  # the relaunch's step 2 is the later point in TensorBoard too
    for key in SCALARS - {"kl_mu_pi"}:
        assert {s: pytest.approx(v, rel=1e-6) for s, v in tb[key].items()} == {
            h["step"]: h[key] for h in history if key in h
        }, key
