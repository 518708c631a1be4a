"""Every registered loss and aggregation mode written out from its definition, in plain float64 Python.

A batch is a list of ``RefSample``: the tokens of each sample that the loss trains on,
nothing else (a test that masks tokens gives here the batch with those tokens removed,
and leaves out a sample with none). The step's loss is

    sum_i c_i sum_{t in i} l_t,    c_i = 1/N | 1/(S n_i) | 1/S | 1/(S M)   (the four modes)

with N the tokens and S the samples of the batch, n_i the tokens of sample i and l_t
the loss's per-token value (a sequence-level loss puts its l_i on each of the sample's
tokens) plus the KL penalty (k3) and minus the entropy bonus. Gradients with respect to
each token's log pi and entropy are written by hand too. Shares no code with megarl.trainer.
"""

import math
from dataclasses import dataclass, field
from typing import List

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")


@dataclass
class RefSample:
    logp: List[float]  # log pi of each trained token
    mu: List[float]  # log mu
    adv: float
    entropy: List[float] = field(default_factory=list)
    ref: List[float] = field(default_factory=list)  # the reference policy's log-probs (KL penalty)
    lags: List[int] = field(default_factory=list)


@dataclass
class Reference:
    value: float
    grad_logp: List[List[float]]  # per sample, per token
    grad_entropy: List[List[float]]
    clipped: List[List[bool]]
    masked: List[List[bool]]  # by masked importance sampling (mask_c), not by the loss mask


def coefficient(agg: str, batch: List[RefSample], i: int, max_new_tokens: int) -> float:
    n_total = sum(len(s.logp) for s in batch)
    seqs = len(batch)
    return {
        "token_mean": 1 / n_total,
        "seq_mean_token_mean": 1 / (seqs * len(batch[i].logp)),
        "seq_mean_token_sum": 1 / seqs,
        "seq_mean_token_sum_norm": 1 / (seqs * max_new_tokens),
    }[agg]


def _mean(xs):
    return sum(xs) / len(xs)


def _clip(x, low, high):
    return min(max(x, low), high)


def _keep(log_r: List[float], mask_c, mask_level) -> List[bool]:
    """Masked importance sampling: inside [1/c, c], by token or by the sample's mean log-ratio."""
    if mask_c is None:
        return [True] * len(log_r)
    if mask_level == "sequence":
        return [abs(_mean(log_r)) <= math.log(mask_c)] * len(log_r)
    return [abs(x) <= math.log(mask_c) for x in log_r]


def _aipo(s, rho=4.0, is_level="token", mask_c=None, mask_level="token"):
    log_r = [lp - mu for lp, mu in zip(s.logp, s.mu)]
    raw = [math.exp(_mean(log_r) if is_level == "sequence" else x) for x in log_r]
    keep = _keep(log_r, mask_c, mask_level)
    w = [min(r, rho) for r in raw]
    loss = [-wt * s.adv * lp * k for wt, lp, k in zip(w, s.logp, keep)]
    grad = [-wt * s.adv * k for wt, k in zip(w, keep)]  # the weight carries no gradient
    clipped = [r > rho and k for r, k in zip(raw, keep)]
    return loss, grad, clipped, [not k for k in keep] if mask_c is not None else [False] * len(keep)


def _ppo(s, eps=0.2, eps_high=None, mask_c=None, mask_level="token"):
    eps_high = eps if eps_high is None else eps_high
    log_r = [lp - mu for lp, mu in zip(s.logp, s.mu)]
    keep = _keep(log_r, mask_c, mask_level)
    loss, grad, clipped = [], [], []
    for x, k in zip(log_r, keep):
        r = math.exp(x)
        cr = _clip(r, 1 - eps, 1 + eps_high)
        loss.append(-min(r * s.adv, cr * s.adv) * k)
        # d(-r A)/d log pi = -r A where the unclipped term is the minimum; the clipped one is constant
        grad.append((-r * s.adv if r * s.adv <= cr * s.adv else 0.0) * k)
        clipped.append(cr * s.adv < r * s.adv and k)
    return loss, grad, clipped, [not k for k in keep] if mask_c is not None else [False] * len(keep)


def _gspo(s, eps=3e-4, eps_high=4e-4):
    n = len(s.logp)
    seq = math.exp(_mean([lp - mu for lp, mu in zip(s.logp, s.mu)]))
    cs = _clip(seq, 1 - eps, 1 + eps_high)
    value = -min(seq * s.adv, cs * s.adv)
    # every token carries l_i; d s_i / d log pi_t = s_i / n_i, times the n_i tokens that carry it
    grad = -s.adv * seq if seq * s.adv <= cs * s.adv else 0.0
    return [value] * n, [grad] * n, [cs * s.adv < seq * s.adv] * n, [False] * n


