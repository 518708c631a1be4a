"""megarl/bench/gpu_check.py's report, without starting a run: the config it writes, the summary
and per-step lines it assembles from a run's files (also a run cut off mid-way), and
run.save_final, which its --no-final-checkpoint sets."""

import argparse
import json
import types

import pytest

from megarl.bench import gpu_check, mfu
from megarl.config import config_from_dict
from megarl.loop.controller import Controller
from megarl.models.presets import preset_spec


def _args(*argv):
    p = argparse.ArgumentParser()
    gpu_check.add_args(p)
    return p.parse_args(["--device", "cpu", "--preset", "tiny", *argv])


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_the_check_config_is_a_valid_run_config_in_both_modes(mode):
    cfg = config_from_dict(gpu_check.check_config(_args("--mode", mode, "--no-final-checkpoint"), "/tmp/x"))
    assert cfg.run.mode == mode and cfg.run.save_final is False
    # async bounds the lag; sync trains each batch under the policy that made it (no lag to bound)
    assert cfg.rollout.max_lag == (2 if mode == "async" else type(cfg.rollout)().max_lag)
    assert config_from_dict(gpu_check.check_config(_args(), "/tmp/x")).run.save_final is True


def test_save_final_false_skips_only_the_last_steps_checkpoint():
    def saves(save_final: bool, save_every: int) -> list:
        cfg = types.SimpleNamespace(run=types.SimpleNamespace(steps=6, save_every=save_every, save_final=save_final))
        return [s for s in range(1, 7) if Controller._should_save(types.SimpleNamespace(cfg=cfg), s)]

    assert saves(True, 0) == [6]
    assert saves(False, 0) == []
    assert saves(False, 3) == [3, 6]  # save_every's checkpoints stay, the last step's among them
    assert saves(True, 4) == [4, 6]


def _record(step, time_step, time_train, **extra):
    base = dict(
        step=step,
        time_step=time_step,
        time_train=time_train,
        time_generate=0.5,
        time_weight_sync=0.1,
        train_tokens_per_s=100.0 * step,
        generator_tokens_per_s=50.0,
        weight_sync_bytes=0,
        weight_sync_bytes_copied=4000,
        weight_sync_transfer_s=0.002,
        peak_memory_gb=None,
        kl_mu_pi=1e-9,
        ess=1.0,
        lag_mean=0.0,
        lag_max=0,
    )
    return {**base, **extra}


def _rollout(step, prompt, response, versions=(0,)):
    return dict(
        step=step,
        prompt_tokens=[1] * prompt,
        response_tokens=[2] * response,
        loss_mask=[1] * (response - 1) + [0],  # the last response token not trained
        versions=list(versions),
    )


def test_summary_mfu_startup_and_a_run_cut_off_mid_line(tmp_path):
    spec = preset_spec("tiny")
    run = tmp_path / "run"
    run.mkdir()
    records = [_record(1, 3.0, 2.0), _record(2, 1.0, 0.5), _record(3, 1.2, 0.25)]
    rollouts = [_rollout(s, 4, 7) for s in (1, 2, 3) for _ in range(2)] + [_rollout(3, 5, 3, versions=(1, 2))]
    lines = [json.dumps(r) for r in records]
    # the run was killed while writing step 4's record: that partial line is not read
    (run / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 4, "time_st')
    (run / "rollouts.jsonl").write_text("\n".join(json.dumps(r) for r in rollouts) + "\n")
    got = gpu_check.summarize(run, "NVIDIA H200", spec, measured_peak=700e12, first_record_s=20.0)
    assert got["steps"] == 3 and got["complete"] is False  # no summary.json: the run did not end
    # steps 2 and 3 (step 1 warms up): sequences of 4 + 7 - 1 = 10 positions, 6 logit positions, and
    # step 3's third of 5 + 3 - 1 = 7 positions, 2 read; over 0.5 + 0.25 s of trainer time
    flops = mfu.train_step_flops(spec, [(10, 6)] * 4 + [(7, 2)])
    assert flops == 4 * 8232960 + 6 * (7 * 122880 + 2 * 4 * 4 * 16 * 28 + 2 * 64 * 300)  # test_mfu's hand count
    assert got["trainer_tflops"] == pytest.approx(flops / 0.75 / 1e12, rel=1e-12)
    assert got["trainer_mfu_datasheet"] == pytest.approx(flops / 0.75 / 989e12, rel=1e-12)
    assert got["trainer_mfu_measured"] == pytest.approx(flops / 0.75 / 700e12, rel=1e-12)
    # start-up apart from the first step: launch -> step 1's record, less step 1's own time
    assert got["startup_s"] == 17.0 and got["first_step_s"] == 3.0 and got["step_s"] == 1.1
    # sync mode's copy: the bytes it wrote into the engine over its transfer time
    assert got["sync_GB"] == 4e-6 and got["sync_GB_per_s"] == pytest.approx(4e-6 / 0.002)
    assert got["sequences_with_two_versions"] == 1

    line = gpu_check.step_figures(records[1], spec, [(10, 6)] * 2, {"datasheet": 989e12, "measured": None})
    assert line["trainer_mfu_datasheet"] == pytest.approx(2 * 8232960 / 0.5 / 989e12, rel=1e-12)
    assert line["trainer_mfu_measured"] is None and line["step"] == 2


def test_results_lines_are_appended_as_written(tmp_path):
    results = gpu_check.Results(str(tmp_path / "r" / "results.jsonl"), mode="sync", preset="tiny")
    results.write("startup", {"startup_s": 1.5})
    results.write("step", {"step": 1})
    lines = [json.loads(x) for x in (tmp_path / "r" / "results.jsonl").read_text().splitlines()]
    assert lines == [
        {"kind": "startup", "mode": "sync", "preset": "tiny", "startup_s": 1.5},
        {"kind": "step", "mode": "sync", "preset": "tiny", "step": 1},
    ]
    gpu_check.Results(None).write("step", {"step": 1})  # no file asked for: nothing written
