"""The built-in ``math`` reward: math-verify's extraction and equivalence check.

No answer matching is written here: the gold answer and the response are both
parsed by ``math_verify.parse`` and compared by ``math_verify.verify`` (numeric,
symbolic, set and latex equivalence). Only the choice of extraction configs is ours.
"""

from __future__ import annotations

import re
import threading

from megarl.rewards.registry import register_reward

# math_verify and sympy are imported in the functions that use them: every generator rank imports this
# module (megarl.rewards registers the built-ins), whatever its reward, and the GPU check runs where
# math-verify is not installed (tests/multiprocess/test_gpu_check.py); math_verify's import costs 0.4-0.5 s and
# sympy's 0.25-0.35 s (measured 2026-12-03).

# math-verify's own per-call limits (whole seconds: it uses signal.alarm). They only
# work in a process's main thread; the scoring workers call rewards there, and the
# worker's wall-clock limit (megarl.rewards.scoring) is the hard guard either way.
MATH_VERIFY_TIMEOUT_S = 3

# A gold answer that already carries a delimiter math-verify's latex extraction
# recognises is parsed as written; a bare one ("42", "\sqrt{2}") is wrapped first.
_DELIMITED = re.compile(r"\$|\\boxed|\\\(|\\\[")


def _configs():
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    # Response: a \boxed{} answer wins over anything else (priority 0 instead of the
    # default 50, which ranks it below "final answer is ..." phrases); then latex after
    # an "answer" anchor; then a number/expression after "answer" ("The answer is 42.");
    # the last number or expression in the text is the final fallback.
    response = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
    # Gold: the answer field holds just the answer, so math-verify's default targets.
    gold = (LatexExtractionConfig(), ExprExtractionConfig())
    return gold, response


def _limit():
    # signal.alarm raises ValueError outside the main thread; there math-verify must
    # run unguarded and the caller's timeout (the scoring worker) is the guard.
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def parse_gold(answer: str):
    """The gold answer as math-verify objects; raises ValueError when nothing parses."""
    from math_verify import parse

    text = str(answer).strip()
    # A bare latex answer like "\sqrt{2}" is not found by latex extraction without an
    # environment (and expression extraction would read it as the number 2), so it is
    # wrapped in \boxed{}, which math-verify unwraps with balanced braces.
    wrapped = text if _DELIMITED.search(text) else f"\\boxed{{{text}}}"
    gold_config, _ = _configs()
    parsed = parse(wrapped, extraction_config=gold_config, parsing_timeout=_limit())
    if not parsed:
        raise ValueError(f"gold answer {answer!r} could not be parsed by math-verify")
    return parsed


def parse_response(response_text: str):
    """The final answer math-verify extracts from a model response ([] when none)."""
    from math_verify import parse

    _, response_config = _configs()
    return parse(response_text, extraction_config=response_config, parsing_timeout=_limit())


def states_a_number(parsed) -> bool:
    """Whether math-verify's parse is a number (42, -3, 2.5, 7/2 once evaluated), not an expression."""
    import sympy

    return bool(parsed) and isinstance(parsed[0], sympy.Number)


@register_reward("math")
def math_reward(response_text: str, answer: str, **kwargs) -> float:
    """1.0 when math-verify finds the response's final answer equal to ``answer``, else 0.0.

    A numeric gold answer needs a numeric final answer. math-verify keeps "9 + 45" as the
    unevaluated sum and finds it equal to 54, so without this rule restating the question
    ("9 + 45 represents your final answer.") scores: the CPU demo's policy learned exactly
    that in 26 steps (63 of its 66 held-out "correct" answers, 2026-12-01). A latex answer
    that evaluates to a number (\frac{108}{2}) is a number here; a symbolic gold answer
    (\\sqrt{2}) is compared by equivalence as before.
    """
    from math_verify import verify

    gold = parse_gold(answer)
    predicted = parse_response(response_text)
    if not predicted:
        return 0.0
    if states_a_number(gold) and not states_a_number(predicted):
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=_limit()) else 0.0


# A \boxed{...} with some non-space content inside.
_BOXED_ANSWER = re.compile(r"\\boxed\s*\{\s*[^{}\s]")


def has_boxed_answer(response_text: str) -> bool:
    return bool(_BOXED_ANSWER.search(response_text))


@register_reward("boxed_format")
def boxed_format_reward(response_text: str, answer: str, **kwargs) -> float:
    """1.0 when the response puts a final answer in \\boxed{} (right or wrong), else 0.0.

    A shaping signal for small models that rarely use the requested format; add it to
    ``math`` with a small weight rather than using it alone.
    """
    return 1.0 if has_boxed_answer(response_text) else 0.0
