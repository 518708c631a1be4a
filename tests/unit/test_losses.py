"""The losses on hand-built cases, advantages, and the loss registry."""

import math

import pytest
import torch

from megarl.config import RolloutConfig, TrainerConfig
from megarl.errors import ConfigError
from megarl.rollout import Sample
from megarl.trainer.advantages import compute_advantages
from megarl.trainer.bound_loss import bind_loss
from megarl.trainer.losses import LossInputs, aipo, kl_penalty, ppo_clip, reinforce, resolve_loss

RHO = 4.0


def inputs(logp, mu, adv):
    logp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    return LossInputs(logp, torch.tensor(mu, dtype=torch.float64), torch.tensor(adv, dtype=torch.float64))


def grad_wrt_logp(loss_fn, x: LossInputs, params=None):
    loss_fn(x, **(params if params is not None else {"rho": RHO})).per_token_loss.sum().backward()
    return x.logprobs.grad


def test_aipo_weights_are_the_clipped_ratio_without_gradient():
    # token 0: pi/mu = e^2 = 7.39 > rho -> weight rho; token 1: pi/mu = e^-1 -> weight e^-1;
    # token 2: pi/mu = e^1.2 = 3.32 < rho, negative advantage.
    x = inputs([-1.0, -2.0, -0.5], [-3.0, -1.0, -1.7], [0.5, 2.0, -1.5])
    grad = grad_wrt_logp(aipo, x)
    # d loss / d log pi = -w * A exactly: the ratio itself carries no gradient.
    expected = torch.tensor([-RHO * 0.5, -math.exp(-1.0) * 2.0, -math.exp(1.2) * -1.5], dtype=torch.float64)
    assert torch.allclose(grad, expected, rtol=1e-12, atol=0)
    out = aipo(inputs([-1.0, -2.0, -0.5], [-3.0, -1.0, -1.7], [0.5, 2.0, -1.5]), rho=RHO)
    assert out.clipped.tolist() == [True, False, False]


def test_aipo_equals_reinforce_on_policy():
    logp = [-0.3, -2.5, -1.1, -4.0]
    adv = [1.0, -0.5, 0.25, 2.0]
    g_aipo = grad_wrt_logp(aipo, inputs(logp, logp, adv))
    g_reinforce = grad_wrt_logp(reinforce, inputs(logp, logp, adv), {})
    assert torch.equal(g_aipo, g_reinforce)


def test_ppo_clip_stops_gradient_outside_the_trust_region():
    # ratio e^0.5 = 1.65 > 1.2 with A > 0: clipped, no gradient; ratio 1 inside: gradient -A * ratio
    x = inputs([-0.5, -1.0], [-1.0, -1.0], [1.0, -2.0])
    grad = grad_wrt_logp(ppo_clip, x, {"eps": 0.2})
    assert grad[0].item() == 0.0 and grad[1].item() == pytest.approx(2.0)
    # eps_high reaches the clip: with 0.7 the ratio 1.65 is inside [0.8, 1.7], so token 0 has gradient -A * r
    grad = grad_wrt_logp(ppo_clip, inputs([-0.5, -1.0], [-1.0, -1.0], [1.0, -2.0]), {"eps": 0.2, "eps_high": 0.7})
    assert grad[0].item() == pytest.approx(-math.exp(0.5), rel=1e-12)
    # eps reaches the lower clip: ratio e^-0.5 = 0.61 with A < 0 is clipped at 1 - eps = 0.5 only if eps > 0.39
    low = inputs([-1.5], [-1.0], [-1.0])
    assert grad_wrt_logp(ppo_clip, low, {"eps": 0.2}).item() == 0.0
    assert grad_wrt_logp(ppo_clip, inputs([-1.5], [-1.0], [-1.0]), {"eps": 0.5}).item() == pytest.approx(
        math.exp(-0.5), rel=1e-12
    )


def test_kl_estimators():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -2.0])
    assert torch.allclose(kl_penalty(logp, ref, "k1"), torch.tensor([0.5, 0.0]))
    k3 = kl_penalty(logp, ref, "k3")
    assert k3[1] == 0 and k3[0] == pytest.approx(math.exp(-0.5) + 0.5 - 1)
    assert torch.allclose(kl_penalty(logp, ref, "k2"), torch.tensor([0.125, 0.0]))
    with pytest.raises(ConfigError, match="kl_estimator: 'k4'"):
        kl_penalty(logp, ref, "k4")


