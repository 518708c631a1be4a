"""What a user reads when a config is wrong: the nearest name for a misspelled field, and an
override's error blamed on the override, not on the YAML file it was applied over."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config import load_config
from megarl.errors import ConfigError

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml")


def _error(path, overrides=()) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    return str(err.value)


def test_a_misspelled_field_gets_the_nearest_name():
    message = _error(TINY, ["rollout.samples_per_promt=2"])
    assert message.startswith(
        "override rollout.samples_per_promt=2: rollout.samples_per_promt: unknown field; "
        "did you mean rollout.samples_per_prompt? (known: agent, "
    )
    assert "did you mean trainer?" in _error(TINY, ["trainr.tp=2"])
    assert "did you mean" not in _error(TINY, ["rollout.zzzzzz=2"])  # nothing near: no guess


def test_an_override_error_names_the_override_not_the_file():
    assert _error(TINY, ["trainer.tp=two"]) == "override trainer.tp=two: trainer.tp: expected an integer, got 'two'"
    # the last of two overrides of one key is the one applied, and blamed
    assert _error(TINY, ["trainer.tp=1", "trainer.tp=two"]).startswith("override trainer.tp=two: ")
    # a rule across fields names the file and the override it names
    assert _error(TINY, ["generator.replicas=3"]) == (
        f"{TINY} with override generator.replicas=3: rollout.prompts_per_step=4 must be a multiple of "
        "generator.replicas=3 (each replica makes an equal share)"
    )


def test_an_error_in_the_file_still_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  tp: two\n")
    assert _error(str(bad), ["run.steps=3"]) == f"{bad}: trainer.tp: expected an integer, got 'two'"


@pytest.mark.parametrize(
    "override, field, shown",
    [("rollout.temperature=nan", "rollout.temperature", "nan"), ("optimizer.lr=inf", "optimizer.lr", "inf"),
     ("optimizer.lr=.inf", "optimizer.lr", "inf"), ("trainer.kl_coef=nan", "trainer.kl_coef", "nan")],
)  # fmt: skip
def test_nan_and_infinities_are_refused_by_field(override, field, shown):
    """Fields without a range check of their own (a field that has one names its range instead)."""
    assert _error(TINY, [override]) == f"override {override}: {field}: must be a finite number, got {shown}"
    load_config(TINY, [override.split("=")[0] + "=0.5"])  # the same field with a finite value is accepted


@pytest.mark.parametrize("text", ["", "# only a comment\n", "\n\n"])
def test_an_empty_config_file_is_refused_not_run_on_defaults(tmp_path, text):
    empty = tmp_path / "empty.yaml"
    empty.write_text(text)
    assert _error(str(empty)) == f"{empty}: holds no settings (empty or only comments); write {{}} to run every default"
    braces = tmp_path / "defaults.yaml"
    braces.write_text("{}\n")
    assert load_config(str(braces)).run.steps == load_config(None).run.steps  # {}: every default, as said


def test_the_advantage_estimator_is_checked_before_any_rank_and_a_group_of_one_is_refused():
    from megarl.config import CHOICES
    from megarl.trainer.advantages import ESTIMATORS

    assert set(CHOICES["trainer.advantage_estimator"]) == set(ESTIMATORS)  # the config's list is the trainer's
    assert _error(TINY, ["trainer.advantage_estimator=grpo"]) == (
        "override trainer.advantage_estimator=grpo: trainer.advantage_estimator: 'grpo' is not one of "
        "['group_mean', 'rloo']"
    )
    assert "rollout.samples_per_prompt: 1 makes every advantage 0" in _error(TINY, ["rollout.samples_per_prompt=1"])
    load_config(TINY, ["rollout.samples_per_prompt=2", "trainer.advantage_estimator=rloo"])
