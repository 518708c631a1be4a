"""A second held-out arithmetic set, off the training generator's distribution:
``arithmetic-ood:<n>:<seed>``.

The demo trains on ``arithmetic:<n>:<seed>`` (arithmetic.py): operands of 1-2 digits, results
never negative, a dozen word-problem and "What is a op b?" templates, and every prompt ends with
"Put your final answer in \\boxed{}.". A recipe can gain on a held-out set of that generator by
teaching the model to answer in its one form, and lose what it could do elsewhere (issue 32: the
demo's checkpoints fell from 32.5% to 13.0% on such a set). This set shares nothing with the
training generator, by construction:

- every problem has an operand of 3 or more digits (round ones: tens or hundreds, so that a
  135M model gets some right), a negative operand or a negative result, which the training
  generator never makes (so no problem of any ``arithmetic:`` set is in it);
- its wordings are its own (no template of arithmetic.py's, and never "What is");
- its instructions ask for other answer forms (the number alone, a "Final answer:" line, working
  then the result, or nothing), never ``\\boxed{}``; the ``math`` reward reads them all (the last
  number of the response where there is no box);
- its names and objects are other ones.
"""

from __future__ import annotations

import random
from typing import Dict, List

from megarl.errors import ConfigError

PREFIX = "arithmetic-ood:"

_PEOPLE = ["Alix", "Bruno", "Carmen", "Dario", "Elif", "Femi", "Gustav", "Hana", "Ilya", "Juno", "Kofi", "Lucia"]
_TEMPLATES = {  # per operator, the two plain wordings first
    "+": [
        "Compute the sum of {a} and {b}.",
        "Add {b} to {a}.",
        "A train covers {a} km before noon and {b} km after. How far does it travel that day?",
        "{p} saved {a} euros in spring and {b} euros in summer. How many euros did {p} save altogether?",
    ],
    "-": [
        "Subtract {b} from {a}.",
        "The temperature was {a} degrees and then dropped by {b} degrees. What is the temperature now?",
        "Calculate {a} minus {b}.",
        "{p}'s account held {a} dollars; a payment of {b} dollars went out. What is the balance?",
    ],
    "*": [
        "Multiply {a} by {b}.",
        "Find the product of {a} and {b}.",
        "A ticket costs {b} euros. How much do {a} tickets cost?",
        "{p} walks {b} metres on each of {a} laps. How many metres is that?",
    ],
}
INSTRUCTIONS = [
    "Reply with the number only.",
    "End your reply with a line 'Final answer: <number>'.",
    "Show your working, then state the result.",
    "",
]


def _operands(rng: random.Random, op: str) -> tuple:
    """(a, b, kind): operands no training problem has: one of at least 3 digits (round: tens or
    hundreds, so the sum stays within a 135M model's reach), a negative one, or a negative result."""
    kind = rng.choice(("round", "negative"))
    if op == "*":
        if kind == "round":
            a, b = rng.randint(1, 9) * rng.choice((100, 110, 120, 150, 200)), rng.randint(2, 5)
        else:
            a, b = -rng.randint(2, 12), rng.randint(2, 9)
    elif op == "+":
        if kind == "round":
            a, b = rng.randint(1, 9) * 100, rng.randint(1, 9) * rng.choice((10, 100))
        else:  # a negative operand
            a, b = -rng.randint(1, 20), rng.randint(1, 20)
    else:
        if kind == "round":
            a, b = rng.randint(2, 9) * 100, rng.randint(1, 9) * 10
        else:  # a negative result
            a = rng.randint(1, 15)
            b = rng.randint(a + 1, 25)
    if op != "-" and rng.random() < 0.5:
        a, b = b, a
    return a, b, kind


def make_problem(rng: random.Random) -> Dict:
    op = rng.choice(sorted(_TEMPLATES))
    a, b, kind = _operands(rng, op)
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    # a word problem of a negative count or distance would not read: negative operands get the plain ones
    templates = _TEMPLATES[op] if kind == "round" or op == "-" else _TEMPLATES[op][:2]
    question = rng.choice(templates).format(a=a, b=b, p=rng.choice(_PEOPLE))
    instruction = rng.choice(INSTRUCTIONS)
    return {
        "prompt": f"{question} {instruction}".strip(),
        "answer": str(result),
        "meta": {"expression": f"{a} {op} {b}", "set": "arithmetic-ood"},
    }


def ood_records(spec: str) -> List[Dict]:
    """``arithmetic-ood:<n>:<seed>``: n problems, the same for the same seed, no two alike."""
    parts = spec.split(":")
    try:
        n, seed = int(parts[1]), int(parts[2])
        if len(parts) != 3 or n < 1:
            raise ValueError
    except (ValueError, IndexError):
        raise ConfigError(f"{spec!r}: expected arithmetic-ood:<n>:<seed> with n >= 1") from None
    rng = random.Random(f"megarl-arithmetic-ood:{seed}")
    out, seen = [], set()
    for _ in range(100 * n):
        problem = make_problem(rng)
        key = (problem["meta"]["expression"], problem["prompt"])
        if key not in seen:
            seen.add(key)
            out.append(problem)
            if len(out) == n:
                return out
    raise ConfigError(f"{spec!r}: could not draw {n} distinct problems")
