r"""Repeat-a-word prompts, ``repeat:<n>:<seed>``, ``repeat:<n>:<seed>:validation`` and ``repeat:<n>:<seed>:heldout``: the learning bench's
task in the demo's regime (docs/learning.md), where the right answer's length varies from prompt to prompt.

    "Write this word 3 times, one per line:\nfox"  ->  "fox\nfox\nfox", then the end-of-turn token

A prompt names a count from 1 to ``MAX_COUNT`` and ends with a word on its own line; the answer is the
word that many times, one per line, and nothing else (the ``repeat`` reward, megarl/rewards/repeat.py).
Every word is one token of SmolLM2's tokenizer (the same token in the prompt and in the answer, so
writing it is copying, and counting is what is learned), and so is the newline: an answer is 2 x count
tokens with the stop token, 2 to 40. The length is the task: a policy, or a sampler, that favours
short answers loses the long prompts.

Held out by construction: each (word, count) pair belongs to one of three parts by a fixed rule
(``part_of``): held-out (a fifth of the pairs), validation (a tenth) and training (the rest), spread so
that every word and every count also occurs in training with other partners. ``repeat:<n>:<seed>`` draws
only training pairs, ``repeat:<n>:<seed>:validation`` and ``repeat:<n>:<seed>:heldout`` only pairs of
their part (distinct pairs, as many as there are), whatever the seeds: no evaluated prompt asks for a pair
any training prompt asks for, so a score is the policy's, not its memory of the prompt. Recipe choices
(learning rate, warm start) are made on the validation part; the held-out part only reports results.
"""

from __future__ import annotations

import random
from typing import Dict, List

from megarl.errors import ConfigError

PREFIX = "repeat:"
MAX_COUNT = 20
# each one token of SmolLM2's tokenizer at the start of a line (checked against the tokenizer's file in
# tests/unit/test_repeat_words.py)
WORDS = (
    "cat dog sun red cup box hat pen map egg bee fox owl car bus key "
    "tree bird fish star moon rain milk book ship door rock leaf coin bell king wolf"
).split()
TEMPLATES = (
    "Write this word {count} times, one per line:\n{word}",
    "Repeat the word below {count} times, each on its own line.\n{word}",
    "{count} lines, each holding only this word:\n{word}",
)
PARTS = ("train", "validation", "heldout")


def part_of(word: str, count: int) -> str:
    """The part (word, count) belongs to: for word i and r = (7i + count) % 10, held-out when r is 0 or 5 (a
    fifth of the pairs), validation when r is 1 (a tenth), training otherwise. Each word keeps 14 of its 20
    counts for training and each count about 7 in 10 of its words."""
    r = (7 * WORDS.index(word) + count) % 10
    return "heldout" if r % 5 == 0 else "validation" if r == 1 else "train"


def _pairs(part: str) -> List[tuple]:
    return [(w, n) for w in WORDS for n in range(1, MAX_COUNT + 1) if part_of(w, n) == part]


def _record(rng: random.Random, word: str, count: int) -> Dict:
    return {
        "prompt": rng.choice(TEMPLATES).format(word=word, count=count),
        "answer": "\n".join([word] * count),
        "meta": {"word": word, "count": count},
    }


def repeat_records(spec: str) -> List[Dict]:
    """A spec's records: ``repeat:<n>:<seed>`` n prompts of training pairs (drawn with replacement, each
    with a random wording), ``repeat:<n>:<seed>:validation`` / ``:heldout`` n distinct pairs of that part."""
    parts = spec.split(":")
    try:
        n, seed = int(parts[1]), int(parts[2])
        part = parts[3] if len(parts) == 4 else "train"
        if len(parts) not in (3, 4) or part not in PARTS[1:] and len(parts) == 4:
            raise ValueError
    except (ValueError, IndexError):
        raise ConfigError(f"{spec!r}: expected repeat:<n>:<seed>[:validation|:heldout]") from None
    pairs = _pairs(part)
    if n < 1:
        raise ConfigError(f"{spec!r}: n must be >= 1, got {n}")
    if part != "train" and n > len(pairs):
        raise ConfigError(f"{spec!r}: the {part} part has {len(pairs)} (word, count) pairs, not {n}")
    # a string seed is hashed (sha512) by random.Random: the parts' streams are unrelated
    rng = random.Random(f"megarl-repeat:{seed}:{part}")
    chosen = [rng.choice(pairs) for _ in range(n)] if part == "train" else rng.sample(pairs, n)
    return [_record(rng, w, c) for w, c in chosen]


def jitter(count: int) -> int:
    """How far the warm start's teacher may miscount ``count``: a sixth of it, rounded half up (0 for counts
    1-2, 1 for 3-8, 2 for 9-14, 3 for 15-20), so the longer the answer the less often the teacher is exact."""
    return (count + 3) // 6


def warm_start_records(n: int, seed: int) -> List[Dict]:
    """``n`` demonstrations for `megarl sft` ({"prompt", "response"}) of ``repeat:<n>:<seed>``'s training
    prompts, written by a teacher that miscounts: the word count + d times, d uniform in +-``jitter(count)``
    (at least once). A policy that imitates it writes the right word about the right number of times, and
    sampled answers spread around the count, wider for long ones: what RL sharpens into the exact count.
    An exact teacher gives a policy that either ignores the count or already counts (docs/learning.md)."""
    rng = random.Random(f"megarl-repeat-teacher:{seed}")
    out = []
    for record in repeat_records(f"{PREFIX}{n}:{seed}"):
        word, count = record["meta"]["word"], record["meta"]["count"]
        written = max(1, count + rng.randint(-jitter(count), jitter(count)))
        out.append({"prompt": record["prompt"], "response": "\n".join([word] * written)})
    return out
