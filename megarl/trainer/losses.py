"""Policy-gradient losses, per trained response token, and their registry.

Every loss has the same signature:

    loss(inputs: LossInputs, *, <its parameters, with defaults>) -> LossOutput

``inputs`` hold, for the trained response tokens of one micro-batch (flattened;
a token the sample's ``loss_mask`` leaves out is never among them, so a loss
needs no mask of its own): log pi (with gradient), log mu (the generator's
behaviour log-prob, never recomputed), the advantage, the entropy of pi and,
when a reference policy is configured, its log-prob; and the samples they belong
to: each token's sample (``sample_index``, 0..n-1 within the micro-batch; a
sample never straddles micro-batches), each sample's number of trained tokens and
group, each token's policy lag (trainer version - token version), and the step's
totals of sequences and trained tokens (all micro-batches, all DP ranks). A
per-sample reduction (``sequence_mean``: GSPO's sequence ratio, the sequence-level
IS weight and mask) is therefore over the sample's trained tokens only. The loss
returns a per-token loss; the hook weights it by ``trainer.loss_agg``
(megarl.trainer.aggregation: token_mean, seq_mean_token_mean, ...) and Megatron
divides by the step's trained tokens, so every mode is the exact global value
however the step is split.

Built in (r_t = pi_t / mu_t; s_i = exp(mean_{t in i} log r_t), the sequence's
geometric-mean ratio -- a product over hundreds of tokens would leave any band):
    aipo       LlamaRL's one-sided clipped importance weight (arXiv 2505.24034, s.6):
               loss_t = -stopgrad(min(w, rho)) * A * log pi_t, w = r_t (is_level=token)
               or w = s_i (is_level=sequence: sequence-level truncated IS)
    ppo_clip   GRPO/PPO two-sided clip: -min(r A, clip(r, 1-eps, 1+eps_high) A)
    dr_grpo    ppo_clip aggregated by Dr.GRPO's constant (arXiv 2503.20783): no 1/len_i,
               and no reward-std division (normalize_advantage_std=true or another
               loss_agg is refused when the loss is bound)
    gspo       GSPO (arXiv 2507.18071): -min(s_i A, clip(s_i, 1-eps, 1+eps_high) A) on every
               token of sample i, gradient through s_i; aggregated seq_mean_token_mean (its
               default) it is the paper's (1/G) sum_i of the sequence objective; eps 3e-4,
               eps_high 4e-4 by default, the paper's
    reinforce  on-policy policy gradient: -A * log pi_t
    sft        supervised fine-tuning (megarl sft): -log pi_t, advantages and mu unread

Masked importance sampling (aipo, ppo_clip, dr_grpo: ``mask_c``, ``mask_level``):
tokens (token) or whole samples (sequence, by s_i) whose ratio leaves [1/c, c]
contribute nothing. They stay in the normaliser, like PPO's clipped tokens, so
the step's scale does not depend on how many were dropped. Truncated IS is
AIPO's weight: with one optimizer update per batch megarl's proximal policy is
pi itself, and the PPO clip with a truncated IS weight against it reduces
exactly to aipo (ratio pi / stopgrad(pi) = 1 never clips), so the sequence
variant is ``aipo`` with ``is_level: sequence``.

A loss function may carry ``loss_agg`` (its aggregation when trainer.loss_agg is
unset). A user loss is named by a dotted path, ``my_pkg.losses:my_loss``, with
the same signature (see examples/losses/). Its keyword-only parameters are what
``trainer.loss_params`` may set: ``bind_loss_params`` checks a config's values
against them (names, types, and a loss's own ``check_params`` when it has one)
when the loss is bound (megarl.trainer.bound_loss.bind_loss), which `megarl
train` does before any rank starts.
"""

from __future__ import annotations

import inspect
import math
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional

from megarl.dotted_path import is_dotted_path, resolve_dotted_path
from megarl.errors import ConfigError

if TYPE_CHECKING:  # only tensor methods at run time: a loss is bound (by `megarl train`'s launcher
    import torch  # too, before any rank starts) without importing torch

FIELD = "trainer.loss"


