"""`megarl bench generate`: generation throughput of a backend vs transformers' generate.

One run on this machine, greedy, the same prompts on both sides, two settings:

- ``equal_work``: --batch prompts, exactly --max-new-tokens each (end of
  sequence ignored), so both sides do the same arithmetic;
- ``rollouts``: 4 x --batch prompts, each stopping at its end-of-sequence
  token, as RL rollouts do: transformers runs them --batch at a time, each
  batch until its longest answer ends; the engine keeps --batch sequences in
  flight and admits the next prompt as soon as one finishes. Tokens/s counts
  the tokens actually generated.

``roofline``: this machine's decode roofline for the bench's dtype, batch and
mean context (megarl/bench/roofline.py), measured in the same run; each
setting reports ``engine_fraction_of_roofline``, and ``engine_decode_fraction_of_roofline``
is equal_work's decode alone (the steps after the one that prefills its prompts): the
roofline counts decode FLOPs, not the prompts'. ``--vllm-python`` also runs
vLLM's CPU build (its own interpreter, megarl/bench/vllm_cpu_runner.py) on the
equal_work prompts from the same HF directory.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from megarl.bench.roofline import decode_roofline
from megarl.errors import ConfigError
from megarl.generator.interface import GenerationRequest, SamplingParams
from megarl.generator.tokenizer import encode_prompt, load_tokenizer, stop_ids
from megarl.generator.torch_engine.engine import TorchEngine
from megarl.generator.weights import load_generator_params
from megarl.models.hf_checkpoint import SafetensorsCheckpoint, materialize_gguf, smollm2_gguf_path

QUESTIONS = [
    "What is {a} + {b}?",
    "Compute {a} times {b}.",
    "A shop has {a} apples and sells {b}. How many are left?",
    "Is {a} larger than {b}? Explain briefly.",
    "Write a short poem about the number {a}.",
    "Give {b} reasons to learn arithmetic.",
    "What is {a} minus {b}? Show your work.",
    "Tom has {a} marbles and gets {b} more. How many does he have?",
]


def bench_prompts(tokenizer, n: int):
    prompts = []
    for i in range(n):
        text = QUESTIONS[i % len(QUESTIONS)].format(a=17 * i + 3, b=(i * 7) % 50 + 2)
        prompts.append(encode_prompt(tokenizer, text))
    return prompts


@dataclass(frozen=True)
class GenerateBench:
    backend: str = "torch"
    batch: int = 64
    max_new_tokens: int = 128
    dtype: str = "fp32"
    vllm_python: str = ""
    vllm_dtype: str = "bf16"
    vllm_timeout_s: int = 1800
    roofline: bool = True


def _transformers_run(model, prompts, max_new: int, batch: int, stops) -> tuple:
    """(seconds, tokens generated up to each sequence's end) for generate() in batches."""
    seconds, tokens = 0.0, 0
    for first in range(0, len(prompts), batch):
        chunk = prompts[first : first + batch]
        width = max(len(p) for p in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(chunk):  # left padding, as generate expects
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=list(stops) or None,
                min_new_tokens=0 if stops else max_new,
            )
        seconds += time.perf_counter() - start
        for row in out[:, width:].tolist():
            ends = [i for i, t in enumerate(row) if t in stops]
            tokens += ends[0] + 1 if ends else len(row)
    return seconds, tokens


def _engine_run(engine, prompts, max_new: int, stops) -> tuple:
    """(seconds, tokens, decode seconds, decode tokens): the decode part is every step after
    the first, which prefills the prompts it admits -- all of them when they fit in one batch,
    so then the rest is pure decode, the work the decode roofline describes."""
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new, stop_token_ids=tuple(stops))
    engine.submit([GenerationRequest(str(i), p, params) for i, p in enumerate(prompts)])
    before = engine.stats()["generated_tokens"]
    start = time.perf_counter()
    done = engine.step()
    first_s, first_tokens = time.perf_counter() - start, engine.stats()["generated_tokens"] - before
    done += engine.run_until_idle()
    seconds, tokens = time.perf_counter() - start, sum(len(c.output_ids) for c in done)
    return seconds, tokens, seconds - first_s, tokens - first_tokens


