"""`megarl bench episodes`: multi-turn episodes on megarl's engine with each turn's KV cache parked
for the next, against the same engine prefilling every turn's whole context (what it did before
sessions, and what an engine without prefix reuse does).

One run on this machine, greedy, the same episodes on both sides: SmolLM2-135M-Instruct (shipped
on PyPI), the tools demo's prompts (the held-out arithmetic problems with the calculator described
in the system message, ~220 ids), ``--turns`` turns of up to ``--max-new-tokens`` each, ``--batch``
episodes in flight. Between turns the environment inserts one fixed calculator answer in the chat
template's tool turn, so every episode runs every turn whatever the model writes (SmolLM2 itself
never calls the tool). The arms alternate, ``--repeats`` times each; the JSON reports each arm's
median seconds, the ids each prefilled and the cache kept, and whether both sampled the same ids.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import List

import torch

from megarl.config import RolloutConfig
from megarl.data.datasets import load_records, tokenize_prompts
from megarl.environments.episode import EpisodeSettings, StepResult, Trajectory, Turn
from megarl.environments.factory import chatml_format, prompt_renderer
from megarl.environments.multi_turn import MultiTurnBackend
from megarl.errors import ConfigError
from megarl.generator.interface import GenerationRequest, GeneratorBackend, SamplingParams
from megarl.generator.tokenizer import load_tokenizer, stop_ids
from megarl.generator.torch_engine.engine import TorchEngine
from megarl.generator.weights import load_generator_params
from megarl.models.hf_checkpoint import SafetensorsCheckpoint, materialize_gguf, smollm2_gguf_path

HELDOUT = "arithmetic:{n}:99:heldout:2000:1"


@dataclass(frozen=True)
class EpisodesBench:
    prompts: int = 16
    batch: int = 8
    turns: int = 3
    max_new_tokens: int = 48
    dtype: str = "bf16"
    repeats: int = 2


class ForgetSessions(GeneratorBackend):
    """An engine asked as if no turn belonged to a session: every turn prefills its whole context."""

    def __init__(self, engine: GeneratorBackend):
        self.engine = engine

    def submit(self, requests):
        for r in requests:
            r.session_id = None
        self.engine.submit(requests)

    def step(self):
        return self.engine.step()

    def abort(self, request_ids):
        self.engine.abort(request_ids)

    def update_weights(self, apply):
        return self.engine.update_weights(apply)

    def stats(self):
        return self.engine.stats()


class FixedToolAnswer:
    """Answers every turn with the same tool turn; the episode ends at its turn limit."""

    def __init__(self, insert_ids: List[int]):
        self.insert_ids = insert_ids

    def reset(self, trajectory: Trajectory) -> List[int]:
        return []

    def step(self, turn: Turn) -> StepResult:
        return StepResult(insert_ids=list(self.insert_ids), tool_calls=1)


def _run_arm(engine: TorchEngine, parked: bool, prompts, params, settings, insert_ids) -> dict:
    before = dict(engine.stats())
    inner = engine if parked else ForgetSessions(engine)
    episodes = MultiTurnBackend(inner, lambda i: FixedToolAnswer(insert_ids), lambda ids: "", settings)
    episodes.submit([GenerationRequest(str(i), p, params, group_id=i) for i, p in enumerate(prompts)])
    start = time.perf_counter()
    done = episodes.run_until_idle()
    seconds = time.perf_counter() - start
    episodes.close()
    after = engine.stats()
    return {
        "seconds": seconds,
        "ids": [c.output_ids for c in sorted(done, key=lambda c: c.group_id)],
        "turns": sum(c.episode.turns for c in done),
        **{k: after[k] - before[k] for k in ("prefill_tokens", "cached_tokens", "generated_tokens", "kv_evictions")},
    }


def run(b: EpisodesBench) -> dict:
    for name in ("prompts", "batch", "max_new_tokens", "repeats"):
        if getattr(b, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(b, name)}")
    if b.turns < 2:
        raise ConfigError(f"--turns: episodes need >= 2 turns to reuse a cache, got {b.turns}")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[b.dtype]
    with tempfile.TemporaryDirectory() as tmp:
        gguf = smollm2_gguf_path()
        model_dir = materialize_gguf(gguf.parent, gguf.name, f"{tmp}/hf")
        tokenizer = load_tokenizer(model_dir)
        rollout = RolloutConfig(tools=["calculator"], max_turns=b.turns)
        records = load_records(HELDOUT.format(n=b.prompts))
        prompts = [p.ids for p in tokenize_prompts(records, tokenizer, 512, prompt_renderer(rollout, tokenizer))]
        insert_ids = chatml_format(tokenizer).tool_response_ids([], ["84"])
        context = max(map(len, prompts)) + b.turns * (b.max_new_tokens + len(insert_ids))
        hf = SafetensorsCheckpoint(model_dir)
        engine = TorchEngine(
            hf.spec, load_generator_params(hf, 1, 0, dtype), max_running=b.batch, max_seq_len=context + 1
        )
        params = SamplingParams(temperature=0.0, max_new_tokens=b.max_new_tokens, stop_token_ids=stop_ids(tokenizer))
        settings = EpisodeSettings(max_turns=b.turns, max_context=context)
        arms = {"full_prefill": [], "parked_kv": []}
        for _ in range(b.repeats):
            for arm in arms:
                arms[arm].append(_run_arm(engine, arm == "parked_kv", prompts, params, settings, insert_ids))
    result = {
        "model": "SmolLM2-135M-Instruct",
        "dtype": b.dtype,
        "threads": torch.get_num_threads(),
        "episodes": b.prompts,
        "batch": b.batch,
        "turns": b.turns,
        "max_new_tokens": b.max_new_tokens,
        "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
        "inserted_tokens_per_turn": len(insert_ids),
    }
    for arm, runs in arms.items():
        last = runs[-1]
        result[arm] = {
            "seconds_median": statistics.median(r["seconds"] for r in runs),
            "seconds": [round(r["seconds"], 3) for r in runs],
            "turns": last["turns"],
            "prefill_tokens": last["prefill_tokens"],
            "cached_tokens": last["cached_tokens"],
            "generated_tokens": last["generated_tokens"],
            "kv_evictions": last["kv_evictions"],
        }
    full, parked = arms["full_prefill"][-1], arms["parked_kv"][-1]
    result["same_ids_frac"] = sum(a == b for a, b in zip(full["ids"], parked["ids"])) / b.prompts
    result["prefill_tokens_ratio"] = full["prefill_tokens"] / parked["prefill_tokens"]
    result["speedup"] = result["full_prefill"]["seconds_median"] / result["parked_kv"]["seconds_median"]
    print(json.dumps(result))
    return result