@dataclass
class LossInputs:
    logprobs: torch.Tensor  # [T] log pi_t, fp32, requires grad
    behaviour_logprobs: torch.Tensor  # [T] log mu_t
    advantages: torch.Tensor  # [T]
    entropy: Optional[torch.Tensor] = None  # [T] of pi at each position (with gradient)
    ref_logprobs: Optional[torch.Tensor] = None  # [T] frozen reference policy, if configured
    policy_versions: Optional[torch.Tensor] = None  # [T] version that produced each token
    # The samples: None means all T tokens are one sample (hand-built inputs).
    sample_index: Optional[torch.Tensor] = None  # [T] the token's sample, 0..n-1 within this micro-batch
    response_lengths: Optional[torch.Tensor] = None  # [n] trained tokens of each sample (loss_mask 1)
    group_ids: Optional[torch.Tensor] = None  # [n] each sample's group (prompt)
    lags: Optional[torch.Tensor] = None  # [T] trainer version - token version
    step_sequences: int = 0  # samples with a trained token in the whole step (every micro-batch and DP rank)
    step_tokens: int = 0  # trained tokens in the whole optimizer step

    @property
    def ratio(self) -> torch.Tensor:
        """pi_t / mu_t, without gradient."""
        return (self.logprobs.detach() - self.behaviour_logprobs).exp()

    def segments(self):
        """(each token's sample, number of samples)."""
        if self.sample_index is None:
            return self.logprobs.new_zeros(self.logprobs.shape).long(), 1
        n = len(self.response_lengths) if self.response_lengths is not None else int(self.sample_index.max()) + 1
        return self.sample_index, n

    def sequence_mean(self, values: torch.Tensor) -> torch.Tensor:
        """[n] mean of ``values`` over each sample's tokens (differentiable)."""
        index, n = self.segments()
        sums = values.new_zeros(n).index_add(0, index, values)
        counts = values.new_zeros(n).index_add(0, index, values.new_ones(values.shape))
        return sums / counts.clamp(min=1)

    def to_tokens(self, per_sample: torch.Tensor) -> torch.Tensor:
        """[T] each token's value of a per-sample quantity."""
        return per_sample[self.segments()[0]]


@dataclass
class LossOutput:
    per_token_loss: torch.Tensor
    # Tokens whose importance weight was truncated / clipped (the clip-fraction metric).
    clipped: Optional[torch.Tensor] = None
    # Tokens masked out by masked importance sampling (the mask-fraction metric).
    masked: Optional[torch.Tensor] = None


LossFn = Callable[..., LossOutput]
LEVELS = ("token", "sequence")


def _check_mask(params: dict) -> None:
    c, level = params["mask_c"], params["mask_level"]
    if c is not None and c <= 1.0:
        raise ConfigError(f"trainer.loss_params.mask_c: the band is [1/c, c], must be > 1, got {c!r}")
    if level not in LEVELS:
        raise ConfigError(f"trainer.loss_params.mask_level: {level!r} is not one of {list(LEVELS)}")
    if c is None and level != "token":
        raise ConfigError("trainer.loss_params.mask_level: used only with trainer.loss_params.mask_c")


def _keep(inputs: LossInputs, mask_c: Optional[float], mask_level: str) -> Optional[torch.Tensor]:
    """Tokens inside the band (|log ratio| <= log c, per token or by their sample's s_i); None: no masking."""
    if mask_c is None:
        return None
    log_r = inputs.logprobs.detach() - inputs.behaviour_logprobs
    if mask_level == "sequence":
        log_r = inputs.to_tokens(inputs.sequence_mean(log_r))
    return log_r.abs() <= math.log(mask_c)


def _masked(out: LossOutput, keep: Optional[torch.Tensor]) -> LossOutput:
    if keep is None:
        return out
    clipped = out.clipped & keep if out.clipped is not None else None  # a masked token is not also clipped
    return LossOutput(out.per_token_loss * keep, clipped=clipped, masked=~keep)


def _check_aipo(params: dict) -> None:
    if params["rho"] <= 1.0:
        raise ConfigError(f"trainer.loss_params.rho: must be > 1 (LlamaRL uses 2..10), got {params['rho']!r}")
    if params["is_level"] not in LEVELS:
        raise ConfigError(f"trainer.loss_params.is_level: {params['is_level']!r} is not one of {list(LEVELS)}")
    _check_mask(params)


