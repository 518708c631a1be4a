"""Prompt files -> PromptRecords -> token ids, and the resumable order they are sampled in.

A prompt file is ``.jsonl`` (one object per line) or ``.parquet`` (one row per
record; needs pyarrow). Each record is either

    {"prompt": "What is 2 + 3?", "answer": "5"}
    {"messages": [{"role": "system", "content": ...}, {"role": "user", "content": ...}], "answer": "5"}

with an optional ``"meta"`` object; other top-level fields join ``meta`` too. ``meta``
reaches the reward function as keyword arguments.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

from megarl.data.arithmetic import arithmetic_records
from megarl.data.arithmetic_ood import PREFIX as OOD_PREFIX
from megarl.data.arithmetic_ood import ood_records
from megarl.data.repeat_words import PREFIX as REPEAT_PREFIX
from megarl.data.repeat_words import repeat_records
from megarl.errors import ConfigError
from megarl.generator.tokenizer import encode_prompt

logger = logging.getLogger(__name__)

_RECORD_FIELDS = ("prompt", "messages", "answer", "meta")


@dataclass
class PromptRecord:
    # Chat messages; a plain "prompt" record becomes a single user message.
    messages: List[Dict[str, str]]
    answer: str
    meta: Dict[str, Any] = field(default_factory=dict)
    # "file:line" (or "file:row N"), for errors about this record later on.
    source: str = ""

    @property
    def plain_prompt(self) -> Optional[str]:
        """The text of a lone user message (what a plain "prompt" record held), else None."""
        if len(self.messages) == 1 and self.messages[0]["role"] == "user":
            return self.messages[0]["content"]
        return None


@dataclass
class TokenizedPrompt:
    ids: List[int]
    record: PromptRecord


BUILT_IN_SPECS = ("arithmetic", "arithmetic-ood", "repeat", "random")


def load_records(spec: str) -> List[PromptRecord]:
    """The records a data spec names: ``arithmetic:...``, ``arithmetic-ood:...`` and ``repeat:...`` (built in,
    megarl/data/arithmetic.py, arithmetic_ood.py, repeat_words.py) or a .jsonl / .parquet file. ``random:...`` specs
    are token ids, not records: the caller's."""
    if spec.startswith("arithmetic:"):
        return [parse_record(r, f"{spec}#{i}") for i, r in enumerate(arithmetic_records(spec))]
    if spec.startswith(OOD_PREFIX):
        return [parse_record(r, f"{spec}#{i}") for i, r in enumerate(ood_records(spec))]
    if spec.startswith(REPEAT_PREFIX):
        return [parse_record(r, f"{spec}#{i}") for i, r in enumerate(repeat_records(spec))]
    return load_prompts(spec)


def check_data_source(field: str, spec: str, max_prompt_tokens: int) -> int:
    """What `megarl train`'s launcher can check of a data source before any rank starts, with neither a
    tokenizer nor torch: every record of a file, an arithmetic spec's problems, a random spec's numbers.
    Returns the number of prompts; a ConfigError names ``field`` (data.train, data.eval), then the file:line."""
    if spec.startswith("random:"):
        # imported here: an import cycle (random_tokens imports PromptRecord and TokenizedPrompt from here)
        from megarl.data.random_tokens import parse_spec

        return parse_spec(spec, max_prompt_tokens, field)[0]
    try:
        return len(load_records(spec))
    except ConfigError as err:
        raise ConfigError(f"{field}: {err}") from None


def load_prompts(path) -> List[PromptRecord]:
    """Every record of a .jsonl or .parquet prompt file; ConfigError naming file:line on a bad one."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        kind, colon, _ = path.partition(":")
        if colon and "/" not in kind and not os.path.exists(kind):  # a built-in spec's name, misspelled
            near = difflib.get_close_matches(kind, BUILT_IN_SPECS, n=1)
            hint = f"did you mean {near[0]}:...? " if near else ""
            raise ConfigError(
                f"{path}: neither a prompt file nor a built-in data spec ({kind!r} is not one of "
                f"{', '.join(BUILT_IN_SPECS)}); {hint}"
                "specs are arithmetic:<n>:<seed>, arithmetic-ood:<n>:<seed>, repeat:<n>:<seed>, random:..."
            )
        raise ConfigError(f"{path}: prompt file does not exist")
    if path.endswith(".jsonl"):
        records = list(_read_jsonl(path))
    elif path.endswith(".parquet"):
        records = list(_read_parquet(path))
    else:
        raise ConfigError(f"{path}: prompt files must be .jsonl or .parquet")
    if not records:
        raise ConfigError(f"{path}: holds no records")
    return records


def _read_jsonl(path: str) -> Iterator[PromptRecord]:
    with open(path, "rb") as f:  # bytes, decoded line by line: a byte that is not UTF-8 is named by its line
        for lineno, data in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(
                    f"{where}: not UTF-8 (byte 0x{data[exc.start]:02x} at column {exc.start + 1})"
                ) from None
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                # exc.pos, not exc.colno: an error at the line's end falls on its newline, which json
                # counts as the start of a second line (column 1)
                raise ConfigError(f"{where}: not valid JSON ({exc.msg} at column {exc.pos + 1})") from exc
            yield parse_record(raw, where)


def _read_parquet(path: str) -> Iterator[PromptRecord]:
    # imported here: optional in practice (a machine without pyarrow gets the message below, test_data.py),
    # and pyarrow.parquet costs ~0.13 s that megarl's CLI (which imports this module) pays only for .parquet
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ConfigError(
            f"{path}: reading .parquet prompt files needs pyarrow (pip install pyarrow), or convert the file to .jsonl"
        ) from exc
    for row, raw in enumerate(pq.read_table(path).to_pylist(), start=1):
        yield parse_record(raw, f"{path}:row {row}")


def parse_record(raw: Any, where: str) -> PromptRecord:
    """One raw record -> PromptRecord; ``where`` ("file:line") starts every error message."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: a record must be a JSON object, got {type(raw).__name__}")
    has_prompt, has_messages = raw.get("prompt") is not None, raw.get("messages") is not None
    if has_prompt == has_messages:
        raise ConfigError(
            f"{where}: a record needs exactly one of the fields 'prompt' or 'messages'"
            + (" (it has both)" if has_prompt else "")
        )
    if has_prompt:
        if not isinstance(raw["prompt"], str) or not raw["prompt"].strip():
            raise ConfigError(f"{where}: field 'prompt' must be a non-empty string")
        messages = [{"role": "user", "content": raw["prompt"]}]
    else:
        messages = _check_messages(raw["messages"], where)
    answer = raw.get("answer")
    if answer is None:
        raise ConfigError(f"{where}: missing field 'answer'")
    # Numbers are accepted ("answer": 42); the reward compares text through math-verify.
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ConfigError(f"{where}: field 'answer' must be a string or number, got {type(answer).__name__}")
    meta = raw.get("meta") or {}
    if not isinstance(meta, dict):
        raise ConfigError(f"{where}: field 'meta' must be an object, got {type(meta).__name__}")
    extra = {k: v for k, v in raw.items() if k not in _RECORD_FIELDS}
    return PromptRecord(messages=messages, answer=str(answer), meta={**extra, **meta}, source=where)


