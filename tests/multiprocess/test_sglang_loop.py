"""`megarl train` with ``generator.backend: sglang``, end to end, against tests/sglang_test_server.py.

The test server speaks SGLang 0.5.23's routes, validates every request body
(keys, types, required fields of the route's class) and launch flag against
SGLang's own source, decodes with megarl's torch
engine and receives every weight update through ``worker_receiver.pull_shards``
-- the entry point SGLang calls in its TP workers. The job is configs/tiny_cpu.yaml:
a tiny random Llama, trainer TP2 (2 ranks) + one generator replica (its driver
rank), asynchronous, with the synthetic reward so that the policy really changes
between syncs. Launch mode starts the server through the job's own code path
(``generator.sglang_launcher`` names the test server instead of SGLang);
attach mode starts it from the command `megarl sglang-command` prints.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.rewards.synthetic import synthetic_parity
from tests.conftest import ROOT, _env, server_port

TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
SERVER = f"{sys.executable} {ROOT / 'tests' / 'sglang_test_server.py'}"
STEPS, MAX_LAG = 4, 2
COMMON = [
    "generator.backend=sglang",
    "generator.verify_sync=true",
    "reward.function=synthetic_parity",
    f"run.steps={STEPS}",
    f"rollout.max_lag={MAX_LAG}",
    "rollout.max_new_tokens=32",
]


def _env_with(stats: Path) -> dict:
    # 30 ms per decode step: generation slower than this tiny model's training, as on GPUs, so
    # updates land in the middle of sequences
    return dict(_env(), SGLANG_TEST_STATS=str(stats), SGLANG_TEST_STEP_DELAY_S="0.03")


def _train(out: Path, env: dict, *overrides, timeout=900):
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", TINY, f"run.output_dir={out}", *COMMON, *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    return metrics, rollouts


def _check_run(metrics, rollouts, stats) -> None:
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    # step 1 trains on samples of the very policy it holds: the server's behaviour log-probs
    # (weights synced into its SGLang-layout tensors) equal Megatron's log-probs
    assert metrics[0]["kl_mu_pi"] < 1e-5 and metrics[0]["ess"] > 1 - 1e-5, metrics[0]
    assert all(m["weight_sync_verified"] for m in metrics)  # every shard checksummed against the sender's
    # the policy moved (non-zero advantages), so later steps see stale tokens with a real KL
    assert max(m["kl_mu_pi"] for m in metrics[1:]) > 1e-7
    for r in rollouts:
        lags = [r["trained_version"] - v for v in r["versions"]]
        assert 0 <= min(lags) and max(lags) <= MAX_LAG, r
        assert r["versions"] == sorted(r["versions"])
        assert r["reward"] == pytest.approx(synthetic_parity(r["response"]))
    two = [r for r in rollouts if len(set(r["versions"])) > 1]
    assert two, "no trained sequence carries two policy versions (no in-flight update)"
    # the server side: SGLang's update protocol ran once per sync, in order, every route validated
    assert stats["updates"] == STEPS and stats["versions"] == [str(v) for v in range(STEPS)]
    for route in (
        "/generate",
        "/pause_generation",
        "/begin_weight_update",
        "/update_weights_from_tensor",
        "/end_weight_update",
        "/update_weight_version",
        "/continue_generation",
    ):
        assert stats["requests"].get(route, 0) >= (1 if route == "/generate" else STEPS), (route, stats)
    assert stats["two_version_samples"] > 0
    # every pause was SGLang's in-place mode (validated against PauseGenerationReqInput's Literal)
    assert stats["pause_modes"] == {"in_place": STEPS}, stats["pause_modes"]
    # aborts of stale groups (if any went stale) name single samples, each at most once
    rids = stats["aborted_rids"]
    assert len(rids) == len(set(rids)) and all(r.startswith("g") and "#" in r for r in rids), rids


@pytest.mark.slow
def test_train_launches_and_attaches_sglang_servers(tmp_path):
    # launch: the job starts the server for its replica, through the same code path as SGLang's
    launched = tmp_path / "launch"
    stats = tmp_path / "launch_stats.json"
    metrics, rollouts = _train(
        launched, _env_with(stats), f"generator.sglang_launcher={SERVER}", f"generator.sglang_port={server_port()}"
    )
    _check_run(metrics, rollouts, json.loads(stats.read_text()))
    log = (launched / "sglang" / "replica0.log").read_text()
    assert "--custom-weight-loader megarl.generator.sglang.worker_receiver.pull_shards" in log
    assert (launched / "sglang" / "model" / "config.json").is_file()  # written from the trainer's weights

    # attach: a server started by hand from the command `megarl sglang-command` prints
    attached = tmp_path / "attach"
    stats = tmp_path / "attach_stats.json"
    url = f"http://127.0.0.1:{server_port()}"
    overrides = [
        *COMMON,
        f"run.output_dir={attached}",
        f"generator.sglang_urls={url}",
        f"generator.sglang_launcher={SERVER}",
    ]
    printed = subprocess.run(
        [
            sys.executable,
            "-m",
            "megarl.cli",
            "sglang-command",
            "--config",
            TINY,
            "--model-path",
            str(launched / "sglang" / "model"),
            *overrides,
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert printed.startswith("MEGARL_SYNC_CONFIG=") and f"--port {url.rsplit(':', 1)[1]}" in printed
    server = subprocess.Popen(
        printed.replace("--host 0.0.0.0", "--host 127.0.0.1"),
        shell=True,
        cwd=ROOT,
        env=_env_with(stats),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        metrics, rollouts = _train(attached, _env_with(stats), f"generator.sglang_urls={url}")
        _check_run(metrics, rollouts, json.loads(stats.read_text()))
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


@pytest.mark.slow
def test_killed_server_ends_the_job_naming_it(tmp_path):
    out, stats = tmp_path / "killed", tmp_path / "stats.json"
    port = server_port()
    cmd = [
        sys.executable,
        "-m",
        "megarl.cli",
        "train",
        "--config",
        TINY,
        f"run.output_dir={out}",
        *COMMON,
        "run.steps=200",
        f"generator.sglang_launcher={SERVER}",
        f"generator.sglang_port={port}",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=_env_with(stats),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 600
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.time() < deadline
            time.sleep(0.5)
        killed_at = time.time()
        os.kill(json.loads(stats.read_text())["pid"], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)
        elapsed = time.time() - killed_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert elapsed < 60, elapsed
    assert "generator replica 0" in stderr and f"http://127.0.0.1:{port}" in stderr, stderr[-3000:]


@pytest.mark.slow
def test_multi_turn_episodes_through_sglang(tmp_path):
    """Episodes on the SGLang backend: every turn is a /generate of input_ids (validated against
    SGLang's GenerateReqInput by the test server) continuing the episode's exact ids; at step 1 the
    trainer's log-probs at the sampled positions equal the server's behaviour log-probs."""
    out, stats = tmp_path / "episodes", tmp_path / "stats.json"
    metrics, rollouts = _train(
        out,
        _env_with(stats),
        f"generator.sglang_launcher={SERVER}",
        f"generator.sglang_port={server_port()}",
        "rollout.env=tests.episode_envs_for_tests:two_tool_turns",
        "rollout.max_turns=3",
        "generator.max_seq_len=192",
    )
    assert metrics[0]["kl_mu_pi"] < 1e-5 and all(m["weight_sync_verified"] for m in metrics), metrics[0]
    assert all(m["episode_turns"] == 3 and m["episode_tool_calls"] == 2 for m in metrics)
    # the test server reports meta_info.cached_tokens as a radix cache would: turns 2 and 3 find
    # their whole context but the inserted ids cached, so more than half of every step's prompt ids
    assert all(m["episode_prompt_cached_frac"] > 0.5 for m in metrics), [
        m["episode_prompt_cached_frac"] for m in metrics
    ]
    for r in rollouts:
        mask = r["loss_mask"]
        assert [mask[0]] + [m for a, m in zip(mask, mask[1:]) if m != a] == [1, 0, 1, 0, 1]
        trained = [r["trained_version"] - v for v, m in zip(r["versions"], mask) if m]
        assert 0 <= min(trained) and max(trained) <= MAX_LAG, r
    generates = json.loads(stats.read_text())["requests"]["/generate"]
    assert generates >= 3 * len(rollouts)  # a request per turn (aborted and untrained episodes add more)