def aipo(
    inputs: LossInputs,
    *,
    rho: float = 4.0,
    is_level: str = "token",
    mask_c: Optional[float] = None,
    mask_level: str = "token",
) -> LossOutput:
    log_r = inputs.logprobs.detach() - inputs.behaviour_logprobs  # no gradient through the weight
    if is_level == "sequence":
        log_r = inputs.to_tokens(inputs.sequence_mean(log_r))
    ratio = log_r.exp()
    weight = ratio.clamp(max=rho)
    out = LossOutput(-(weight * inputs.advantages) * inputs.logprobs, clipped=ratio > rho)
    return _masked(out, _keep(inputs, mask_c, mask_level))


aipo.check_params = _check_aipo


def _check_ppo_clip(params: dict) -> None:
    for key in ("eps", "eps_high"):
        value = params[key]
        if value is not None and not 0 < value < 1:
            raise ConfigError(f"trainer.loss_params.{key}: must be in (0, 1), got {value!r}")
    _check_mask(params)


def _clipped_objective(ratio: torch.Tensor, adv: torch.Tensor, eps: float, eps_high: Optional[float]):
    eps_high = eps if eps_high is None else eps_high
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - eps, 1.0 + eps_high) * adv
    return -unclipped.minimum(clipped), (clipped < unclipped).detach()


def ppo_clip(
    inputs: LossInputs,
    *,
    eps: float = 0.2,
    eps_high: Optional[float] = None,
    mask_c: Optional[float] = None,
    mask_level: str = "token",
) -> LossOutput:
    """eps_high defaults to eps (symmetric); DAPO's clip-higher sets it above eps."""
    loss, clipped = _clipped_objective(
        (inputs.logprobs - inputs.behaviour_logprobs).exp(), inputs.advantages, eps, eps_high
    )
    return _masked(LossOutput(loss, clipped=clipped), _keep(inputs, mask_c, mask_level))


ppo_clip.check_params = _check_ppo_clip


def dr_grpo(
    inputs: LossInputs,
    *,
    eps: float = 0.2,
    eps_high: Optional[float] = None,
    mask_c: Optional[float] = None,
    mask_level: str = "token",
) -> LossOutput:
    """Dr.GRPO: the PPO clip per token; what makes it Dr.GRPO is its aggregation (attributes below)."""
    return ppo_clip(inputs, eps=eps, eps_high=eps_high, mask_c=mask_c, mask_level=mask_level)


dr_grpo.check_params = _check_ppo_clip
dr_grpo.loss_agg = "seq_mean_token_sum_norm"
dr_grpo.fixed_agg = True  # another trainer.loss_agg is refused: it would be ppo_clip under another name
dr_grpo.no_std_normalisation = True


def _check_gspo(params: dict) -> None:
    for key in ("eps", "eps_high"):
        if not 0 < params[key] < 1:
            raise ConfigError(f"trainer.loss_params.{key}: must be in (0, 1), got {params[key]!r}")


def gspo(inputs: LossInputs, *, eps: float = 3e-4, eps_high: float = 4e-4) -> LossOutput:
    """Defaults: the paper's clip range (left 3e-4, right 4e-4)."""
    seq_ratio = inputs.sequence_mean(inputs.logprobs - inputs.behaviour_logprobs).exp()  # with gradient
    seq_adv = inputs.sequence_mean(inputs.advantages)  # a sample's tokens share its advantage
    loss, clipped = _clipped_objective(seq_ratio, seq_adv, eps, eps_high)
    return LossOutput(inputs.to_tokens(loss), clipped=inputs.to_tokens(clipped))


gspo.check_params = _check_gspo
gspo.loss_agg = "seq_mean_token_mean"


def reinforce(inputs: LossInputs) -> LossOutput:
    return LossOutput(-inputs.advantages * inputs.logprobs)


def sft(inputs: LossInputs) -> LossOutput:
    """Supervised fine-tuning (`megarl sft`): the negative log-likelihood of each trained token; the
    advantages and behaviour log-probs are not read."""
    return LossOutput(-inputs.logprobs)


