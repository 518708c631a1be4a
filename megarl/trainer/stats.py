"""The loss hook's statistics: one fixed-layout vector per micro-batch, summed over
micro-batches and DP ranks (ratio_max: max) into the step's metrics.

Mismatch between mu (the generator) and pi (the trainer) has two causes:
staleness (a token sampled by an older policy, lag = trainer version - token
version) and numerics (another engine, fp8, other kernels). Bucketing the
importance ratio r = pi / mu by lag separates them: lag 0 is numerics alone.
Per bucket b = 0..lag_bound (the largest lag trained on; the last bucket also
holds any older token) the step reports kl_mu_pi_lag<b> (k3 estimate of KL(mu || pi): E_mu[r - 1 - log r]),
ratio_mean_lag<b>, ratio_std_lag<b> and tokens_lag<b>. Sums are float64 (the
ratio spread at lag 0 is ~1e-3: E[r^2] - E[r]^2 in float32 would lose it).

Every statistic is over trained tokens (loss_mask 1): the hook's inputs hold no
other (megarl.trainer.aggregation), so a masked token's placeholder log mu and
version never reach a sum, and ``seqs`` counts the samples with a trained token.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

BASE_FIELDS = (
    "loss_sum",
    "tokens",
    "ratio_sum",
    "ratio_sq_sum",
    "ratio_max",
    "clipped",
    "kl_mu_pi_sum",
    "entropy_sum",
    "kl_ref_sum",
    "masked",
    "seqs",
    "clipped_seqs",
    "masked_seqs",
)
LAG_FIELDS = ("tokens", "kl_mu_pi_sum", "ratio_sum", "ratio_sq_sum")


def stat_fields(lag_bound: int) -> Tuple[str, ...]:
    return BASE_FIELDS + tuple(f"{f}_lag{b}" for b in range(lag_bound + 1) for f in LAG_FIELDS)


def micro_batch_stats(inputs, out, loss_sum: torch.Tensor, kl_ref: torch.Tensor, lag_bound: int) -> torch.Tensor:
    """This micro-batch's vector (layout ``stat_fields(lag_bound)``)."""
    with torch.no_grad():
        f64 = torch.float64
        log_ratio = (inputs.logprobs.detach() - inputs.behaviour_logprobs).to(f64)
        ratio = log_ratio.exp()
        kl = ratio - 1.0 - log_ratio
        zeros = torch.zeros_like(ratio, dtype=torch.bool)
        clipped = out.clipped if out.clipped is not None else zeros
        masked = out.masked if out.masked is not None else zeros
        index, n = inputs.segments()
        # samples with a trained token (a sample packed with none has length 0 and adds nothing)
        seqs = float((inputs.response_lengths > 0).sum()) if inputs.response_lengths is not None else float(n)

        def touched(flags):  # samples with at least one flagged token
            per_sample = torch.zeros(n, dtype=f64, device=ratio.device).index_add(0, index, flags.to(f64))
            return (per_sample > 0).sum()

        base = [
            loss_sum.detach().to(f64),
            torch.tensor(float(ratio.numel()), dtype=f64),
            ratio.sum(),
            (ratio * ratio).sum(),
            ratio.max() if ratio.numel() else torch.tensor(0.0, dtype=f64),
            clipped.to(f64).sum(),
            kl.sum(),
            inputs.entropy.detach().to(f64).sum(),
            kl_ref.detach().to(f64).sum(),
            masked.to(f64).sum(),
            torch.tensor(seqs, dtype=f64),
            touched(clipped),
            touched(masked),
        ]
        lags = inputs.lags if inputs.lags is not None else torch.zeros_like(index)
        bucket = lags.clamp(0, lag_bound)
        per_lag = torch.zeros(lag_bound + 1, len(LAG_FIELDS), dtype=f64, device=ratio.device)
        per_lag.index_add_(0, bucket, torch.stack([torch.ones_like(ratio), kl, ratio, ratio * ratio], dim=1))
        return torch.cat([torch.stack([b.to(ratio.device) for b in base]), per_lag.flatten()])


def _ratio_std(total: float, sq: float, n: float) -> float:
    if n == 0:
        return math.nan
    return math.sqrt(max(sq / n - (total / n) ** 2, 0.0))


def metrics_from_totals(totals: torch.Tensor, lag_bound: int) -> dict:
    t = dict(zip(stat_fields(lag_bound), totals.tolist()))
    n = max(t["tokens"], 1.0)
    seqs = max(t["seqs"], 1.0)
    out = {
        "loss": t["loss_sum"] / n,
        "response_tokens": int(t["tokens"]),  # the trained ones (loss_mask 1)
        "clip_frac": t["clipped"] / n,  # tokens whose importance weight was truncated / clipped
        "clip_seq_frac": t["clipped_seqs"] / seqs,  # samples with at least one such token
        "mask_frac": t["masked"] / n,  # tokens dropped by masked importance sampling
        "mask_seq_frac": t["masked_seqs"] / seqs,
        "ratio_mean": t["ratio_sum"] / n,
        "ratio_std": _ratio_std(t["ratio_sum"], t["ratio_sq_sum"], t["tokens"]),
        "ratio_max": t["ratio_max"],
        # ESS = (sum w)^2 / (N sum w^2) over trained tokens, w = pi / mu
        "ess": (t["ratio_sum"] ** 2) / (n * t["ratio_sq_sum"]) if t["ratio_sq_sum"] > 0 else math.nan,
        "kl_mu_pi": t["kl_mu_pi_sum"] / n,
        "kl_ref": t["kl_ref_sum"] / n,
        "entropy": t["entropy_sum"] / n,
    }
    for b in range(lag_bound + 1):
        k = t[f"tokens_lag{b}"]
        out[f"tokens_lag{b}"] = int(k)
        out[f"kl_mu_pi_lag{b}"] = t[f"kl_mu_pi_sum_lag{b}"] / k if k else math.nan
        out[f"ratio_mean_lag{b}"] = t[f"ratio_sum_lag{b}"] / k if k else math.nan
        out[f"ratio_std_lag{b}"] = _ratio_std(t[f"ratio_sum_lag{b}"], t[f"ratio_sq_sum_lag{b}"], k)
    return out
