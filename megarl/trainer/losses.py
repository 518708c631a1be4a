"""Policy-gradient losses, per response token, and their registry.

Every loss has the same signature:

    loss(inputs: LossInputs, *, <its parameters, with defaults>) -> LossOutput

``inputs`` hold, for the response tokens of one micro-batch (flattened):
log pi (with gradient), log mu (the generator's behaviour log-prob, never
recomputed), the advantage, the entropy of pi and, when a reference policy is
configured, its log-prob. The loss returns a per-token loss; the forward-step
hook sums it and Megatron divides the gradient by the number of response
tokens in the whole optimizer step (all micro-batches, all DP ranks).

Built in:
    aipo       LlamaRL's one-sided clipped importance weight (arXiv 2505.24034, s.6):
               loss_t = -stopgrad(min(pi_t / mu_t, rho)) * A * log pi_t
    ppo_clip   GRPO/PPO two-sided clip: -min(r A, clip(r, 1-eps_low, 1+eps_high) A)
    reinforce  on-policy policy gradient: -A * log pi_t

A user loss is named by a dotted path, ``my_pkg.losses:my_loss``, with the same
signature (see examples/losses/). Its keyword-only parameters are what
``trainer.loss_params`` may set: ``bind_loss_params`` checks a config's values
against them (names, types, and a loss's own ``check_params`` when it has one)
when the config is loaded, before any rank starts.
"""

from __future__ import annotations

import importlib
import inspect
import typing
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch

from megarl.errors import ConfigError


@dataclass
class LossInputs:
    logprobs: torch.Tensor  # log pi_t, fp32, requires grad
    behaviour_logprobs: torch.Tensor  # log mu_t
    advantages: torch.Tensor
    entropy: Optional[torch.Tensor] = None  # of pi at each position (with gradient)
    ref_logprobs: Optional[torch.Tensor] = None  # frozen reference policy, if configured
    policy_versions: Optional[torch.Tensor] = None  # version that produced each token

    @property
    def ratio(self) -> torch.Tensor:
        """pi_t / mu_t, without gradient."""
        return (self.logprobs.detach() - self.behaviour_logprobs).exp()


@dataclass
class LossOutput:
    per_token_loss: torch.Tensor
    # Tokens whose importance weight was clipped (for the clip-fraction metric).
    clipped: Optional[torch.Tensor] = None


LossFn = Callable[..., LossOutput]


def _check_aipo(params: dict) -> None:
    if params["rho"] <= 1.0:
        raise ConfigError(f"trainer.loss_params.rho: must be > 1 (LlamaRL uses 2..10), got {params['rho']!r}")


def aipo(inputs: LossInputs, *, rho: float = 4.0) -> LossOutput:
    ratio = inputs.ratio
    weight = ratio.clamp(max=rho)  # no gradient: ratio is built from detached log pi
    return LossOutput(-(weight * inputs.advantages) * inputs.logprobs, clipped=ratio > rho)


aipo.check_params = _check_aipo


def _check_ppo_clip(params: dict) -> None:
    for key in ("eps", "eps_high"):
        value = params[key]
        if value is not None and not 0 < value < 1:
            raise ConfigError(f"trainer.loss_params.{key}: must be in (0, 1), got {value!r}")


def ppo_clip(inputs: LossInputs, *, eps: float = 0.2, eps_high: Optional[float] = None) -> LossOutput:
    """eps_high defaults to eps (symmetric); DAPO's clip-higher sets it above eps."""
    eps_high = eps if eps_high is None else eps_high
    ratio = (inputs.logprobs - inputs.behaviour_logprobs).exp()
    adv = inputs.advantages
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - eps, 1.0 + eps_high) * adv
    return LossOutput(-torch.minimum(unclipped, clipped), clipped=(clipped < unclipped).detach())


ppo_clip.check_params = _check_ppo_clip


def reinforce(inputs: LossInputs) -> LossOutput:
    return LossOutput(-inputs.advantages * inputs.logprobs)


BUILTIN_LOSSES: Dict[str, LossFn] = {"aipo": aipo, "ppo_clip": ppo_clip, "reinforce": reinforce}


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
    if ":" not in name:
        raise ConfigError(
            f"loss {name!r} is unknown; choose one of {sorted(BUILTIN_LOSSES)} or give a dotted path "
            f"'package.module:function'"
        )
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"loss {name!r}: cannot import module {module_name!r} ({err})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"loss {name!r}: module {module_name!r} has no function {attr!r}")
    return fn


def loss_parameters(fn: LossFn) -> Dict[str, inspect.Parameter]:
    """A loss's parameters: its keyword-only arguments after ``inputs``."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        raise ConfigError(f"loss {getattr(fn, '__name__', fn)!r}: its first argument must be the LossInputs")
    others = params[1:]
    for p in others:
        if p.kind != p.KEYWORD_ONLY:
            raise ConfigError(f"loss {fn.__name__!r}: parameter {p.name!r} must be keyword-only "
                              f"(def {fn.__name__}(inputs, *, {p.name}=...))")
    return {p.name: p for p in others}


def _coerce_param(loss: str, name: str, value: Any, annotation: Any) -> Any:
    if isinstance(annotation, str):  # postponed annotations: resolve the few plain types
        annotation = {"float": float, "int": int, "bool": bool, "str": str, "Optional[float]": Optional[float],
                      "Optional[int]": Optional[int], "Optional[str]": Optional[str]}.get(annotation, Any)
    if typing.get_origin(annotation) is typing.Union:
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None:
            return None
        annotation = inner[0] if len(inner) == 1 else Any
    bad = ConfigError(f"trainer.loss_params.{name}: {loss} expects {getattr(annotation, '__name__', annotation)}, "
                      f"got {value!r}")
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if annotation in (int, bool, str) and not (type(value) is annotation):
        raise bad
    return value


def bind_loss_params(name: str, params: Dict[str, Any]) -> Dict[str, Any]:
    """``params`` checked against the loss's declared parameters, defaults filled in.

    Unknown names, missing required values and wrong types are refused naming
    the field; a loss's ``check_params(bound)`` then checks the values.
    """
    fn = resolve_loss(name)
    declared = loss_parameters(fn)
    unknown = sorted(set(params) - set(declared))
    if unknown:
        known = ", ".join(declared) or "none"
        raise ConfigError(f"trainer.loss_params.{unknown[0]}: loss {name!r} has no such parameter (its parameters: "
                          f"{known})")
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