# The records were written, not sampled: their likelihood is the model's own distribution (temperature
# 1, as transformers' and Megatron's language-model loss), whatever rollout.temperature the RL sampler uses
sft.unsampled_targets = True


BUILTIN_LOSSES: Dict[str, LossFn] = {
    "aipo": aipo,
    "ppo_clip": ppo_clip,
    "dr_grpo": dr_grpo,
    "gspo": gspo,
    "reinforce": reinforce,
    "sft": sft,
}


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) for tokens sampled from the rollout policy.

    k1 = log pi - log ref (unbiased, can be negative); k2 = (log pi - log ref)^2 / 2
    (biased, its gradient is that of the reverse KL); k3 = e^(ref - pi) - (ref - pi) - 1
    (non-negative, lower variance; Schulman's estimator, GRPO's default).
    """
    delta = ref_logprobs - logprobs
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta * delta
    if estimator == "k3":
        return delta.exp() - delta - 1.0
    raise ConfigError(f"trainer.kl_estimator: {estimator!r} is unknown; choose 'k1', 'k2' or 'k3'")


def resolve_loss(name: str) -> LossFn:
    """A built-in loss by name, or a user loss by dotted path 'package.module:function'."""
    if name in BUILTIN_LOSSES:
        return BUILTIN_LOSSES[name]
    if not is_dotted_path(name):
        raise ConfigError(
            f"{FIELD}: {name!r} is unknown; choose one of {sorted(BUILTIN_LOSSES)} or give a dotted path "
            f"'package.module:function'"
        )
    return resolve_dotted_path(name, FIELD)


def loss_parameters(fn: LossFn, name: str) -> Dict[str, inspect.Parameter]:
    """A loss's parameters: its keyword-only arguments after ``inputs``."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        raise ConfigError(f"{FIELD}: loss {name!r}: its first argument must be the LossInputs")
    others = params[1:]
    for p in others:
        if p.kind != p.KEYWORD_ONLY:
            raise ConfigError(
                f"{FIELD}: loss {name!r}: parameter {p.name!r} must be keyword-only "
                f"(def {fn.__name__}(inputs, *, {p.name}=...))"
            )
    return {p.name: p for p in others}


def _coerce_param(loss: str, name: str, value: Any, annotation: Any) -> Any:
    if isinstance(annotation, str):  # postponed annotations: resolve the few plain types
        annotation = {
            "float": float,
            "int": int,
            "bool": bool,
            "str": str,
            "Optional[float]": Optional[float],
            "Optional[int]": Optional[int],
            "Optional[str]": Optional[str],
        }.get(annotation, Any)
    if typing.get_origin(annotation) is typing.Union:
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None:
            return None
        annotation = inner[0] if len(inner) == 1 else Any
    bad = ConfigError(
        f"trainer.loss_params.{name}: {loss} expects {getattr(annotation, '__name__', annotation)}, got {value!r}"
    )
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if annotation in (int, bool, str) and type(value) is not annotation:
        raise bad
    return value


def bind_loss_params(fn: LossFn, name: str, params: Dict[str, Any]) -> Dict[str, Any]:
    """``params`` checked against the declared parameters of ``fn`` (the loss ``name`` resolved),
    defaults filled in.

    Unknown names, missing required values and wrong types are refused naming
    the field; a loss's ``check_params(bound)`` then checks the values.
    """
    declared = loss_parameters(fn, name)
    unknown = sorted(set(params) - set(declared))
    if unknown:
        known = ", ".join(declared) or "none"
        raise ConfigError(
            f"trainer.loss_params.{unknown[0]}: loss {name!r} has no such parameter (its parameters: {known})"
        )
    bound = {}
    for pname, p in declared.items():
        if pname in params:
            bound[pname] = _coerce_param(name, pname, params[pname], p.annotation)
        elif p.default is inspect.Parameter.empty:
            raise ConfigError(f"trainer.loss_params.{pname}: loss {name!r} needs a value (no default)")
        else:
            bound[pname] = p.default
    check = getattr(fn, "check_params", None)
    if check is not None:
        try:
            check(bound)
        except ConfigError:
            raise
        except (ValueError, TypeError) as err:
            raise ConfigError(f"trainer.loss_params: {name}: {err}") from None
    return bound
