"""scripts/gpu_smoke.sh in its dry mode: the plan's order and time limits, one JSON line per step,
and a step that fails, hangs or is cut off by a signal losing only its own line."""

import json
import os
import signal
import subprocess
import sys
import time

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "gpu_smoke.sh"
FIRST = ["setup", "probe", "moe_micro", "moe_train", "llama_sync", "llama_async"]
SECOND = ["llama_trainer_heavy", "moe_train_long", "engine_vs_hf"]


def _env(**extra):
    return {**os.environ, "PYTHON": sys.executable, "MEGARL_SMOKE_KILL_AFTER": "1", **extra}


def _lines(results):
    return [json.loads(x) for x in (results / "results.jsonl").read_text().splitlines()]


def _hung_processes(step: str) -> int:
    """Processes of the fake step still alive (their command line carries the line they print)."""
    marker = f'"fake": "{step}", "hanging"'
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return sum(marker in line for line in ps.splitlines())


def test_dry_run_keeps_every_steps_line_when_one_fails_and_one_hangs(tmp_path):
    results = tmp_path / "res"
    env = _env(MEGARL_SMOKE_DRY_FAIL="probe", MEGARL_SMOKE_DRY_HANG="moe_train", MEGARL_SMOKE_DRY_TIMEOUT="2")
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(results), "--dry", "--part", "all"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    lines = _lines(results)
    assert [x["step"] for x in lines] == FIRST + SECOND + ["_end"]
    by = {x["step"]: x for x in lines}
    # the failing step says so, with its exit code and what it printed; the hanging one is ended by
    # its own limit (SIGTERM ignored: timeout -k's SIGKILL a second later) and the steps after run
    assert by["probe"]["status"] == "failed" and by["probe"]["exit_code"] == 3
    assert by["probe"]["figures"] == {"fake": "probe"}
    assert by["moe_train"]["status"] == "timeout" and by["moe_train"]["exit_code"] in (124, 137)
    assert by["moe_train"]["figures"] == {"fake": "moe_train", "hanging": True}
    assert 2.0 <= by["moe_train"]["seconds"] < 10.0
    for name in FIRST + SECOND:
        assert by[name]["dry"] is True and by[name]["applied_limit_s"] == 2
        if name not in ("probe", "moe_train"):
            assert by[name]["status"] == "ok" and by[name]["figures"] == {"fake": name}
    assert by["_end"]["steps_done"] == FIRST + SECOND and by["_end"]["cut_off"] is None
    assert _hung_processes("moe_train") == 0  # the hung step's processes are gone


def test_first_part_fits_one_450_second_command(tmp_path):
    results = tmp_path / "res"
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(results), "--dry"], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    lines = _lines(results)[:-1]
    assert [x["step"] for x in lines] == FIRST  # --part first is the default
    worst = sum(x["limit_s"] + 5 for x in lines)  # each limit plus the default kill-after of 5 s
    assert worst <= 450, worst
    second = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "two"), "--dry", "--part", "second"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 0, second.stderr
    assert sum(x["limit_s"] + 5 for x in _lines(tmp_path / "two")[:-1]) <= 450


def test_a_signal_mid_step_leaves_the_done_lines_and_an_interrupted_one(tmp_path):
    results = tmp_path / "res"
    env = _env(MEGARL_SMOKE_DRY_HANG="moe_micro", MEGARL_SMOKE_DRY_TIMEOUT="60")
    proc = subprocess.Popen(["bash", str(SCRIPT), str(results), "--dry"], env=env, text=True, stderr=subprocess.PIPE)
    deadline = time.time() + 30
    while not (results / "moe_micro.out").exists() or "hanging" not in (results / "moe_micro.out").read_text():
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # what an outer time limit does
    assert proc.wait(timeout=30) == 143
    lines = _lines(results)
    assert [x["step"] for x in lines] == ["setup", "probe", "moe_micro", "_end"]
    assert [x["status"] for x in lines[:2]] == ["ok", "ok"]
    cut = lines[2]
    assert cut["status"] == "interrupted" and cut["figures"] == {"fake": "moe_micro", "hanging": True}
    assert lines[3]["cut_off"] == "moe_micro" and lines[3]["steps_done"] == ["setup", "probe"]
    assert _hung_processes("moe_micro") == 0


def test_unknown_flags_and_parts_are_refused(tmp_path):
    for args, message in ((["--part", "third"], "--part third"), (["--fast"], "unknown flag --fast")):
        proc = subprocess.run(
            ["bash", str(SCRIPT), str(tmp_path), *args], env=_env(), capture_output=True, text=True, timeout=30
        )
        assert proc.returncode == 2 and message in proc.stderr
        assert not (tmp_path / "results.jsonl").exists()