def test_registry_and_dotted_paths():
    assert resolve_loss("aipo") is aipo
    custom = resolve_loss("examples.losses.entropy_bonus:aipo_with_entropy_bonus")
    x = inputs([-1.0], [-1.0], [1.0])
    x.entropy = torch.tensor([2.0], dtype=torch.float64)
    assert custom(x, entropy_coef=0.5).per_token_loss.item() == pytest.approx(1.0 * -1.0 * -1.0 - 1.0)
    with pytest.raises(ConfigError, match="trainer.loss: 'grpo' is unknown; choose one of"):
        resolve_loss("grpo")
    assert resolve_loss("gspo").loss_agg == "seq_mean_token_mean"
    with pytest.raises(ConfigError, match="trainer.loss: cannot import module 'no_such_pkg.losses'"):
        resolve_loss("no_such_pkg.losses:f")
    with pytest.raises(
        ConfigError, match="trainer.loss: module 'examples.losses.entropy_bonus' has no attribute 'nope'"
    ):
        resolve_loss("examples.losses.entropy_bonus:nope")
    with pytest.raises(ConfigError, match="trainer.loss: 'examples.losses.gmpo:__doc__' is a str, not a function"):
        resolve_loss("examples.losses.gmpo:__doc__")


def bound_params(loss, params):
    return dict(bind_loss(TrainerConfig(loss=loss, loss_params=params), RolloutConfig(), lag_bound=0).params)


def test_loss_params_are_checked_against_the_loss_signature():
    no_mask = {"mask_c": None, "mask_level": "token"}
    assert bound_params("aipo", {}) == {"rho": 4.0, "is_level": "token", **no_mask}
    assert bound_params("aipo", {"rho": 2, "mask_c": 2}) == {
        "rho": 2.0,
        "is_level": "token",
        "mask_c": 2.0,
        "mask_level": "token",
    }
    assert bound_params("ppo_clip", {"eps_high": 0.28}) == {"eps": 0.2, "eps_high": 0.28, **no_mask}
    assert bound_params("gspo", {}) == {"eps": 3e-4, "eps_high": 4e-4}
    assert bound_params("examples.losses.entropy_bonus:aipo_with_entropy_bonus", {"entropy_coef": 0.1}) == {
        "rho": 4.0,
        "entropy_coef": 0.1,
    }
    with pytest.raises(ConfigError, match=r"loss_params.rho: must be > 1"):
        bound_params("aipo", {"rho": 0.5})
    with pytest.raises(
        ConfigError,
        match=r"loss_params.eps: .*has no such parameter \(its parameters: rho, is_level, "
        r"mask_c, mask_level\)",
    ):
        bound_params("aipo", {"eps": 0.2})
    with pytest.raises(ConfigError, match=r"loss_params.rho: .*has no such parameter \(its parameters: none\)"):
        bound_params("reinforce", {"rho": 2.0})
    with pytest.raises(ConfigError, match=r"loss_params.eps_high: must be in \(0, 1\)"):
        bound_params("ppo_clip", {"eps_high": 1.5})
    with pytest.raises(ConfigError, match=r"loss_params.rho: aipo expects float, got 'big'"):
        bound_params("aipo", {"rho": "big"})


def sample(reward, group):
    return Sample([1, 2], [3], [-0.1], [0], reward=reward, group_id=group)


def test_advantages():
    batch = [
        sample(1.0, 0),
        sample(0.0, 0),
        sample(0.5, 0),
        sample(0.0, 0),
        sample(2.0, 1),
        sample(2.0, 1),
        sample(7.0, 2),
    ]
    assert compute_advantages(batch) == pytest.approx([0.625, -0.375, 0.125, -0.375, 0.0, 0.0, 0.0])
    # RLOO: r_i minus the mean of the others
    assert compute_advantages(batch, "rloo")[:4] == pytest.approx(
        [1 - 0.5 / 3, 0 - 1.5 / 3, 0.5 - 1.0 / 3, 0 - 1.5 / 3]
    )
    std = torch.tensor([1.0, 0.0, 0.5, 0.0]).std(unbiased=False).item()
    assert compute_advantages(batch, normalize_std=True)[0] == pytest.approx(0.625 / (std + 1e-6))
    with pytest.raises(ConfigError, match="advantage estimator 'ppo'"):
        compute_advantages(batch, "ppo")
