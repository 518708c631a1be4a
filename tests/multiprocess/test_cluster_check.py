"""scripts/cluster_check.sh's dry run, and its check runner on commands that succeed, fail and hang:
each check's entry written as it ends, one failure leaving the others."""

import json
import subprocess
import sys

from megarl.bench import cluster_check
from tests.conftest import ROOT


def test_dry_run_writes_the_configs_and_a_report_of_every_planned_command(tmp_path):
    work = tmp_path / "cc"
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "cluster_check.sh"), "--dry", "--gpus", "4", "--workdir", str(work)],
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads((work / "report.json").read_text())
    assert json.loads(proc.stdout) == report
    assert [c["check"] for c in report["checks"]] == list(cluster_check.CHECKS)
    assert all(c["status"] == "dry" for c in report["checks"]) and report["ok"] == 0 and report["gpus"] == 4
    for check in report["checks"]:
        for command in check["commands"]:
            config = command["argv"][command["argv"].index("--config") + 1]
            assert json.loads(open(config).read())  # each planned command's config was written


def test_a_failing_and_a_hanging_check_leave_the_others(tmp_path):
    py = sys.executable

    def check(name, code):
        return cluster_check.Check(
            name,
            1,
            [
                cluster_check.Command("first", [py, "-c", "print(41)"]),
                cluster_check.Command("second", [py, "-c", code]),
            ],
            lambda d: {"printed": int((d / "first.out").read_text()) + int((d / "second.out").read_text())},
        )

    entries = []
    for name, code in (
        ("good", "print(1)"),
        ("bad", "import sys; print('boom at step 2', file=sys.stderr); sys.exit(4)"),
        ("slow", "import time; time.sleep(60)"),
        ("unreadable", "print('not a number')"),
    ):
        (tmp_path / name).mkdir()
        entries.append(cluster_check.run_check(check(name, code), tmp_path, timeout_s=3.0, dry=False))
        cluster_check.write_report(tmp_path / "report.json", {"gpus": 1}, entries)
    good, bad, slow, unreadable = entries
    assert good["status"] == "ok" and good["figures"] == {"printed": 42}
    assert bad["status"] == "failed" and bad["at"] == "second" and bad["exit_code"] == 4
    assert "boom at step 2" in bad["error"]
    assert slow["status"] == "timeout" and slow["at"] == "second" and slow["seconds"] < 10
    assert unreadable["status"] == "failed" and "ValueError" in unreadable["error"]
    report = json.loads((tmp_path / "report.json").read_text())
    assert [e["status"] for e in report["checks"]] == ["ok", "failed", "timeout", "failed"] and report["ok"] == 1
