"""`megarl train` scored by a remote reward service (reward.url): a live service's rewards are what the
run trains on; a dead one ends the job naming its URL (on_error fail) or is counted and scored 0
(on_error zero), never a hang."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, _env, server_port
from tests.reward_test_server import even_length

TINY = str(ROOT / "configs" / "tiny_cpu.yaml")


def _train(out, *overrides):
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", TINY, f"run.output_dir={out}", "run.steps=2",
           "reward.function=null", *overrides]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_live_and_dead_reward_services(tmp_path):
    port = server_port()
    server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "reward_test_server.py"), str(port)])
    try:
        time.sleep(1.0)
        proc = _train(tmp_path / "live", f"reward.url=http://127.0.0.1:{port}/score")
        assert proc.returncode == 0, proc.stderr[-3000:]
    finally:
        server.kill()
        server.wait()
    rollouts = [json.loads(line) for line in (tmp_path / "live" / "rollouts.jsonl").read_text().splitlines()]
    assert rollouts and all(r["reward"] == even_length(r["response"]) for r in rollouts)
    assert 0 < sum(r["reward"] for r in rollouts) < len(rollouts)  # both outcomes: the service was asked

    dead = f"http://127.0.0.1:{port}/score"  # the server is gone: connection refused
    proc = _train(tmp_path / "fail", f"reward.url={dead}", "reward.on_error=fail", "reward.retries=1")
    assert proc.returncode != 0 and f"reward.on_error=fail: reward.url {dead}" in proc.stderr, proc.stderr[-3000:]

    proc = _train(tmp_path / "zero", f"reward.url={dead}", "reward.retries=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "zero" / "metrics.jsonl").read_text().splitlines()]
    rollouts = [json.loads(line) for line in (tmp_path / "zero" / "rollouts.jsonl").read_text().splitlines()]
    assert all(m["reward_timeouts"] == len(rollouts) // len(metrics) for m in metrics)
    assert all(r["reward"] == 0.0 and dead in r["reward_reason"] for r in rollouts)


@pytest.mark.slow
def test_train_scored_by_a_generative_judge(tmp_path):
    """reward.judge: the run trains on the judge server's verdicts (its rule recomputed from each
    rollout's response text), asked once per sample through /v1/chat/completions."""
    from tests.judge_test_server import even_length_verdict

    template = tmp_path / "judge.txt"
    template.write_text("Is this right? <<response>>{response}<</response>> Reference: {answer}")
    port = server_port()
    server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "judge_test_server.py"), str(port)])
    try:
        time.sleep(1.0)
        proc = _train(tmp_path / "judged", f"reward.judge.url=http://127.0.0.1:{port}/v1",
                      f"reward.judge.prompt_file={template}", "reward.judge.concurrency=4")  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
    finally:
        server.kill()
        server.wait()
    rollouts = [json.loads(line) for line in (tmp_path / "judged" / "rollouts.jsonl").read_text().splitlines()]
    assert rollouts and all(r["reward"] == even_length_verdict(r["response"]) for r in rollouts)
    assert all(r["reward_reason"] == "ok" for r in rollouts)
    assert 0 < sum(r["reward"] for r in rollouts) < len(rollouts)  # both verdicts: the judge was asked


@pytest.mark.slow
def test_a_reward_service_that_never_answers_neither_hangs_the_job_nor_costs_its_checkpoint(tmp_path):
    """A service that accepts and then drips its reply a byte every 0.25 s (tests/silent_servers.py):
    each batch ends at reward.timeout_s, is scored 0 (on_error zero, counted), and the job trains
    its steps and saves its checkpoint."""
    port = server_port()
    server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "silent_servers.py"), "drip", str(port)])
    try:
        time.sleep(1.0)
        url = f"http://127.0.0.1:{port}/score"
        proc = _train(tmp_path / "silent", f"reward.url={url}", "reward.retries=0", "reward.timeout_s=2")
    finally:
        server.kill()
        server.wait()
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "silent" / "metrics.jsonl").read_text().splitlines()]
    rollouts = [json.loads(line) for line in (tmp_path / "silent" / "rollouts.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["reward_timeouts"] == len(rollouts) // len(metrics) for m in metrics)
    assert all(r["reward"] == 0.0 and f"{url} failed after 1 tries (DeadlineExceeded" in r["reward_reason"]
               for r in rollouts)  # fmt: skip
    assert (tmp_path / "silent" / "checkpoints" / "iter_0000002").is_dir()
