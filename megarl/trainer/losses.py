"""Policy-gradient losses, per response token, and their registry.

Every loss has the same signature:

    loss(inputs: LossInputs, params: dict) -> LossOutput

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
signature (see examples/losses/).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Dict, Optional

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


LossFn = Callable[[LossInputs, dict], LossOutput]


def aipo(inputs: LossInputs, params: dict) -> LossOutput:
    rho = float(params.get("rho", 4.0))
    ratio = inputs.ratio
    weight = ratio.clamp(max=rho)  # no gradient: ratio is built from detached log pi
    return LossOutput(-(weight * inputs.advantages) * inputs.logprobs, clipped=ratio > rho)


def ppo_clip(inputs: LossInputs, params: dict) -> LossOutput:
    eps_low = float(params.get("eps", 0.2))
    eps_high = float(params.get("eps_high", eps_low))
    ratio = (inputs.logprobs - inputs.behaviour_logprobs).exp()
    adv = inputs.advantages
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    return LossOutput(-torch.minimum(unclipped, clipped), clipped=(clipped < unclipped).detach())


def reinforce(inputs: LossInputs, params: dict) -> LossOutput:
    return LossOutput(-inputs.advantages * inputs.logprobs)


BUILTIN_LOSSES: Dict[str, LossFn] = {"aipo": aipo, "ppo_clip": ppo_clip, "reinforce": reinforce}


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) for tokens sampled from the rollout policy.

    k1 = log pi - log ref (unbiased, can be negative); k3 = e^(ref - pi) - (ref - pi) - 1
    (non-negative, lower variance; Schulman's estimator, GRPO's default).
    """
    delta = ref_logprobs - logprobs
    if estimator == "k1":
        return -delta
    if estimator == "k3":
        return delta.exp() - delta - 1.0
    raise ConfigError(f"kl_estimator {estimator!r} is unknown; choose 'k1' or 'k3'")


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


def check_loss_params(name: str, params: dict) -> None:
    """Validate the built-in losses' parameters, naming the field."""
    if name == "aipo":
        rho = params.get("rho", 4.0)
        if not isinstance(rho, (int, float)) or rho <= 1.0:
            raise ConfigError(f"loss.rho must be a number > 1 (LlamaRL uses 2..10), got {rho!r}")
    if name == "ppo_clip":
        for key in ("eps", "eps_high"):
            value = params.get(key, 0.2)
            if not isinstance(value, (int, float)) or not 0 < value < 1:
                raise ConfigError(f"loss.{key} must be in (0, 1), got {value!r}")