def _check_messages(messages: Any, where: str) -> List[Dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: field 'messages' must be a non-empty list")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ConfigError(f"{where}: messages[{i}] must be an object with 'role' and 'content'")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ConfigError(f"{where}: messages[{i}] is missing field '{key}' (a string)")
        checked.append({"role": message["role"], "content": message["content"]})
    return checked


def tokenize_prompts(
    records: Sequence[PromptRecord],
    tokenizer,
    max_prompt_tokens: int,
    render: Optional[Callable[[List[Dict[str, str]]], List[int]]] = None,
) -> List[TokenizedPrompt]:
    """Apply the tokenizer's chat template (with the generation prompt) to each record; ``render``
    (messages -> ids), where given, renders every record instead (``rollout.tools``: the tools'
    schemas in the prompt, environments/chat_render.py).

    Prompts over ``max_prompt_tokens`` are dropped with a warning, not truncated: a cut
    prompt can lose the question, and the reward would then grade an unanswerable one.
    """
    if max_prompt_tokens < 1:
        raise ConfigError(f"max_prompt_tokens: must be at least 1, got {max_prompt_tokens}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    kept, longest_dropped = [], 0
    for record in records:
        if render is not None:
            ids = list(render(record.messages))
        else:
            prompt = record.plain_prompt
            if prompt is None:
                if not has_template:
                    raise ConfigError(f"{record.source}: chat 'messages' need a tokenizer with a chat template")
                prompt = record.messages
            ids = encode_prompt(tokenizer, prompt)
        if len(ids) > max_prompt_tokens:
            longest_dropped = max(longest_dropped, len(ids))
            continue
        kept.append(TokenizedPrompt(ids=ids, record=record))
    dropped = len(records) - len(kept)
    if dropped:
        logger.warning(
            "dropped %d of %d prompts longer than max_prompt_tokens=%d (longest %d tokens)",
            dropped,
            len(records),
            max_prompt_tokens,
            longest_dropped,
        )
    if not kept:
        raise ConfigError(f"max_prompt_tokens: all {len(records)} prompts are longer than {max_prompt_tokens} tokens")
    return kept


class PromptStream:
    """Endless stream over ``items``: a fresh seeded shuffle each epoch, resumable.

    The order of epoch ``e`` depends only on (seed, e), so ``state_dict()`` needs just
    the epoch and the position within it, and a run restored from it draws exactly
    the items an unbroken run would have drawn.
    """

    def __init__(self, items: Sequence, seed: int = 0, shuffle: bool = True):
        if not items:
            raise ConfigError("PromptStream: no prompts to draw from")
        self.items = items
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> List[int]:
        order = list(range(len(self.items)))
        if self.shuffle:
            random.Random(f"megarl-prompts:{self.seed}:{epoch}").shuffle(order)
        return order

    def __iter__(self) -> "PromptStream":
        return self

    def __next__(self):
        if self.position == len(self._order):
            self.epoch += 1
            self.position = 0
            self._order = self._epoch_order(self.epoch)
        self.last_index = self._order[self.position]  # which item: a checkpoint can requeue it
        self.position += 1
        return self.items[self.last_index]

    def take(self, n: int) -> list:
        return [next(self) for _ in range(n)]

    def state_dict(self) -> Dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": int(self.shuffle),
            "num_items": len(self.items),
        }

    def load_state_dict(self, state: Dict[str, int]) -> None:
        # A different prompt set or seed would silently replay or skip prompts.
        if state["num_items"] != len(self.items):
            raise ConfigError(
                f"prompt stream: the checkpoint was taken over {state['num_items']} prompts, "
                f"this run has {len(self.items)} (did the prompt file change?)"
            )
        if state["seed"] != self.seed or bool(state["shuffle"]) != self.shuffle:
            raise ConfigError(
                f"prompt stream: the checkpoint used seed {state['seed']} (shuffle "
                f"{bool(state['shuffle'])}), this run seed {self.seed} (shuffle {self.shuffle})"
            )
        if not 0 <= state["position"] <= len(self.items):
            raise ConfigError(f"prompt stream: position {state['position']} is out of range")
        self.epoch = state["epoch"]
        self.position = state["position"]
        self._order = self._epoch_order(self.epoch)
