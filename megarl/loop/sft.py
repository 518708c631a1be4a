"""`megarl sft --config FILE --data FILE.jsonl [--epochs E] [--batch-size N]`: supervised fine-tuning
through the RL trainer's own Megatron step, the loss mask choosing the trained tokens.

What an RL recipe wants before RL (a warm start on a tool-call format, a chat format) and what a user
of Megatron-LM expects from its trainer anyway. The trainer ranks alone run (as ``--replay``), on the
config's trainer, optimizer, LR schedule and checkpoint layout, with ``trainer.loss=sft`` (the mean
negative log-likelihood of the trained tokens). The end is a checkpoint in ``run.output_dir``, so
``model.source`` of the RL run, ``megarl eval`` and ``megarl convert megatron-to-hf`` all read it.

A record is ``{"messages": [..., {"role": "assistant", "content": ...}]}`` (optionally with
``"tools"``, function schemas rendered as ``rollout.tools`` renders an RL prompt, and ``tool``
messages) or ``{"prompt": ..., "response": ...}`` (one user turn, one answer). The prompt is the conversation before the first
assistant message, rendered by the tokenizer's chat template with its generation prompt; each
assistant message is what the template adds for it (its text, end-of-turn and trailing glue), encoded
on its own, so the trainer sees exactly the ids a generation after that context would hold. Every
assistant message is trained (loss mask 1, as TRL's assistant-only loss and verl's multi-turn SFT
do); the prompt and the messages between assistant ones (a tool's answer, a user turn: what an
environment inserts) never are. A record whose rendering rewrites an earlier turn (a later
rendering that does not begin with an earlier one) is refused, naming its line.

Steps: ``batch_size`` records each, reshuffled every epoch with ``run.seed`` (the last, smaller batch
kept), one optimizer step per batch. Metrics go to ``run.output_dir``'s metrics.jsonl and
TensorBoard, as a training run's do.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence

import torch
import torch.distributed as dist

from megarl.environments.chat_render import ChatRenderer
from megarl.errors import ConfigError
from megarl.executors.trainer import TrainerExecutor
from megarl.generator.tokenizer import load_tokenizer
from megarl.loop.wiring import CHECKPOINTS, concrete_config
from megarl.metrics import MetricsWriter
from megarl.rollout import Sample
from megarl.runtime.distributed import init_distributed, shutdown

SFT_LOSS = "sft"


@dataclass
class SftExample:
    prompt_ids: List[int]
    response_ids: List[int]
    source: str  # file:line
    response_mask: List[int]  # 1 on an assistant message's ids, 0 on the turns between them


def _split(tokenizer, messages: List[dict], where: str, template_kwargs: dict) -> tuple:
    """(prompt ids, response ids, response mask): the prompt is the conversation before the first
    assistant message, with the generation prompt; every assistant message is what the template adds
    for it (text, end-of-turn and trailing glue, mask 1), the messages between two assistant ones
    what it adds for them up to the next generation prompt (mask 0). Each piece is encoded on its own,
    as an episode's context is built: the prompt, a sampled turn, the environment's inserted ids."""

    def render(upto: int, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            messages[:upto], tokenize=False, add_generation_prompt=generation_prompt, **template_kwargs
        )

    pieces, done = [], ""
    for j, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if j == 0:
            raise ConfigError(f"{where}: 'messages' needs the prompt's messages before the first assistant one")
        before, after = render(j, True), render(j + 1, False)
        if not (before.startswith(done) and after.startswith(before)):
            raise ConfigError(
                f"{where}: the chat template renders the conversation without its prompt's rendering as a "
                "prefix (it rewrites earlier turns), so the response cannot be split off exactly"
            )
        pieces += [(before[len(done) :], 0), (after[len(before) :], 1)]
        done = after

    def encode(text: str) -> List[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    prompt, response, mask = encode(pieces[0][0]), [], []
    for text, trained in pieces[1:]:
        ids = encode(text)
        if trained and not ids:
            raise ConfigError(f"{where}: the assistant's message renders to no tokens")
        response += ids
        mask += [trained] * len(ids)
    return prompt, response, mask


def _messages(record, where: str) -> List[dict]:
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: a record is a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or len(messages) < 2:
            raise ConfigError(f"{where}: 'messages' needs the prompt's messages and then the assistant's")
        if not all(isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m for m in messages):
            raise ConfigError(f"{where}: every message needs a 'role' and a text 'content'")
        if messages[-1]["role"] != "assistant":
            raise ConfigError(f"{where}: the last message is the trained one and must be the assistant's")
        return messages
    if isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str):
        return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]
    raise ConfigError(f"{where}: needs 'messages', or 'prompt' and 'response' (text)")


def sft_examples(path: Path, tokenizer, max_tokens: int) -> List[SftExample]:
    """Every record of a .jsonl file as prompt and response ids."""
    if tokenizer is None:
        raise ConfigError("megarl sft: model.tokenizer: none has no chat template to render records with")
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("megarl sft: the tokenizer has no chat template")
    if not path.is_file():
        raise ConfigError(f"--data {path}: no such file")
    out, renderer = [], None
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise ConfigError(f"{where}: not JSON ({exc})") from None
        messages, template_kwargs = _messages(record, where), {}
        tools = record.get("tools")
        if tools is not None:  # rendered as rollout.tools renders an RL prompt (environments/chat_render.py)
            if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
                raise ConfigError(f"{where}: 'tools' is a list of function schemas (objects)")
            if renderer is None:
                renderer = ChatRenderer(tokenizer)
            messages, template_kwargs = renderer.template_input(messages, tools)
        ids, response, mask = _split(tokenizer, messages, where, template_kwargs)
        if len(ids) + len(response) > max_tokens:
            raise ConfigError(
                f"{where}: {len(ids) + len(response)} tokens, more than trainer.max_tokens_per_microbatch="
                f"{max_tokens} (one sample must fit one micro-batch)"
            )
        out.append(SftExample(ids, response, where, mask))
    if not out:
        raise ConfigError(f"--data {path}: no records")
    return out


def sft_steps(n: int, batch_size: int, epochs: int, seed: int) -> List[List[int]]:
    """Each step's record indices: every epoch a fresh permutation in batches of ``batch_size``."""
    if batch_size < 1 or epochs < 1:
        raise ConfigError(f"megarl sft: --batch-size and --epochs must be >= 1, got {batch_size} and {epochs}")
    rng = random.Random(seed)
    steps = []
    for _ in range(epochs):
        order = list(range(n))
        rng.shuffle(order)
        steps += [order[i : i + batch_size] for i in range(0, n, batch_size)]
    return steps


