"""Synthetic arithmetic word problems with exact integer answers, for RL smoke runs.

``megarl data arithmetic --n N --seed S --out FILE.jsonl [--digits D]`` writes one
``{"prompt": ..., "answer": "123", "meta": {...}}`` record per line.

Difficulty: each operand gets between 1 and ``digits`` digits, drawn per problem,
so a set mixes easy problems (7 + 5) with hard ones (384 x 629) and a small model
(SmolLM2-135M-Instruct) gets some right from the start: RL needs a nonzero reward
rate. Subtraction never goes negative, for the same reason.

Answer format: the prompt asks for the final answer in ``\\boxed{}``. The ``math``
reward (math-verify) ranks a boxed answer above everything else in the response,
and the box delimits the answer exactly, whereas "The answer is N" relies on a
number found within 50 characters after the word "answer" -- and a response
that never says "answer" falls back to its last number. Responses that do write
"The answer is 42." still score, since math-verify extracts that too.
"""

from __future__ import annotations

import json
import os
import random
from typing import Dict, List

from megarl.errors import ConfigError

MAX_DIGITS = 6

ANSWER_INSTRUCTION = "Put your final answer in \\boxed{}."

_NAMES = [
    "Ava",
    "Ben",
    "Chloe",
    "Dev",
    "Emma",
    "Farid",
    "Grace",
    "Hugo",
    "Iris",
    "Jon",
    "Kai",
    "Lena",
    "Mia",
    "Noah",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sam",
    "Tara",
]
_ITEMS = ["apples", "marbles", "stickers", "books", "coins", "pencils", "shells", "cards", "stamps", "beads"]
_CONTAINERS = ["boxes", "bags", "jars", "crates", "baskets", "shelves"]

# Each operator: (symbol in the meta expression, result, templates). Templates take a, b,
# name, items, container; phrasings vary so the policy learns arithmetic, not one sentence.
_TEMPLATES = {
    "+": [
        "{name} has {a} {items} and gets {b} more. How many {items} does {name} have now?",
        "A shop sold {a} {items} in the morning and {b} in the afternoon. How many {items} did it sell in total?",
        "What is {a} + {b}?",
    ],
    "-": [
        "{name} had {a} {items} and gave away {b}. How many {items} does {name} have left?",
        "A library had {a} {items}. {b} were taken out. How many {items} remain?",
        "What is {a} - {b}?",
    ],
    "*": [
        "There are {a} {container} with {b} {items} in each. How many {items} are there in total?",
        "{name} buys {a} packs of {items}, each holding {b}. How many {items} does {name} buy?",
        "What is {a} \u00d7 {b}?",
    ],
}


def _operand(rng: random.Random, digits: int) -> int:
    # Digit count first, then a value with exactly that many digits: without this,
    # almost every operand would have the maximum number of digits.
    width = rng.randint(1, digits)
    low = 0 if width == 1 else 10 ** (width - 1)
    return rng.randint(max(low, 1), 10**width - 1)


def make_problem(rng: random.Random, digits: int) -> Dict:
    op = rng.choice(sorted(_TEMPLATES))
    a, b = _operand(rng, digits), _operand(rng, digits)
    if op == "-" and b > a:
        a, b = b, a
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    question = rng.choice(_TEMPLATES[op]).format(
        a=a, b=b, name=rng.choice(_NAMES), items=rng.choice(_ITEMS), container=rng.choice(_CONTAINERS)
    )
    return {
        "prompt": f"{question} {ANSWER_INSTRUCTION}",
        "answer": str(result),
        "meta": {"expression": f"{a} {op} {b}", "digits": digits},
    }


def generate_arithmetic(n: int, seed: int = 0, digits: int = 2) -> List[Dict]:
    """``n`` problems, the same for the same (seed, digits); operands of 1..``digits`` digits."""
    if n < 1:
        raise ConfigError(f"--n: must be at least 1, got {n}")
    if not 1 <= digits <= MAX_DIGITS:
        raise ConfigError(f"--digits: must be between 1 and {MAX_DIGITS}, got {digits}")
    # A string seed is hashed (sha512) by random.Random: stable across runs and platforms,
    # and unrelated streams for neighbouring seeds.
    rng = random.Random(f"megarl-arithmetic:{seed}:{digits}")
    return [make_problem(rng, digits) for _ in range(n)]


def problem_key(record: Dict) -> tuple:
    """(operator, operands) of a problem; + and x commute, so their operands are unordered."""
    a, op, b = record["meta"]["expression"].split()
    a, b = int(a), int(b)
    return (op, min(a, b), max(a, b)) if op in "+*" else (op, a, b)


def generate_heldout(n: int, seed: int, exclude: List[Dict], digits: int = 2) -> List[Dict]:
    """``n`` problems sharing no (operator, operands) pair with ``exclude`` (nor with each other),
    drawn from their own stream: a held-out set disjoint from a training set by construction."""
    taken = {problem_key(r) for r in exclude}
    rng = random.Random(f"megarl-arithmetic-heldout:{seed}:{digits}")
    out: List[Dict] = []
    for _ in range(1000 * n):
        problem = make_problem(rng, digits)
        if problem_key(problem) not in taken:
            taken.add(problem_key(problem))
            out.append(problem)
            if len(out) == n:
                return out
    raise ConfigError(
        f"arithmetic held-out set: could not find {n} problems outside the {len(exclude)} excluded "
        f"with {digits}-digit operands"
    )


def arithmetic_records(spec: str) -> List[Dict]:
    """A data spec's problems: ``arithmetic:<n>:<seed>``, or ``arithmetic:<n>:<seed>:heldout:<n>:<seed>``
    -- n problems from seed, none of whose (operator, operands) pairs is in ``arithmetic:<n>:<seed>``
    (the training set: the demo evaluates on ``arithmetic:256:99:heldout:2000:1``)."""
    parts = spec.split(":")
    try:
        if len(parts) == 3:
            return generate_arithmetic(int(parts[1]), int(parts[2]))
        if len(parts) == 6 and parts[3] == "heldout":
            return generate_heldout(int(parts[1]), int(parts[2]), generate_arithmetic(int(parts[4]), int(parts[5])))
    except ValueError:
        pass
    raise ConfigError(
        f"{spec!r}: expected arithmetic:<n>:<seed> or arithmetic:<n>:<seed>:heldout:<train n>:<train seed>"
    )


def write_jsonl(records: List[Dict], path) -> None:
    """One JSON object per line (UTF-8, written to a temporary file then renamed)."""
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


# -- CLI: megarl data arithmetic ----------------------------------------------------------------


def add_data_args(parser) -> None:
    """Arguments of the ``arithmetic`` subparser of ``megarl data``."""
    parser.add_argument("--n", type=int, required=True, help="number of problems")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--digits",
        type=int,
        default=2,
        help=f"most digits per operand, 1-{MAX_DIGITS} (default 2; each operand gets 1..D)",
    )
    parser.add_argument("--out", required=True, help="output .jsonl file")


def run_data(args) -> int:
    records = generate_arithmetic(args.n, seed=args.seed, digits=args.digits)
    write_jsonl(records, args.out)
    print(f"wrote {len(records)} arithmetic problems (seed {args.seed}, up to {args.digits} digits) to {args.out}")
    return 0
