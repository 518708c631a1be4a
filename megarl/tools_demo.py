"""The tools demo's warm start: `megarl data calculator-sft --n N --seed S --out FILE.jsonl`.

SmolLM2-135M, prompted with the calculator's schema (rollout.tools renders it into the system
message, environments/chat_render.py), never writes a ``<tool_call>`` by itself (0 of 64 greedy
answers to training problems, measured 2026-12-07), so RL from it has no tool call to reinforce.
These records show it the format once: for a problem of the training set, the call with the
problem's own expression, the calculator's answer as the tool turn, and a final ``\\boxed{}``
answer. Both assistant turns are trained by `megarl sft`; the tool turn is not (what the
environment inserts in an RL episode). The records carry the calculator's schema as ``tools``, so
`megarl sft` renders them exactly as an RL episode of ``rollout.tools: [calculator]`` is rendered.

The problems are drawn (seeded) from the training set itself (``--train``, default the demo's
``arithmetic:2000:1``), so the held-out sets stay disjoint from everything the model is trained on.
"""

from __future__ import annotations

import json
import random
from typing import Dict, List

from megarl.data.arithmetic import arithmetic_records, write_jsonl
from megarl.environments.calculator import Calculator
from megarl.environments.tool import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, tool_schemas
from megarl.errors import ConfigError


def calculator_call(expression: str) -> str:
    """The assistant's tool-call turn, in the Hermes / Qwen format tool.py parses."""
    body = json.dumps({"name": Calculator.name, "arguments": {"expression": expression}})
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def calculator_sft_records(train: str, n: int, seed: int) -> List[Dict]:
    """``n`` problems of the training set ``train`` (seeded), each as a two-turn calculator episode."""
    problems = arithmetic_records(train)
    if not 1 <= n <= len(problems):
        raise ConfigError(f"--n: between 1 and the {len(problems)} problems of {train}, got {n}")
    calculator = Calculator()
    schemas = tool_schemas({calculator.name: calculator})
    records = []
    for p in random.Random(f"megarl-calculator-sft:{seed}").sample(problems, n):
        expression = p["meta"]["expression"]
        result = calculator({"expression": expression})
        if result != p["answer"]:  # the generator's answer and the tool's must agree
            raise ConfigError(f"{train}: {expression} = {p['answer']}, but the calculator says {result}")
        messages = [
            {"role": "user", "content": p["prompt"]},
            {"role": "assistant", "content": calculator_call(expression)},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": f"{expression} = \\boxed{{{result}}}"},
        ]
        records.append({"messages": messages, "tools": schemas, "answer": p["answer"]})
    return records


def add_calculator_sft_args(parser) -> None:
    parser.add_argument("--train", default="arithmetic:2000:1", help="the training set the problems come from")
    parser.add_argument("--n", type=int, required=True, help="number of records (problems)")
    parser.add_argument("--seed", type=int, default=0, help="which problems (default 0)")
    parser.add_argument("--out", required=True, help="output .jsonl file (megarl sft --data)")


def run_calculator_sft(args) -> int:
    records = calculator_sft_records(args.train, args.n, args.seed)
    write_jsonl(records, args.out)
    print(f"wrote {len(records)} calculator episodes (problems of {args.train}, seed {args.seed}) to {args.out}")
    return 0
