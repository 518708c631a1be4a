"""A user-defined sequence-level loss: GMPO (Geometric-Mean Policy Optimization, arXiv 2507.20673).

    trainer:
      loss: examples.losses.gmpo:gmpo
      loss_params: {eps_low: 0.4, eps_high: 0.4}

GMPO maximises, per sample i, the geometric mean over its tokens of the
token-clipped ratio, times the advantage:

    J_i = A_i * exp( mean_t  clipped log r_t ),   r_t = pi_t / mu_t

where, as in PPO, the clip in log space [-eps_low, eps_high] is applied only on
the side that would increase the objective (sign(A) * log r is capped).

It shows what a loss may read besides per-token tensors: ``inputs.sequence_mean``
reduces over each sample's trained tokens (a sample never straddles micro-batches;
a token its loss_mask leaves out is not in ``inputs``), and
``inputs.to_tokens`` spreads a per-sample value back over its tokens. The loss
puts J_i on every token of sample i and declares ``loss_agg =
"seq_mean_token_mean"``: the hook then averages it over tokens within the sample
and over the samples of the whole step, which is GMPO's (1/G) sum_i J_i exactly,
however the step was split into micro-batches and DP ranks.
"""

from megarl.trainer.losses import LossInputs, LossOutput


def gmpo(inputs: LossInputs, *, eps_low: float = 0.4, eps_high: float = 0.4) -> LossOutput:
    log_r = inputs.logprobs - inputs.behaviour_logprobs  # with gradient
    sign = inputs.advantages.sign()
    # sign(A) * log r capped at the clipped value: past the clip the token has no gradient
    signed = sign * log_r
    capped = sign * log_r.clamp(-eps_low, eps_high)
    clipped_log_r = sign * signed.minimum(capped)
    seq_ratio = inputs.sequence_mean(clipped_log_r).exp()
    per_sample = -inputs.sequence_mean(inputs.advantages) * seq_ratio
    return LossOutput(inputs.to_tokens(per_sample), clipped=(capped < signed).detach())


def _check(params: dict) -> None:
    for key in ("eps_low", "eps_high"):
        if params[key] <= 0:
            raise ValueError(f"{key} must be > 0, got {params[key]}")


gmpo.check_params = _check
gmpo.loss_agg = "seq_mean_token_mean"
