"""`megarl bench train-step`: RL train-step throughput, Megatron path vs plain transformers.

Both sides take the same AIPO optimizer step (Adam, fp32 master weights) on the
same batch of synthetic rollouts of the same model, on this machine, in one run,
in --dtype: fp32, or bf16 mixed precision (Megatron's bf16 model with fp32 main
parameters in its optimizer; transformers' fp32 model under CPU autocast to bf16,
what the HF Trainer's ``bf16=True`` does):

- transformers: LlamaForCausalLM, micro-batches of samples padded to their
  longest, log_softmax over the full vocabulary, loss, backward, AdamW step --
  what a plain PyTorch RL trainer does;
- megarl: PolicyTrainer on Megatron-Core (GPTModel, schedule, DDP, distributed
  optimizer) at TP1 in one process, samples packed into rows of
  --max-tokens positions, fused vocab-parallel log-probs.

The transformers side runs first: on CPU the Megatron side activates the CPU
backend's TorchFunctionMode for the rest of the process. Reports tokens/s of
each (real tokens, prompt + response) and their ratio, and each as a fraction
of this machine's training roofline in --dtype, its attention as long as the
samples' mean length (megarl/bench/roofline.py), measured first in the same run.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from megarl.bench.roofline import train_roofline
from megarl.checkpointing.megatron_checkpoint import TRACKER_FILE
from megarl.checkpointing.model_loading import load_megatron_model
from megarl.config import RolloutConfig, TrainerConfig
from megarl.convert.hf_to_megatron import HfToMegatron, convert
from megarl.models.hf_checkpoint import gguf_spec, smollm2_gguf_path
from megarl.rollout import Sample
from megarl.runtime.distributed import init_distributed, init_megatron, shutdown, world_dims
from megarl.trainer.advantages import compute_advantages
from megarl.trainer.bound_loss import bind_loss
from megarl.trainer.policy_trainer import PolicyTrainer
from megarl.trainer.setup import OptimizerSettings, build_optimizer, wrap_ddp


@dataclass(frozen=True)
class BenchSettings:
    workdir: str = "runs/bench"
    samples: int = 8
    prompt_len: int = 48
    min_response: int = 32
    max_response: int = 160
    micro_batch_samples: int = 4
    max_tokens: int = 512  # configs/demo_cpu.yaml's trainer.max_tokens_per_microbatch
    dtype: str = "fp32"  # or bf16: mixed precision on both sides
    steps: int = 3
    roofline: bool = True
    lr: float = 1e-6
    rho: float = 4.0
    temperature: float = 1.0
    seed: int = 0


def synthetic_samples(s: BenchSettings, vocab_size: int):
    g = torch.Generator().manual_seed(s.seed)
    out = []
    for i in range(s.samples):
        n = int(torch.randint(s.min_response, s.max_response + 1, (1,), generator=g))
        prompt = torch.randint(0, vocab_size, (s.prompt_len,), generator=g).tolist()
        response = torch.randint(0, vocab_size, (n,), generator=g).tolist()
        mu = (-torch.rand(n, generator=g) * 8).tolist()
        out.append(Sample(prompt, response, mu, [0] * n, reward=float(i % 2), group_id=i // 4))
    return out


def _transformers_step(model, optimizer, batch, advantages, s: BenchSettings) -> None:
    optimizer.zero_grad()
    total = sum(len(x.response_tokens) for x in batch)
    for start in range(0, len(batch), s.micro_batch_samples):
        group = list(zip(batch, advantages))[start : start + s.micro_batch_samples]
        width = max(len(x.prompt_tokens) + len(x.response_tokens) for x, _ in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        attn = torch.zeros(len(group), width, dtype=torch.long)
        for row, (x, _) in enumerate(group):
            tokens = x.prompt_tokens + x.response_tokens
            ids[row, : len(tokens)] = torch.tensor(tokens)
            attn[row, : len(tokens)] = 1
        # bf16: the forward under autocast, as the HF Trainer's bf16=True runs it (backward follows its dtypes)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=s.dtype == "bf16"):
            logits = model(ids, attention_mask=attn).logits
        logp_all = torch.log_softmax(logits[:, :-1].float() / s.temperature, -1)
        loss = torch.zeros(())
        for row, (x, adv) in enumerate(group):
            p, r = len(x.prompt_tokens), len(x.response_tokens)
            logp = logp_all[row, p - 1 : p - 1 + r].gather(-1, torch.tensor(x.response_tokens)[:, None]).squeeze(-1)
            weight = torch.exp(logp.detach() - torch.tensor(x.behaviour_logprobs)).clamp(max=s.rho)
            loss = loss - (weight * adv * logp).sum()
        (loss / total).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def _timed(step, steps: int) -> float:
    step()  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(s: BenchSettings) -> dict:
    gguf = smollm2_gguf_path()
    spec = gguf_spec(gguf.parent, gguf.name)
    vocab = spec.vocab_size
    roof = None
    batch = synthetic_samples(s, vocab)
    real_tokens = sum(len(x.prompt_tokens) + len(x.response_tokens) for x in batch)
    if s.roofline:  # before either side: the Megatron side's CPU TorchFunctionMode stays on afterwards
        # attention as long as the samples, not the rows: megarl's packed samples attend per sample
        # (a row-long causal attention would charge the roofline for blocks nobody computes)
        roof = train_roofline(spec, s.dtype, max(1, round(real_tokens / len(batch))))
    hf_s = _transformers_step_time(gguf, batch, compute_advantages(batch), s)

    ckpt = Path(s.workdir) / "smollm2_tp1"
    if not (ckpt / TRACKER_FILE).exists():
        convert(HfToMegatron(str(gguf.parent), str(ckpt), gguf_file=gguf.name))
    mg_s, plan_efficiency = _megatron_step_time(ckpt, batch, s)
    result = {
        "model": "SmolLM2-135M-Instruct",
        "dtype": s.dtype,
        "samples": len(batch),
        "real_tokens": real_tokens,
        "transformers_tokens_per_s": real_tokens / hf_s,
        "megatron_tokens_per_s": real_tokens / mg_s,
        "megatron_over_transformers": hf_s / mg_s,
        "megatron_packing_efficiency": plan_efficiency,
        "transformers_padding_efficiency": _padding_efficiency(batch, s.micro_batch_samples),
        "threads": torch.get_num_threads(),
    }
    if roof is not None:
        result["roofline"] = roof
        result["megatron_fraction_of_roofline"] = result["megatron_tokens_per_s"] / roof["tokens_per_s"]
        result["transformers_fraction_of_roofline"] = result["transformers_tokens_per_s"] / roof["tokens_per_s"]
    print(
        f"train step ({s.dtype}), {len(batch)} samples, {real_tokens} tokens, median of {s.steps}:\n"
        f"  transformers      {result['transformers_tokens_per_s']:8.1f} tokens/s\n"
        f"  megarl (Megatron) {result['megatron_tokens_per_s']:8.1f} tokens/s   "
        f"ratio {result['megatron_over_transformers']:.2f}x",
        flush=True,
    )
    print(json.dumps(result), flush=True)
    return result


def _transformers_step_time(gguf: Path, batch, advantages, s: BenchSettings) -> float:
    """Median seconds of a plain transformers step (the model is freed on return)."""
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
    return _timed(lambda: _transformers_step(model, optimizer, batch, advantages, s), s.steps)


def _padding_efficiency(batch, per_micro_batch: int) -> float:
    lengths = [len(x.prompt_tokens) + len(x.response_tokens) for x in batch]
    padded = sum(
        max(lengths[i : i + per_micro_batch]) * len(lengths[i : i + per_micro_batch])
        for i in range(0, len(lengths), per_micro_batch)
    )
    return sum(lengths) / padded


def _megatron_step_time(ckpt: Path, batch, s: BenchSettings):
    init_distributed()
    layout = world_dims(1, 1)
    init_megatron(layout)
    spec, chunks = load_megatron_model(
        ckpt, layout, params_dtype=torch.bfloat16 if s.dtype == "bf16" else torch.float32
    )
    ddp = wrap_ddp(chunks)
    optimizer = build_optimizer(ddp, OptimizerSettings(lr=s.lr, clip_grad=1.0))
    loss = bind_loss(TrainerConfig(loss_params={"rho": s.rho}), RolloutConfig(temperature=s.temperature), lag_bound=0)
    trainer = PolicyTrainer(ddp, optimizer, spec.vocab_size, loss, s.max_tokens)
    efficiency = trainer.plan(batch).efficiency
    seconds = _timed(lambda: trainer.step(batch), s.steps)
    shutdown()
    return seconds, efficiency
