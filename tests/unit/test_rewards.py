"""Rewards: math-verify verdicts, per-sample timeouts in the scoring workers, user rewards by path."""

from __future__ import annotations

import sys
import textwrap

import pytest

from megarl.errors import ConfigError
from megarl.rewards import (
    boxed_format_reward,
    math_reward,
    register_reward,
    resolve_reward,
    reward_spec,
    score_batch,
)

# (gold answer, response, verdict)
MATH_CASES = [
    ("42", "The answer is 42.", 1.0),
    ("42", "12 + 30 = 42, so the answer is \\boxed{42}.", 1.0),
    ("42", "I think it is 41. The answer is 41.", 0.0),
    ("42", "12 + 30 = 42. Checking: 42 - 30 = 12. The answer is \\boxed{43}.", 0.0),
    ("1234", "Adding them gives 1,234.", 1.0),
    ("-7", "Subtracting, we get $-7$.", 1.0),
    ("1/2", "The probability is $\\frac{1}{2}$.", 1.0),
    ("\\frac{1}{2}", "So the result is \\boxed{0.5}", 1.0),
    ("\\frac{3}{4}", "\\boxed{\\frac{6}{8}}", 1.0),
    ("\\frac{3}{4}", "\\boxed{\\frac{3}{5}}", 0.0),
    ("\\sqrt{2}", "The side is $\\sqrt{2}$.", 1.0),
    ("2\\pi", "The circumference is \\boxed{2\\pi}.", 1.0),
    ("x^2 + 2x + 1", "Expanding gives \\boxed{(x+1)^2}", 1.0),
    ("42", "I don't know.", 0.0),
    ("42", "", 0.0),
]


def math_verify_verdict(gold: str, response: str) -> float:
    """math-verify used directly, as its README shows: the gold in $...$, parse, verify."""
    from math_verify import parse, verify

    return 1.0 if verify(parse(gold if "$" in gold else f"${gold}$"), parse(response)) else 0.0


# A numeric gold answer needs a number: restating the sum is not answering it, although
# math-verify alone finds "9 + 45" equal to 54 (the CPU demo's policy learned to write that).
# (gold, response, math-verify's own verdict, the math reward's)
NUMERIC_CASES = [
    ("54", "9 + 45 represents your final answer.", 1.0, 0.0),
    ("54", "\\boxed{9+45}", 1.0, 0.0),
    ("1472", "16 × 92 equals 16 * 92.", 1.0, 0.0),
    ("54", "The answer is $\\frac{108}{2}$", 1.0, 1.0),  # latex that evaluates to a number is one
    ("3.5", "\\boxed{\\frac{7}{2}}", 1.0, 1.0),
    ("54", "\\boxed{53}", 0.0, 0.0),
    ("2\\sqrt{2}", "\\boxed{\\sqrt{8}}", 1.0, 1.0),  # a symbolic gold answer: equivalence as before
]


@pytest.mark.parametrize("gold,response,expected", MATH_CASES)
def test_math_reward_matches_math_verify(gold, response, expected):
    assert math_verify_verdict(gold, response) == expected
    assert math_reward(response, gold) == expected


@pytest.mark.parametrize("gold,response,verdict,expected", NUMERIC_CASES)
def test_a_numeric_answer_must_be_stated_as_a_number(gold, response, verdict, expected):
    assert math_verify_verdict(gold, response) == verdict
    assert math_reward(response, gold) == expected


def test_unparseable_gold_is_an_error_not_a_zero_that_hides_it():
    from megarl.rewards.math_verify_reward import parse_gold

    with pytest.raises(ValueError, match="could not be parsed"):
        parse_gold("")


def test_boxed_format_reward():
    assert boxed_format_reward("so \\boxed{12}", "5") == 1.0
    assert boxed_format_reward("The answer is \\boxed{}.", "5") == 0.0
    assert boxed_format_reward("The answer is 5.", "5") == 0.0


USER_MODULE = "megarl_test_user_reward"


@pytest.fixture(scope="module")
def user_reward_module(tmp_path_factory):
    """A user reward module on sys.path (the spawned workers inherit sys.path)."""
    root = tmp_path_factory.mktemp("user_reward")
    (root / f"{USER_MODULE}.py").write_text(
        textwrap.dedent("""
        import os, time

        def exact(response_text, answer, **kwargs):
            # "hang" stands for a pathological sample; the others fail in other ways.
            if response_text == "hang":
                time.sleep(120)
            if response_text == "crash":
                os._exit(3)
            if response_text == "raise":
                raise KeyError("boom")
            return float(response_text == answer) + kwargs.get("bonus", 0.0)
    """)
    )
    sys.path.insert(0, str(root))
    yield f"{USER_MODULE}:exact"
    sys.path.remove(str(root))
    sys.modules.pop(USER_MODULE, None)


def test_dotted_path_user_reward_loads(user_reward_module):
    fn = resolve_reward(user_reward_module)
    assert fn.__module__ == USER_MODULE and fn("7", "7") == 1.0
    assert reward_spec(fn) == user_reward_module
    assert resolve_reward("math") is math_reward


@pytest.mark.parametrize(
    "spec,message",
    [
        ("no_such_reward", "not a built-in reward"),
        ("no_such_package.module:fn", "cannot import module 'no_such_package.module'"),
        ("megarl.rewards.registry:no_such_fn", "has no attribute 'no_such_fn'"),
        ("megarl.rewards.registry:FIELD", "not a function"),
    ],
)
def test_unresolvable_reward_names_the_field(spec, message):
    with pytest.raises(ConfigError, match="reward.function") as info:
        resolve_reward(spec)
    assert message in str(info.value)


def test_reward_without_importable_name_is_rejected():
    with pytest.raises(ConfigError, match="module-level function"):
        reward_spec(lambda response, answer: 1.0)


def test_register_reward_by_name():
    @register_reward("test_length")
    def length_reward(response_text, answer, **kwargs):
        return float(len(response_text))

    assert resolve_reward("test_length") is length_reward
    with pytest.raises(ConfigError, match="already registered"):
        register_reward("test_length")(lambda r, a: 0.0)


def test_batch_length_mismatch_and_bad_timeout():
    with pytest.raises(ConfigError, match="2 responses but 1 answers"):
        score_batch(["a", "b"], ["a"], "math", timeout_s=1.0)
    with pytest.raises(ConfigError, match="reward.timeout_s"):
        score_batch(["a"], ["a"], "math", timeout_s=0)
