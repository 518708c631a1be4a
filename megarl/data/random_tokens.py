"""``data.train: random:<n>:<seed>:<length>``: prompts of random token ids, no tokenizer needed.

For system checks on machines that have only PyTorch (scripts/gpu_check.sh):
n prompts of ``length`` token ids drawn uniformly from the model's vocabulary
with a seeded generator, no answers. Pair with ``model.tokenizer: none`` and a
reward that needs no task (``synthetic_parity``).
"""

from __future__ import annotations

from typing import List, Tuple

from megarl.data.datasets import PromptRecord, TokenizedPrompt
from megarl.errors import ConfigError

PREFIX = "random:"


def parse_spec(source: str, max_prompt_tokens: int, field: str = "data.train") -> Tuple[int, int, int]:
    """(n, seed, length) of a random:<n>:<seed>:<length> spec; ConfigError naming ``field``. Needs no torch:
    `megarl train`'s launcher checks the spec before any rank starts (datasets.check_data_source)."""
    parts = source.split(":")
    try:
        n, seed, length = (int(p) for p in parts[1:])
    except ValueError:
        raise ConfigError(f"{field}: {source!r}: expected random:<n>:<seed>:<length>") from None
    if n < 1 or length < 1:
        raise ConfigError(f"{field}: {source!r}: n and length must be >= 1")
    if length > max_prompt_tokens:
        raise ConfigError(
            f"{field}: {source!r}: prompts of {length} tokens exceed data.max_prompt_tokens={max_prompt_tokens}"
        )
    return n, seed, length


def random_token_prompts(source: str, vocab_size: int, max_prompt_tokens: int) -> List[TokenizedPrompt]:
    import torch

    n, seed, length = parse_spec(source, max_prompt_tokens)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (n, length), generator=g).tolist()
    return [
        TokenizedPrompt(row, PromptRecord([{"role": "user", "content": ""}], "", source=f"{source}#{i}"))
        for i, row in enumerate(ids)
    ]