def _gmpo(s, eps_low=0.4, eps_high=0.4):
    n = len(s.logp)
    log_r = [lp - mu for lp, mu in zip(s.logp, s.mu)]
    # the log-ratio clipped on the side that would raise the objective: A > 0 caps it above, A < 0 below
    chosen = [
        min(x, _clip(x, -eps_low, eps_high)) if s.adv > 0 else max(x, _clip(x, -eps_low, eps_high)) for x in log_r
    ]
    g = math.exp(_mean(chosen))
    live = [x <= eps_high if s.adv > 0 else x >= -eps_low for x in log_r]
    clipped = [x > eps_high if s.adv > 0 else (x < -eps_low if s.adv < 0 else False) for x in log_r]
    return [-s.adv * g] * n, [-s.adv * g if lv else 0.0 for lv in live], clipped, [False] * n


def _reinforce(s):
    n = len(s.logp)
    return [-s.adv * lp for lp in s.logp], [-s.adv] * n, [False] * n, [False] * n


def _sft(s):
    """Negative log-likelihood: value -log pi, gradient -1 per token, whatever the advantage."""
    n = len(s.logp)
    return [-lp for lp in s.logp], [-1.0] * n, [False] * n, [False] * n


LOSSES = {
    "aipo": _aipo,
    "ppo_clip": _ppo,
    "dr_grpo": _ppo,
    "gspo": _gspo,
    "reinforce": _reinforce,
    "sft": _sft,
    "examples.losses.gmpo:gmpo": _gmpo,
}
OWN_AGG = {
    "gspo": "seq_mean_token_mean",
    "dr_grpo": "seq_mean_token_sum_norm",
    "examples.losses.gmpo:gmpo": "seq_mean_token_mean",
}
ENTROPY_BONUS = "examples.losses.entropy_bonus:aipo_with_entropy_bonus"


def objective(loss, params, agg, batch, max_new_tokens, kl_coef=0.0, entropy_coef=0.0) -> Reference:
    """The step's loss over ``batch`` and its gradients, from the definitions."""
    agg = agg or OWN_AGG.get(loss, "token_mean")
    params = dict(params)
    coef = entropy_coef
    if loss == ENTROPY_BONUS:  # the example: aipo with a bonus of its own
        coef += params.pop("entropy_coef", 0.01)
        fn = _aipo
    else:
        fn = LOSSES[loss]
    value, grad_logp, grad_h, clipped, masked = 0.0, [], [], [], []
    for i, s in enumerate(batch):
        c = coefficient(agg, batch, i, max_new_tokens)
        per_token, grad, flags, mis = fn(s, **params)
        gl, gh = [], []
        for t, (l_t, g_t) in enumerate(zip(per_token, grad)):
            if kl_coef:
                d = s.ref[t] - s.logp[t]
                l_t += kl_coef * (math.exp(d) - d - 1.0)
                g_t += kl_coef * (1.0 - math.exp(d))
            if coef:
                l_t -= coef * s.entropy[t]
            value += c * l_t
            gl.append(c * g_t)
            gh.append(-c * coef)
        grad_logp.append(gl)
        grad_h.append(gh)
        clipped.append(flags)
        masked.append(mis)
    return Reference(value, grad_logp, grad_h, clipped, masked)


def mismatch_metrics(batch: List[RefSample], lag_bound: int) -> dict:
    """The step's importance-ratio metrics over ``batch``'s tokens, per lag bucket too."""
    ratios = [math.exp(lp - mu) for s in batch for lp, mu in zip(s.logp, s.mu)]
    n = len(ratios)
    mean = sum(ratios) / n
    out = {
        "response_tokens": n,
        "ratio_mean": mean,
        "ratio_std": math.sqrt(sum((r - mean) ** 2 for r in ratios) / n),
        "ratio_max": max(ratios),
        "ess": sum(ratios) ** 2 / (n * sum(r * r for r in ratios)),
        "kl_mu_pi": sum(r - 1 - math.log(r) for r in ratios) / n,
    }
    for b in range(lag_bound + 1):
        rs = [math.exp(lp - mu) for s in batch for lp, mu, g in zip(s.logp, s.mu, s.lags) if min(g, lag_bound) == b]
        out[f"tokens_lag{b}"] = len(rs)
        out[f"ratio_mean_lag{b}"] = sum(rs) / len(rs)
        out[f"kl_mu_pi_lag{b}"] = sum(r - 1 - math.log(r) for r in rs) / len(rs)
    return out
