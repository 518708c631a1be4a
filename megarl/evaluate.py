"""`megarl eval --checkpoint DIR --data FILE.jsonl`: greedy accuracy of a policy on a prompt set.

The checkpoint (a training run's, a converted one, an HF dir, or ``smollm2``)
is loaded by Megatron-Core at TP 1, copied into megarl's torch engine (the
same path sync-mode training uses), and every prompt is answered greedily
with continuous batching; rewards come from the reward registry
(math-verify by default). Prints one JSON line with ``accuracy`` and ``n``.

The engine decodes in one dtype, chosen by this rule (``dtype_rule``): ``--dtype``
if given (``auto``: what ``model.dtype: auto`` picks on this machine,
runtime/cpu_dtype.py); else, for a training run's checkpoint, the run's
``generator.dtype`` from its RUN_DIR/config.json -- the dtype its rollouts and its
evaluations during training were decoded in; else (a converted checkpoint, an HF
dir, ``smollm2``) fp32. The checkpoint's weights are read in the dtype they were
saved in and cast to it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch


def _checkpoint_dir(checkpoint: str, cache_dir: str) -> Path:
    from megarl.checkpointing.megatron_checkpoint import resolve_checkpoint_dir
    from megarl.config import ModelConfig
    from megarl.model_source import prepare_model

    from megarl.checkpointing.manifest import MANIFEST_FILE

    path = Path(checkpoint)
    if (path / "checkpoints" / "latest_checkpointed_iteration.txt").exists():  # a training run's directory
        path = path / "checkpoints"
    # a root, or one iteration dir (iter_XXXXXXX/); every file is checked against the
    # manifest first, so a damaged checkpoint is named here and not deep inside torch
    if (path / "latest_checkpointed_iteration.txt").exists() or (path / MANIFEST_FILE).exists() or (
            path / "metadata.json").exists():
        return resolve_checkpoint_dir(path, what="--checkpoint", verify="checksums")
    prepared = prepare_model(ModelConfig(source=checkpoint, cache_dir=cache_dir))
    return resolve_checkpoint_dir(prepared.checkpoint, what="--checkpoint", verify="checksums")


def _run_config(ckpt_dir: Path) -> dict:
    """The config.json of the training run a checkpoint (RUN_DIR/checkpoints/iter_N) belongs to; {} if none."""
    path = ckpt_dir.resolve().parent.parent / "config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError:
        return {}


def dtype_rule(requested: str | None, run_config: dict) -> tuple[str, str]:
    """(dtype, where it came from) of `megarl eval`'s engine (the module docstring's rule)."""
    from megarl.runtime.cpu_dtype import resolve_dtype

    if requested is not None:
        if requested == "auto":
            return resolve_dtype("--dtype", "auto", torch.cuda.is_available())[0], "--dtype auto"
        return requested, "--dtype"
    recorded = (run_config.get("generator") or {}).get("dtype")
    if recorded in ("fp32", "bf16"):
        return recorded, "the run's generator.dtype"
    if recorded == "auto":  # a config written before megarl train resolved auto
        return resolve_dtype("generator.dtype", "auto", torch.cuda.is_available())[0], "the run's generator.dtype (auto)"
    return "fp32", "default (no run config)"


def _eval_rank(ckpt_dir: str, tokenizer_dir: str, data: str, max_new_tokens: int, reward: str, batch: int,
               out: str, dump: str | None = None, dtype: str = "fp32") -> None:
    from megarl.generator.interface import GenerationRequest, SamplingParams
    from megarl.generator.tokenizer import load_tokenizer, stop_ids
    from megarl.generator.torch_engine.engine import TorchEngine
    from megarl.data.datasets import load_records, tokenize_prompts
    from megarl.models.loading import load_llama
    from megarl.rewards.scoring import score_batch
    from megarl.runtime.distributed import ParallelLayout, init_distributed, init_megatron, shutdown
    from megarl.weight_sync.colocated import copy_colocated
    from megarl.weight_sync.endpoints import allocate_generator_params

    init_distributed()
    init_megatron(ParallelLayout(1, 1))
    spec, chunks = load_llama(ckpt_dir, ParallelLayout(1, 1))  # in the dtype it was saved in
    # decoded in the dtype of dtype_rule: the checkpoint's weights are cast into it by the copy
    params = allocate_generator_params(spec, 1, 0, torch.bfloat16 if dtype == "bf16" else torch.float32)
    copy_colocated(spec, chunks, params)
    del chunks
    tokenizer = load_tokenizer(tokenizer_dir)
    prompts = tokenize_prompts(load_records(data), tokenizer, 512)
    longest = max(len(p.ids) for p in prompts)
    engine = TorchEngine(spec, params, max_running=batch, max_seq_len=longest + max_new_tokens + 1)
    sp = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=stop_ids(tokenizer))
    engine.submit([GenerationRequest(str(i), p.ids, sp, group_id=i) for i, p in enumerate(prompts)])
    start = time.perf_counter()
    done = sorted(engine.run_until_idle(), key=lambda c: c.group_id)
    texts = [tokenizer.decode(c.output_ids, skip_special_tokens=True) for c in done]
    scores = score_batch(texts, [p.record.answer for p in prompts], reward, timeout_s=10.0)
    result = {"checkpoint": ckpt_dir, "data": data, "n": len(done),
              "accuracy": sum(s.score >= 1.0 for s in scores) / len(done),
              "reward_mean": sum(s.score for s in scores) / len(done),
              "generate_s": time.perf_counter() - start, "example": texts[0][:200], "dtype": dtype}
    Path(out).write_text(json.dumps(result))
    if dump:
        with open(dump, "w") as f:
            for p, text, score in zip(prompts, texts, scores):
                f.write(json.dumps({"prompt": p.record.messages, "answer": p.record.answer, "response": text,
                                    "reward": score.score, "reason": score.reason}) + "\n")
    shutdown()


def evaluate(checkpoint: str, data: str, max_new_tokens: int = 64, reward: str = "math", batch: int = 32,
             cache_dir: str = "runs/cache", dump: str | None = None, dtype: str | None = None) -> dict:
    import tempfile

    from megarl.checkpointing.megatron_checkpoint import TOKENIZER_DIR
    from megarl.runtime.launch import run_world

    ckpt_dir = _checkpoint_dir(checkpoint, cache_dir)
    run_config = _run_config(ckpt_dir)
    decode_dtype, source = dtype_rule(dtype, run_config)
    print(f"megarl: eval decodes in {decode_dtype} ({source})", file=sys.stderr, flush=True)
    tokenizer_dir = ckpt_dir / TOKENIZER_DIR
    if not tokenizer_dir.exists():  # a training run from a random model keeps its tokenizer elsewhere
        tokenizer_dir = Path(run_config.get("model", {}).get("tokenizer") or "")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        run_world(_eval_rank, 1, str(ckpt_dir), str(tokenizer_dir), data, max_new_tokens, reward, batch, out,
                  dump and str(Path(dump).resolve()), decode_dtype)
        result = json.loads(Path(out).read_text())
    result["dtype_source"] = source
    print(json.dumps(result), flush=True)
    return result
