"""Prompts to token ids through transformers' tokenizer and the model's chat template."""

from __future__ import annotations

from typing import List, Sequence, Union

Messages = Sequence[dict]


NO_TOKENIZER = "none"  # model.tokenizer for runs on token ids alone (prompts random:..., no transformers)


def load_tokenizer(path):
    """transformers' tokenizer from ``path``; None for ``model.tokenizer: none``."""
    if path == NO_TOKENIZER:
        return None
    # transformers here, not at the top: the launcher imports this module (model_source.py: NO_TOKENIZER)
    # and must not import transformers (tests/multiprocess/test_launch.py), nor may a run on token ids alone (the GPU
    # check, tests/multiprocess/test_gpu_check.py); AutoTokenizer's import costs 2.3-3.0 s there (it pulls in torch;
    # measured 2026-12-03).
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def encode_prompt(tokenizer, prompt: Union[str, Messages], chat: bool = True) -> List[int]:
    """A user prompt (str) or chat messages -> ids, with the generation prompt appended."""
    if chat and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    if not isinstance(prompt, str):
        raise ValueError("chat messages need a tokenizer with a chat template")
    return list(tokenizer(prompt)["input_ids"])


def stop_ids(tokenizer) -> tuple:
    """End-of-sequence ids the model emits (eos, and the chat end-of-turn token when distinct);
    none without a tokenizer (every sample then runs to max_new_tokens)."""
    if tokenizer is None:
        return ()
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for name in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>"):
        tid = tokenizer.convert_tokens_to_ids(name)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
            ids.add(tid)
    return tuple(sorted(ids))
