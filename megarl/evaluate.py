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

``--samples K`` (K > 1) also draws K sampled answers per prompt and reports
``reward_mean@K`` and ``pass@K`` (a prompt passes when one of its K answers is
right): how far sharpening the policy could take its greedy accuracy. They are
drawn at ``--temperature`` / ``--top-p`` with per-prompt seeds from ``--seed``,
each defaulting to the training run's ``rollout.temperature`` / ``rollout.top_p``
/ ``run.seed`` (else 1.0 / 1.0 / 1234): the draws of the run's own evaluation
during training (``data.eval_samples``) on the same prompts: both evaluate through
executors/evaluation.py (its requests, seeds, sums and metrics); this module loads the checkpoint
into an engine and writes what it found.

``--tools calculator [--max-turns N]`` evaluates episodes as ``rollout.tools`` trains them: the
tools described in every prompt (environments/chat_render.py), each ``<tool_call>`` answered in a
tool turn, up to N turns (default 4); an episode is scored on its final turn (its answer, not a
tool's output: ``reward.scored_text: final_turn``) and the JSON line adds what the greedy
episodes did with the tools (tool calls, turns, errors).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from megarl.checkpointing.manifest import MANIFEST_FILE
from megarl.checkpointing.megatron_checkpoint import TOKENIZER_DIR, TRACKER_FILE, resolve_checkpoint_dir
from megarl.config import Config, ModelConfig, RewardConfig, RolloutConfig
from megarl.data.datasets import load_records, tokenize_prompts
from megarl.environments.factory import episode_backend, prompt_renderer
from megarl.environments.tool import resolve_tools
from megarl.errors import CheckpointError, ConfigError
from megarl.executors.evaluation import EvalSettings, eval_metrics, eval_sums, evaluate_prompts, run_alone
from megarl.executors.reward import RewardExecutor
from megarl.generator.tokenizer import load_tokenizer, stop_ids
from megarl.generator.torch_engine.engine import TorchEngine
from megarl.model_source import prepare_model
from megarl.rewards.registry import FIELD, reward_spec
from megarl.runtime.cpu_dtype import resolve_dtype
from megarl.runtime.distributed import init_distributed, init_megatron, shutdown, world_dims
from megarl.runtime.launch import run_world
from megarl.weight_sync.colocated import copy_colocated
from megarl.weight_sync.endpoints import allocate_generator_params


def _checkpoint_dir(checkpoint: str, cache_dir: str) -> Path:
    path = Path(checkpoint)
    if checkpoint.startswith("random:"):  # model.source's random initialisation has no weights to evaluate
        raise ConfigError(
            f"--checkpoint: {checkpoint} is a random initialisation, not a checkpoint; {CHECKPOINT_KINDS}"
        )
    if checkpoint != "smollm2" and not path.exists():
        raise CheckpointError(f"--checkpoint {checkpoint}: no such file or directory; {CHECKPOINT_KINDS}")
    if (path / "checkpoints" / TRACKER_FILE).exists():  # a training run's directory
        path = path / "checkpoints"
    elif (path / "checkpoints").is_dir() or (path / "metrics.jsonl").is_file():
        # a run that has saved nothing yet: its config.json is no Hugging Face model's
        raise CheckpointError(
            f"--checkpoint {checkpoint}: a training run's directory with no checkpoint saved yet "
            f"({path / 'checkpoints' / TRACKER_FILE} is missing; a run saves every run.save_every steps and at its end)"
        )
    # a root, or one iteration dir (iter_XXXXXXX/); every file is checked against the
    # manifest first, so a damaged checkpoint is named here and not deep inside torch
    if (
        (path / "latest_checkpointed_iteration.txt").exists()
        or (path / MANIFEST_FILE).exists()
        or (path / "metadata.json").exists()
    ):
        return resolve_checkpoint_dir(path, what="--checkpoint", verify="checksums")
    prepared = prepare_model(ModelConfig(source=checkpoint, cache_dir=cache_dir), what="--checkpoint")
    return resolve_checkpoint_dir(prepared.checkpoint, what="--checkpoint", verify="checksums")


CHECKPOINT_KINDS = (
    "give a training run's directory, a Megatron checkpoint (root or iter_N/), a Hugging Face model "
    "directory, or smollm2"
)


def check_reward(reward: str) -> None:
    """--reward resolved before the model loads, its errors naming the flag (not the config's reward.function)."""
    try:
        reward_spec(reward)
    except ConfigError as err:
        raise ConfigError(f"--reward: {str(err).removeprefix(f'{FIELD}: ')}") from None


def check_data(data: str) -> int:
    """Every --data record parsed before the model loads (a bad line costs no load); the prompt count."""
    if data.startswith("random:"):
        raise ConfigError(
            f"--data: {data}: random token prompts have no answers to grade; give a .jsonl/.parquet prompt "
            f"file or arithmetic:<n>:<seed>"
        )
    try:
        return len(load_records(data))
    except ConfigError as err:
        raise ConfigError(f"--data: {err}") from None


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
    if requested is not None:
        if requested == "auto":
            return resolve_dtype("--dtype", "auto", torch.cuda.is_available())[0], "--dtype auto"
        return requested, "--dtype"
    recorded = (run_config.get("generator") or {}).get("dtype")
    if recorded in ("fp32", "bf16"):
        return recorded, "the run's generator.dtype"
    if recorded == "auto":  # a config written before megarl train resolved auto
        return resolve_dtype("generator.dtype", "auto", torch.cuda.is_available())[
            0
        ], "the run's generator.dtype (auto)"
    return "fp32", "default (no run config)"


def sampling_rule(
    samples: int, temperature: float | None, top_p: float | None, seed: int | None, run_config: dict
) -> dict:
    """The sampled answers' settings (the module docstring's rule); refuses what cannot work, naming the flag."""
    if samples < 1:
        raise ConfigError(f"--samples: must be >= 1, got {samples}")
    rollout, run = run_config.get("rollout") or {}, run_config.get("run") or {}
    chosen = {
        "samples": samples,
        "temperature": float(rollout.get("temperature", 1.0) if temperature is None else temperature),
        "top_p": float(rollout.get("top_p", 1.0) if top_p is None else top_p),
        "seed": int(run.get("seed", 1234) if seed is None else seed),
    }
    if samples > 1 and chosen["temperature"] <= 0:
        raise ConfigError(
            f"--temperature: {samples} sampled answers need a temperature > 0, got "
            f"{chosen['temperature']} (greedy answers would all be the same)"
        )
    if not 0 < chosen["top_p"] <= 1:
        raise ConfigError(f"--top-p: must be in (0, 1], got {chosen['top_p']}")
    return chosen


DEFAULT_TOOL_TURNS = 4  # rollout.max_turns' default for tools
TOOL_TURN_TOKENS = 48  # room per turn for the tool turn's ids (its glue and a result)


def _episode_settings(tools: tuple, max_turns: int) -> RolloutConfig:
    """The rollout fields episodes of --tools run by: tools answered as in training (rollout.tools),
    at most --max-turns turns; refused, naming the flag, where they mean nothing."""
    if max_turns < 1:
        raise ConfigError(f"--max-turns: must be >= 1, got {max_turns}")
    if max_turns > 1 and not tools:
        raise ConfigError("--max-turns: > 1 needs --tools (what answers a turn)")
    if tools and max_turns < 2:
        raise ConfigError("--max-turns: --tools needs >= 2 (the turn after a tool's answer)")
    resolve_tools(tools, "--tools")  # an unknown tool or a bad dotted path, named by the flag
    return RolloutConfig(tools=list(tools), max_turns=max_turns)


def _eval_rank(
    ckpt_dir: str,
    tokenizer_dir: str,
    data: str,
    max_new_tokens: int,
    reward: str,
    batch: int,
    out: str,
    dump: str | None = None,
    dtype: str = "fp32",
    sampling: dict | None = None,
    tools: tuple = (),
    max_turns: int = 1,
) -> None:
    # imported here: its torch.distributed.checkpoint costs ~0.77 s, paid by the eval rank that loads the
    # model and not by `megarl eval`'s launcher, which refuses a bad --data/--reward before any load
    from megarl.checkpointing.model_loading import load_megatron_model

    init_distributed()
    init_megatron(world_dims(1, 1))
    spec, chunks = load_megatron_model(ckpt_dir, world_dims(1, 1))  # in the dtype it was saved in
    # decoded in the dtype of dtype_rule: the checkpoint's weights are cast into it by the copy
    params = allocate_generator_params(spec, 1, 0, torch.bfloat16 if dtype == "bf16" else torch.float32)
    copy_colocated(spec, chunks, params)
    del chunks
    tokenizer = load_tokenizer(tokenizer_dir)
    episodes = _episode_settings(tools, max_turns)
    prompts = tokenize_prompts(load_records(data), tokenizer, 512, prompt_renderer(episodes, tokenizer))
    longest = max(len(p.ids) for p in prompts)
    # with tools: every turn's answer and the tool turn after it (a result of up to ~48 tokens)
    context = longest + (max_new_tokens if not tools else max_turns * (max_new_tokens + TOOL_TURN_TOKENS))
    engine = TorchEngine(spec, params, max_running=batch, max_seq_len=context + 1)
    backend = episode_backend(episodes, engine, tokenizer, context)  # the engine itself without tools
    sampling = sampling or {"samples": 1}
    k = sampling["samples"]
    # greedy alone (k = 1) draws nothing: the sampling settings are not read
    settings = EvalSettings(max_new_tokens, k, sampling.get("temperature", 1.0), sampling.get("top_p", 1.0),
                            sampling.get("seed", 0))  # fmt: skip
    start = time.perf_counter()
    groups = evaluate_prompts(run_alone(backend), "", prompts, settings, stop_ids(tokenizer))
    generate_s = time.perf_counter() - start
    # an episode is scored on its final turn (reward.scored_text: final_turn), not a tool's output
    scoring = RewardConfig(function=reward, timeout_s=10.0, scored_text="final_turn" if tools else "response")
    scorer = RewardExecutor(Config(reward=scoring), tokenizer)
    flat = scorer.score(groups, on_error="zero").samples
    scored, at = [], 0  # per prompt, as groups: the greedy answer's sample, then the sampled ones'
    for g in groups:
        scored.append(flat[at : at + len(g)])
        at += len(g)
    n, metrics = len(prompts), eval_metrics([eval_sums([[s.reward for s in ss] for ss in scored])], k)
    result = {
        "checkpoint": ckpt_dir,
        "data": data,
        "n": n,
        "accuracy": metrics["accuracy"],
        "reward_mean": metrics["greedy_reward_mean"],
        "generate_s": generate_s,
        "example": scored[0][0].response_text[:200],
        "dtype": dtype,
    }
    if tools:  # what the greedy episodes did with the tools
        stats = [g[0].episode for g in groups]
        result.update(
            {
                "tools": list(tools),
                "max_turns": max_turns,
                "turns_mean": sum(e.turns for e in stats) / n,
                "tool_calls_mean": sum(e.tool_calls for e in stats) / n,
                "episodes_with_tool_call": sum(e.tool_calls > 0 for e in stats) / n,
                "tool_errors": sum(e.tool_errors for e in stats),
                "turn_limit_frac": sum(e.finish == "max_turns" for e in stats) / n,
            }
        )
    if k > 1:
        result.update({f"reward_mean@{k}": metrics[f"reward_mean@{k}"], f"pass@{k}": metrics[f"pass@{k}"]})
        result["sampling"] = sampling
    Path(out).write_text(json.dumps(result))
    if dump:
        _write_dump(dump, prompts, groups, scored, scorer if tools else None)
    shutdown()


def _write_dump(path: str, prompts, groups, scored, episodes_scorer) -> None:
    """The greedy answers in prompt order, then (with --samples) each prompt's sampled ones;
    ``episodes_scorer``: with --tools, the episode and the text its reward read are added."""
    greedy = [(i, 0) for i in range(len(prompts))]
    sampled = [(i, j) for i in range(len(prompts)) for j in range(1, len(groups[i]))]
    with open(path, "w") as f:
        for i, j in greedy + sampled:
            c, s = groups[i][j], scored[i][j]
            line = {
                "prompt": prompts[i].record.messages,
                "answer": prompts[i].record.answer,
                "response": s.response_text,
            }
            if episodes_scorer is not None:
                line.update(scored=episodes_scorer.decode(c, scored=True), episode=asdict(c.episode))
            line.update(reward=s.reward, reason=s.reward_reason)
            if j:
                line["sample"] = c.sample_index
            f.write(json.dumps(line) + "\n")


def evaluate(
    checkpoint: str,
    data: str,
    max_new_tokens: int = 64,
    reward: str = "math",
    batch: int = 32,
    cache_dir: str = "runs/cache",
    dump: str | None = None,
    dtype: str | None = None,
    samples: int = 1,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    tools: tuple = (),
    max_turns: int | None = None,
) -> dict:
    sampling_rule(samples, 1.0 if temperature is None else temperature, top_p, seed, {})  # before any loading
    tools, max_turns = tuple(tools or ()), max_turns or (DEFAULT_TOOL_TURNS if tools else 1)
    _episode_settings(tools, max_turns)  # a bad --tools / --max-turns is refused before any loading
    check_data(data)
    check_reward(reward)
    ckpt_dir = _checkpoint_dir(checkpoint, cache_dir)
    run_config = _run_config(ckpt_dir)
    decode_dtype, source = dtype_rule(dtype, run_config)
    sampling = sampling_rule(samples, temperature, top_p, seed, run_config)
    print(f"megarl: eval decodes in {decode_dtype} ({source})", file=sys.stderr, flush=True)
    tokenizer_dir = ckpt_dir / TOKENIZER_DIR
    if not tokenizer_dir.exists():  # a training run from a random model keeps its tokenizer elsewhere
        tokenizer_dir = Path(run_config.get("model", {}).get("tokenizer") or "")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        run_world(
            _eval_rank,
            1,
            str(ckpt_dir),
            str(tokenizer_dir),
            data,
            max_new_tokens,
            reward,
            batch,
            out,
            dump and str(Path(dump).resolve()),
            decode_dtype,
            sampling,
            tools,
            max_turns,
        )
        result = json.loads(Path(out).read_text())
    result["dtype_source"] = source
    print(json.dumps(result), flush=True)
    return result