def run(b: GenerateBench) -> dict:
    if b.backend != "torch":
        raise ConfigError(f"--backend {b.backend!r}: only 'torch' runs without a GPU (sglang: see scripts/)")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[b.dtype]
    result = {
        "model": "SmolLM2-135M-Instruct",
        "backend": b.backend,
        "batch": b.batch,
        "dtype": b.dtype,
        "max_new_tokens": b.max_new_tokens,
        "threads": torch.get_num_threads(),
    }
    with tempfile.TemporaryDirectory() as tmp:
        gguf = smollm2_gguf_path()
        model_dir = materialize_gguf(gguf.parent, gguf.name, f"{tmp}/hf")
        tokenizer = load_tokenizer(model_dir)
        prompts = bench_prompts(tokenizer, 4 * b.batch)
        stops = stop_ids(tokenizer)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        hf = SafetensorsCheckpoint(model_dir)
        engine = TorchEngine(
            hf.spec,
            load_generator_params(hf, 1, 0, dtype),
            max_running=b.batch,
            max_seq_len=max(len(p) for p in prompts) + b.max_new_tokens + 1,
        )
        for name, chunk, stop in (("equal_work", prompts[: b.batch], ()), ("rollouts", prompts, stops)):
            hf_s, hf_tokens = _transformers_run(model, chunk, b.max_new_tokens, b.batch, stop)
            engine_s, engine_tokens, decode_s, decode_tokens = _engine_run(engine, chunk, b.max_new_tokens, stop)
            result[name] = {
                "prompts": len(chunk),
                "transformers_tokens": hf_tokens,
                "engine_tokens": engine_tokens,
                "transformers_tokens_per_s": hf_tokens / hf_s,
                "engine_tokens_per_s": engine_tokens / engine_s,
                "engine_over_transformers": (engine_tokens / engine_s) / (hf_tokens / hf_s),
            }
            if name == "equal_work":  # one batch: after the first (prefill) step, decode alone
                result[name]["engine_decode_tokens_per_s"] = decode_tokens / decode_s
        if b.roofline:
            _add_roofline(result, hf.spec, b, prompts[: b.batch])
        if b.vllm_python:
            result["vllm_cpu"] = _vllm_run(b, model_dir, prompts[: b.batch], f"{tmp}/vllm_job.json")
            if "tokens_per_s" in result["vllm_cpu"]:
                result["vllm_cpu"]["engine_over_vllm"] = (
                    result["equal_work"]["engine_tokens_per_s"] / result["vllm_cpu"]["tokens_per_s"]
                )
    print(json.dumps(result), flush=True)
    return result


def _add_roofline(result: dict, spec, b: GenerateBench, prompts) -> None:
    """The decode roofline at the equal_work run's batch and mean context, and each run's fraction of it."""
    context = round(sum(len(p) for p in prompts) / len(prompts) + b.max_new_tokens / 2)
    roof = decode_roofline(spec, b.dtype, b.batch, context)
    result["roofline"] = roof
    for name in ("equal_work", "rollouts"):
        result[name]["engine_fraction_of_roofline"] = result[name]["engine_tokens_per_s"] / roof["tokens_per_s"]
        result[name]["transformers_fraction_of_roofline"] = (
            result[name]["transformers_tokens_per_s"] / roof["tokens_per_s"]
        )
    result["engine_fraction_of_roofline"] = result["equal_work"]["engine_fraction_of_roofline"]
    # The decode roofline counts decode FLOPs only; the runs above also prefill their prompts.
    result["engine_decode_fraction_of_roofline"] = (
        result["equal_work"]["engine_decode_tokens_per_s"] / roof["tokens_per_s"]
    )


def _vllm_run(b: GenerateBench, model_dir, prompts, job_path: str) -> dict:
    """vLLM CPU's tokens/s on the equal_work prompts (vllm_cpu_runner.py under b.vllm_python), or why none."""
    runner = Path(__file__).with_name("vllm_cpu_runner.py")
    if not Path(b.vllm_python).exists():
        return {"error": f"--vllm-python {b.vllm_python}: no such interpreter"}
    Path(job_path).write_text(
        json.dumps(
            {
                "model_dir": str(model_dir),
                "prompts": [list(p) for p in prompts],
                "max_new_tokens": b.max_new_tokens,
                "batch": b.batch,
                "dtype": b.vllm_dtype,
            }
        )
    )
    try:
        proc = subprocess.run(
            [b.vllm_python, str(runner), job_path], capture_output=True, text=True, timeout=b.vllm_timeout_s
        )
    except subprocess.TimeoutExpired:
        return {"error": f"vLLM did not finish within {b.vllm_timeout_s} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return {"error": f"vLLM runner exited {proc.returncode}: " + " | ".join(tail)[-800:]}
    return json.loads(lines[-1])