def to_samples(examples: Sequence[SftExample], version: int) -> List[Sample]:
    """Trainer samples: the assistant messages trained (mask 1), each its own group with reward 0 (the sft loss
    reads neither advantages nor behaviour log-probs)."""
    return [
        Sample(
            list(e.prompt_ids),
            list(e.response_ids),
            [0.0] * len(e.response_ids),
            [version] * len(e.response_ids),
            reward=0.0,
            group_id=i,
            finish_reason="stop",
            loss_mask=list(e.response_mask),
        )
        for i, e in enumerate(examples)
    ]


def sft_rank(cfg_dict: dict, prepared, data: str, epochs: int, batch_size: int) -> None:
    cfg = concrete_config(cfg_dict)
    if cfg.trainer.loss != SFT_LOSS:
        raise ConfigError(f"trainer.loss: megarl sft trains with {SFT_LOSS!r}, got {cfg.trainer.loss!r}")
    init_distributed()
    examples = sft_examples(Path(data), load_tokenizer(prepared.tokenizer), cfg.trainer.max_tokens_per_microbatch)
    steps = sft_steps(len(examples), batch_size, epochs, cfg.run.seed)
    per_epoch = len(steps) // epochs
    trainer = TrainerExecutor(cfg, prepared, None, cfg.layout().lag_bound, on_gpu=torch.cuda.is_available())
    out = Path(cfg.run.output_dir)
    writer = None
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
        writer = MetricsWriter(out, len(steps), 0, progress=cfg.run.progress)
    losses = []
    for step, indices in enumerate(steps, 1):
        metrics = trainer.step(to_samples([examples[i] for i in indices], trainer.version))
        losses.append(metrics["loss"])
        if writer is not None:
            writer.write(
                {
                    "step": step,
                    "sft": True,
                    "epoch": (step - 1) // per_epoch + 1,
                    **{k: v for k, v in metrics.items() if not isinstance(v, (list, dict))},
                }
            )
    # the weights for model.source=RUN_DIR/checkpoints (an RL run of its own output dir starts from them)
    checkpoint = trainer.save_checkpoint(out / CHECKPOINTS, len(steps), {"step": len(steps), "sft": True})
    if writer is not None:
        writer.close()
        summary = {
            "steps": len(steps),
            "records": len(examples),
            "epochs": epochs,
            "losses": losses,
            "checkpoint": str(checkpoint),
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    shutdown()
