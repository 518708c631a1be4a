"""Sample: its typed fields, the loss mask's default and checks, and samples of older checkpoints."""

import dataclasses

import pytest

from megarl.errors import ConfigError
from megarl.rollout import Sample, length_bucket, sample_from_dict


def _sample(**kw):
    return Sample([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], [0, 0, 1], **kw)


def test_loss_mask_defaults_to_every_response_token():
    s = _sample()
    assert s.loss_mask == [1, 1, 1] and s.trained_tokens == 3
    masked = _sample(loss_mask=[1, 0, 1])
    assert masked.trained_tokens == 2
    assert masked.trained(masked.policy_versions) == [0, 1]


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(loss_mask=[1, 0]), "loss_mask has 2 entries for 3 response tokens"),
        (dict(loss_mask=[1, 2, 0]), "loss_mask holds values other than 0 and 1"),
    ],
)
def test_bad_loss_mask_is_named(kw, message):
    with pytest.raises(ConfigError, match=message):
        _sample(**kw).validate(4)


def test_a_checkpoints_sample_round_trips_and_older_meta_is_read():
    s = _sample(reward=1.0, group_id=7, finish_reason="length", answer="12", loss_mask=[1, 0, 1])
    assert sample_from_dict(dataclasses.asdict(s)) == s
    # checkpoints written before the fields were typed held them in a free-form meta dict
    legacy = ("loss_mask", "finish_reason", "answer", "response_text", "reward_reason", "trainer_logprobs")
    old = {k: v for k, v in dataclasses.asdict(_sample()).items() if k not in legacy}
    old["meta"] = {"finish_reason": "stop", "answer": "3", "response_text": "1 + 2 = 3", "expression": "1 + 2"}
    back = sample_from_dict(old)
    assert (back.finish_reason, back.answer, back.response_text, back.loss_mask) == (
        "stop",
        "3",
        "1 + 2 = 3",
        [1, 1, 1],
    )


def test_length_buckets_are_quarters_of_max_new_tokens():
    edges = {1: 1, 32: 1, 33: 2, 64: 2, 65: 3, 96: 3, 97: 4, 128: 4, 300: 4}  # 300: an episode's several turns
    assert {n: length_bucket(n, 128) for n in edges} == {n: f"len_q{q}" for n, q in edges.items()}
    assert [length_bucket(n, 8) for n in (1, 2, 3, 8)] == ["len_q1", "len_q1", "len_q2", "len_q4"]
