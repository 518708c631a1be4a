"""Bad input to `megarl eval` and `megarl train --prepare-only`, given as a new user gives it: each ends
in one line naming the flag, field or file at fault (exit 2, no traceback), before any rank starts or
any model loads. Every case runs the CLI in a subprocess, as a user does (seconds each)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_command

TINY = ROOT / "configs" / "tiny_cpu.yaml"
TRACKER = "latest_checkpointed_iteration.txt"
KINDS = (
    "give a training run's directory, a Megatron checkpoint (root or iter_N/), a Hugging Face model directory, "
    "or smollm2"
)


def _error(args) -> str:
    """The one line a failing command ends with; exit 2 and no traceback, or the test fails."""
    proc = run_command([sys.executable, "-m", "megarl.cli", *args], expect_rc=2, timeout=300)
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    return proc.stderr.strip().splitlines()[-1]


def _eval(checkpoint, tmp_path: Path, data: str = "arithmetic:4:1") -> str:
    return _error(["eval", "--checkpoint", checkpoint, "--data", data, "--cache-dir", tmp_path / "cache"])


def _prepare(tmp_path: Path, *overrides) -> str:
    return _error(["train", "--config", TINY, "--prepare-only", f"run.output_dir={tmp_path / 'run'}", *overrides])


def _bad_jsonl(path: Path) -> Path:
    path.write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n\n{"prompt": "What is 2 + 2?", "answer": 4\n')
    return path


# -- megarl eval --checkpoint -------------------------------------------------------------------


def test_eval_a_tracker_holding_garbage_names_the_file(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / TRACKER).write_text("garbage\n")
    assert _eval(root, tmp_path) == (
        f"error: --checkpoint: {root / TRACKER} holds 'garbage', expected 'release' or an iteration number "
        f"(the file names the checkpoint to load; Megatron-LM and megarl write it)"
    )


def test_eval_a_missing_checkpoint_names_the_flag_not_model_source(tmp_path):
    missing = tmp_path / "nonexistent"
    assert _eval(missing, tmp_path) == f"error: --checkpoint {missing}: no such file or directory; {KINDS}"


def test_eval_an_empty_directory_is_neither_kind_of_checkpoint(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _eval(empty, tmp_path) == (
        f"error: --checkpoint {empty}: neither a Megatron checkpoint (no {TRACKER}) nor a Hugging Face model "
        f"(no config.json)"
    )
    assert not (tmp_path / "cache" / "empty-megatron").exists()  # no conversion was started


def test_eval_a_run_that_saved_nothing_says_so(tmp_path):
    # a run killed before its first save: its config.json is megarl's, no Hugging Face model's
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text('{"run": {"mode": "async"}}')
    (run / "metrics.jsonl").write_text("")
    assert _eval(run, tmp_path) == (
        f"error: --checkpoint {run}: a training run's directory with no checkpoint saved yet "
        f"({run / 'checkpoints' / TRACKER} is missing; a run saves every run.save_every steps and at its end)"
    )


def test_eval_a_random_initialisation_is_not_a_checkpoint(tmp_path):
    assert _eval("random:tiny", tmp_path) == (
        f"error: --checkpoint: random:tiny is a random initialisation, not a checkpoint; {KINDS}"
    )


# -- megarl eval --data (checked before the checkpoint: a bad prompt file costs no model load) -----


def test_eval_a_missing_data_file_names_the_flag_and_file(tmp_path):
    missing = tmp_path / "missing.jsonl"
    assert _eval(tmp_path / "ckpt", tmp_path, str(missing)) == f"error: --data: {missing}: prompt file does not exist"


def test_eval_a_malformed_data_line_names_file_and_line(tmp_path):
    bad = _bad_jsonl(tmp_path / "bad.jsonl")
    assert _eval(tmp_path / "ckpt", tmp_path, str(bad)) == (
        f"error: --data: {bad}:3: not valid JSON (Expecting ',' delimiter at column 42)"
    )


# -- megarl train --prepare-only: every data source checked before a conversion or a rank ----------


def test_prepare_a_missing_train_file_names_data_train(tmp_path):
    missing = tmp_path / "missing.jsonl"
    assert _prepare(tmp_path, f"data.train={missing}") == f"error: data.train: {missing}: prompt file does not exist"


def test_prepare_a_missing_eval_file_names_data_eval(tmp_path):
    missing = tmp_path / "heldout.jsonl"
    assert _prepare(tmp_path, f"data.eval={missing}") == f"error: data.eval: {missing}: prompt file does not exist"


def test_prepare_a_malformed_train_line_names_file_and_line(tmp_path):
    bad = _bad_jsonl(tmp_path / "bad.jsonl")
    assert _prepare(tmp_path, f"data.train={bad}") == (
        f"error: data.train: {bad}:3: not valid JSON (Expecting ',' delimiter at column 42)"
    )


def test_prepare_a_record_without_answer_names_the_field(tmp_path):
    path = tmp_path / "no_answer.jsonl"
    path.write_text('{"prompt": "What is 1 + 1?"}\n')
    assert _prepare(tmp_path, f"data.train={path}") == f"error: data.train: {path}:1: missing field 'answer'"


def test_prepare_a_malformed_arithmetic_spec_names_data_train(tmp_path):
    assert _prepare(tmp_path, "data.train=arithmetic:many:1") == (
        "error: data.train: 'arithmetic:many:1': expected arithmetic:<n>:<seed> or "
        "arithmetic:<n>:<seed>:heldout:<train n>:<train seed>"
    )


def test_prepare_random_prompts_longer_than_allowed_name_the_field(tmp_path):
    assert _prepare(
        tmp_path, "model.tokenizer=none", "reward.function=synthetic_parity", "data.train=random:8:1:200"
    ) == ("error: data.train: 'random:8:1:200': prompts of 200 tokens exceed data.max_prompt_tokens=128")


def test_prepare_a_model_source_tracker_holding_garbage_names_model_source(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / TRACKER).write_text("step 100\n")
    assert _prepare(tmp_path, f"model.source={root}") == (
        f"error: model.source: {root / TRACKER} holds 'step 100', expected 'release' or an iteration number "
        f"(the file names the checkpoint to load; Megatron-LM and megarl write it)"
    )


@pytest.mark.parametrize("data", ["arithmetic:8:1", "random:8:1:16"])
def test_prepare_accepts_good_data_sources(tmp_path, data):
    """The check refuses only what is bad: both built-in forms pass it (and no rank starts)."""
    extra = ["model.tokenizer=none", "reward.function=synthetic_parity"] if data.startswith("random:") else []
    proc = run_command(
        [
            sys.executable,
            "-m",
            "megarl.cli",
            "train",
            "--config",
            TINY,
            "--prepare-only",
            f"run.output_dir={tmp_path / 'run'}",
            f"data.train={data}",
            *extra,
        ],
        timeout=300,
    )
    assert '"world_size": 3' in proc.stdout.strip().splitlines()[-1]


def test_eval_an_unknown_reward_names_the_flag(tmp_path):
    line = _error(["eval", "--checkpoint", tmp_path / "ckpt", "--data", "arithmetic:4:1", "--reward", "maths"])
    assert line.startswith("error: --reward: 'maths' is not a built-in reward (") and line.endswith(
        ") and not a dotted path of the form 'package.module:function'"
    ), line
