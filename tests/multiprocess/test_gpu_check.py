"""scripts/gpu_check.sh's driver on CPU: `megarl train` on a machine with only torch and megatron-core.

The check must run where transformers, tokenizers, math-verify, TensorBoard,
PyYAML, tqdm and safetensors are absent (a GPU machine with only PyTorch and a
60 MB wheel budget): a directory first on PYTHONPATH shadows each of them with a
package whose import raises ModuleNotFoundError, in the driver and in every
process it starts, so any import of them on the train path fails the test.
"""

import json
import signal
import subprocess
import sys
import time

import pytest

from megarl.models.presets import preset_spec
from megarl.weight_sync.layouts import sglang_rank_layout
from tests.conftest import ROOT, _env, server_port

BLOCKED = (
    "transformers",
    "tokenizers",
    "math_verify",
    "tensorboard",
    "yaml",
    "tqdm",
    "safetensors",
    "pyarrow",
    "gguf",
    "accelerate",
    "sglang",
    "latex2sympy2_extended",
)


@pytest.mark.slow
@pytest.mark.parametrize("backend, preset", [("torch", "tiny"), ("sglang", "tiny"), ("torch", "tiny-moe")])
def test_gpu_check_runs_megarl_train_with_only_torch_and_megatron(tmp_path, backend, preset):
    """torch: scripts/gpu_check.sh's run, with only torch and megatron-core importable; sglang:
    scripts/gpu_check_sglang.sh's (block fp8, the server launched by the job) with the protocol test
    server in SGLang's place (a machine with SGLang has its dependencies: nothing is hidden);
    tiny-moe: the mixture-of-experts variant's path (a random Qwen3-MoE, its experts synced)."""
    site = tmp_path / "absent"
    for name in BLOCKED:
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError('{name} is not installed on this (simulated) GPU machine', name='{name}')\n"
        )
    env = _env()
    if backend == "torch":
        env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}"
    args = [
        "--device",
        "cpu",
        "--preset",
        preset,
        "--steps",
        "3",
        "--prompts-per-step",
        "4",
        "--samples",
        "2",
        "--prompt-len",
        "8",
        "--max-new-tokens",
        "24",
        "--max-running",
        "8",
        "--microbatch-tokens",
        "64",
        "--workdir",
        str(tmp_path / "work"),
        "--backend",
        backend,
    ]
    if backend == "sglang":
        args += [
            "--sglang-launcher",
            f"{sys.executable} {ROOT / 'tests' / 'sglang_test_server.py'}",
            "--sglang-port",
            str(server_port()),
        ]
    proc = subprocess.run(
        [sys.executable, "-m", "megarl.bench.gpu_check", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # MEGARL_LOG_ACTIVITY: each rank said what it was doing as it went (trainer rank 0 trained)
    assert "megarl activity: rank 0 (trainer) " in proc.stderr and ": training step 1" in proc.stderr
    assert "(generator replica 0, TP rank 0) " in proc.stderr and ": decoding" in proc.stderr
    assert result["backend"] == backend
    assert result["preset"] == preset
    if backend == "torch":
        spec = preset_spec(preset)
        # every element of the generator's shard crossed once, fp32 on the wire (a CPU run's dtype)
        assert result["sync_GB"] * 1e9 == sum(t.covered_numel for t in sglang_rank_layout(spec, 1, 0)) * 4
        assert result["kl_step1"] < 1e-5 and result["ess_step1"] > 1 - 1e-5  # the synced weights are exact
    else:  # block fp8 in the server: close to the trainer's fp32 policy, not equal to it
        assert 0 < result["kl_step1"] < 1e-4
    assert result["steps"] == 3 and result["lag_max"] <= 2 and result["lag_mean"] > 0
    assert result["trainer_tokens_per_s"] > 0 and result["generator_tokens_per_s"] > 0 and result["sync_seconds"] > 0
    assert result["trainer_mfu_datasheet"] is None  # no datasheet peak for a CPU
    if preset == "tiny-moe":  # top 2 of 4 experts: fewer parameters per token than in the model
        assert result["active_parameters_B"] < result["parameters_B"]


@pytest.mark.slow
def test_gpu_check_stopped_by_sigterm_keeps_each_step_line_and_a_partial_summary(tmp_path):
    """What `timeout` does to the check at a GPU window's end: the steps done stay in --results
    (written as produced), the summary of those steps is written and printed, nothing is left running."""
    results = tmp_path / "results.jsonl"
    args = ["--device", "cpu", "--preset", "tiny", "--mode", "sync", "--steps", "50", "--prompts-per-step", "2"]
    args += ["--samples", "2", "--prompt-len", "8", "--max-new-tokens", "16", "--max-running", "4"]
    args += ["--microbatch-tokens", "64", "--workdir", str(tmp_path / "work"), "--results", str(results)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "megarl.bench.gpu_check", *args],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    deadline = time.time() + 600
    while (
        sum(json.loads(x)["kind"] == "step" for x in (results.read_text() if results.exists() else "").splitlines()) < 2
    ):
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0  # stopped, not finished
    lines = [json.loads(x) for x in results.read_text().splitlines()]
    kinds = [x["kind"] for x in lines]
    assert kinds[0] == "startup" and kinds[-1] == "result" and set(kinds[1:-1]) == {"step"}
    steps = [x["step"] for x in lines if x["kind"] == "step"]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 2
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary == {k: v for k, v in lines[-1].items() if k != "kind"}  # the printed line is the file's last
    assert (
        summary["complete"] is False and summary["steps"] >= len(steps) and summary["exit_code"] == 128 + signal.SIGTERM
    )
    assert not (tmp_path / "work" / "run" / "checkpoints").exists()
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(tmp_path / "work") not in ps  # the job's ranks were ended with the driver
