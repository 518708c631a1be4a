r"""``repeat``: the reward of the learning bench's repeat-a-word task (megarl/data/repeat_words.py).

The answer is the word ``count`` times, one per line ("fox\nfox\nfox"). Answer and response are split on
whitespace, so the words count and not the separators, and exactly the answer's words score 1.0.
Anything else scores at most 0.5, less the further it is off: 0.5 x (1 - (|hits - count| + others) /
count), floored at 0, where hits counts the response's words equal to the word and others the rest.
The partial credit gives a group of wrong answers an advantage towards the right count (a tiny policy
is rarely exact on a long count at first), and stays below any exact answer, so accuracy (reward >= 1)
means exact.
"""

from __future__ import annotations

from megarl.rewards.registry import register_reward


@register_reward("repeat")
def repeat_reward(response_text: str, answer: str, **meta) -> float:
    target = answer.split()
    if not target:
        raise ValueError("repeat: the answer is empty; it is the word repeated count times")
    words = response_text.split()
    if words == target:
        return 1.0
    count = len(target)
    hits = sum(w == target[0] for w in words)
    others = len(words) - hits
    return 0.5 * max(0.0, 1.0 - (abs(hits - count) + others) / count)
