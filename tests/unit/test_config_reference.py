"""The config reference (megarl/config_reference.py, `megarl config`, docs/config-reference.md):
generated from the typed sections, every field described, the page in step with the code."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from megarl import config_reference
from megarl.cli import main
from megarl.config import CHOICES, Config, RolloutConfig, load_config
from megarl.config_reference import DOCS_PAGE, reference_markdown, sections, undescribed
from megarl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def _leaf_fields(cls, prefix=""):
    """Every non-section field of the config, by walking the dataclasses (independently of the reference)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _leaf_fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


def test_every_field_and_section_has_a_description():
    assert undescribed() == []


def test_a_field_without_its_comment_is_named(monkeypatch):
    comments = config_reference._field_comments

    def without(cls):
        out = comments(cls)
        if cls is RolloutConfig:
            out["samples_per_prompt"] = ""  # the comment deleted
        return out

    monkeypatch.setattr(config_reference, "_field_comments", without)
    assert undescribed() == ["rollout.samples_per_prompt"]


def test_the_docs_page_is_the_reference_of_the_code():
    page = (ROOT / DOCS_PAGE).read_text()
    assert page == reference_markdown(), f"{DOCS_PAGE} is stale: run `megarl config > {DOCS_PAGE}`"


def test_every_field_is_listed_once_with_its_default_and_choices():
    listed = [f.name for s in sections() for f in s.fields if f.type != "section"]
    assert sorted(listed) == sorted(_leaf_fields(Config)) and len(listed) == len(set(listed))
    fields = {f.name: f for s in sections() for f in s.fields}
    assert fields["rollout.samples_per_prompt"].default == str(RolloutConfig().samples_per_prompt) == "4"
    assert fields["rollout.samples_per_prompt"].type == "int"
    assert fields["trainer.etp"].type == "int or null" and fields["trainer.etp"].default == "null"
    assert fields["rollout.tools"].type == "list of str" and fields["rollout.tools"].default == "[]"
    assert fields["run.mode"].choices == ("async", "sync")
    assert (
        "- **`model.dtype`** (str: `fp32` | `bf16` | `auto`; default `fp32`): trainer parameters"
        in reference_markdown()
    )
    assert [s.name for s in sections()][:2] == ["model", "trainer"] and "reward.judge" in [s.name for s in sections()]


@pytest.mark.parametrize("name", sorted(CHOICES))
def test_each_listed_choice_is_what_validation_enforces(name):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{name}=bogus"])
    assert str(err.value) == f"override {name}=bogus: {name}: 'bogus' is not one of {list(CHOICES[name])}"


def test_megarl_config_prints_a_section_or_a_field(capsys):
    assert main(["config", "rollout"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("## rollout\n") and "`rollout.max_lag`" in out and "`trainer.tp`" not in out
    assert main(["config", "rollout.max_lag"]) == 0
    assert (
        capsys.readouterr().out
        == "- **`rollout.max_lag`** (int; default `2`): steps a token may be behind the trained policy (async); sync is always 0\n"
    )
    assert main(["config"]) == 0
    assert capsys.readouterr().out == reference_markdown()


def test_megarl_config_of_a_misspelled_section_suggests_the_name(capsys):
    assert main(["config", "rolout"]) == 2
    assert capsys.readouterr().err == "error: megarl config rolout: no such section or field; did you mean rollout?\n"
