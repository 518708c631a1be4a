"""The loss mask: a masked response token contributes exactly nothing, for every loss and aggregation mode.

A batch of five samples whose masks cover every shape: every other token masked
(half), the first half, the second half, none, and every token (a sample that still
counts in its group's baseline). Masked tokens carry the placeholders a generator
writes (NaN behaviour log-prob, version -1) and, where the model would give them
values, junk that would show if read (log pi +3, entropy 100, reference log-prob -50).
The batch runs through the trainer's own path -- shape_batch (advantages, samples the
loss leaves out), packing over 1 and 2 DP ranks and several micro-batches, the hook's
trained-position selection and micro-batch loss, the statistics, the hand-back of
log pi -- and the step's loss, its gradients with respect to every token's log pi and
entropy, and its metrics equal the definitions (tests/loss_references.py) evaluated
in float64 on the batch with the masked tokens removed and the wholly masked sample
left out of the loss: 1e-10. Masked tokens' gradients are exactly 0.
"""

import math

import pytest
import torch

from megarl.config import RolloutConfig, TrainerConfig
from megarl.executors.trainer import StaleSampleError, apply_lag_policy, check_lag
from megarl.rollout import MASKED_LOGPROB, MASKED_VERSION, Sample
from megarl.trainer.advantages import compute_advantages
from megarl.trainer.bound_loss import bind_loss
from megarl.trainer.hooks import micro_batch_loss, trained_positions
from megarl.trainer.losses import BUILTIN_LOSSES
from megarl.trainer.packing import plan_micro_batches
from megarl.trainer.policy_trainer import per_sample_logprobs, shape_batch, trained_logprobs_flat
from megarl.trainer.stats import BASE_FIELDS, metrics_from_totals
from tests.loss_references import AGG_MODES, ENTROPY_BONUS, RefSample, mismatch_metrics, objective

VERSION, LAG_BOUND, M = 5, 2, 8
KL_COEF, ENTROPY_COEF = 0.1, 0.05
JUNK_LOGP, JUNK_ENTROPY, JUNK_REF = 3.0, 100.0, -50.0  # what a masked (or prompt) position holds
# Per sample: prompt length, reward, group, loss mask, and for its trained tokens (in order) log pi,
# log mu, entropy, reference log-prob, version. log mu and the rewards are exact in float32 (the
# packed rows' dtype), so the float64 reference sees the same values.
SAMPLES = [
    # every other token masked; log r 0.5, -0.2, 2.0 (above rho, outside the mask band)
    (3, 1.5, 0, [1, 0, 1, 0, 1, 0], [-0.5, -1.2, -2.0], [-1.0, -1.0, -4.0], [1.5, 0.7, 2.2], [-0.8, -1.0, -2.5], [4, 4, 5]),
    # the first half masked; log r -0.05, 0.1
    (2, 0.0, 0, [0, 0, 1, 1], [-0.3, -0.9], [-0.25, -1.0], [0.3, 1.1], [-0.2, -1.3], [3, 3]),
    # the second half masked; log r 0.125, -0.075, -1.2, 0.1
    (4, 1.0, 1, [1, 1, 1, 1, 0, 0, 0, 0], [-1.0, -0.7, -2.2, -0.4], [-1.125, -0.625, -1.0, -0.5],
     [0.9, 1.8, 0.4, 2.6], [-1.1, -0.5, -2.0, -0.6], [4, 4, 5, 5]),
    # every token masked: its reward (0) still in group 0's baseline (mean 0.5, not 0.75)
    (2, 0.0, 0, [0, 0, 0], [], [], [], [], []),
    # nothing masked; log r -0.1, 0.25
    (3, 0.0, 1, [1, 1], [-0.6, -1.5], [-0.5, -1.75], [1.2, 0.5], [-0.7, -1.4], [5, 5]),
]  # fmt: skip


def response(field, s):
    """A sample's per-token list over all its response tokens: trained values in order, ``fill`` at masked."""
    values, fill = field
    it = iter(values)
    return [next(it) if m else fill for m in s[3]]


def samples():
    out = []
    for k, s in enumerate(SAMPLES):
        prompt, reward, group, mask = s[0], s[1], s[2], s[3]
        out.append(
            Sample(
                [7 + k] * prompt,
                [20 + j for j in range(len(mask))],
                response((s[5], MASKED_LOGPROB), s),
                response((s[8], MASKED_VERSION), s),
                reward=reward,
                group_id=group,
                loss_mask=list(mask),
            )
        )
    return out


def group_mean_advantages():
    rewards = [(s[1], s[2]) for s in SAMPLES]
    return [r - sum(x for x, g2 in rewards if g2 == g) / sum(1 for _, g2 in rewards if g2 == g) for r, g in rewards]


def reference_batch():
    """The batch as the definitions see it: trained tokens only, the wholly masked sample left out."""
    adv = group_mean_advantages()
    return [
        RefSample(s[4], s[5], adv[k], s[6], s[7], [VERSION - v for v in s[8]]) for k, s in enumerate(SAMPLES) if s[4]
    ]


LOSSES = [  # (loss, params): every registered loss (the built-ins, the examples), and the variants that
    # reduce over a sample's tokens (sequence-level IS weight and mask)
    ("aipo", {}),
    ("aipo", {"rho": 2.0, "is_level": "sequence", "mask_c": 3.0}),
    ("aipo", {"mask_c": 1.5, "mask_level": "sequence"}),
    ("ppo_clip", {}),
    ("ppo_clip", {"eps_high": 0.28, "mask_c": 1.5}),
    ("dr_grpo", {}),
    ("gspo", {"eps": 0.1, "eps_high": 0.2}),
    ("reinforce", {}),
    ("sft", {}),
    ("examples.losses.gmpo:gmpo", {"eps_low": 0.3}),
    (ENTROPY_BONUS, {"entropy_coef": 0.1}),
]
CASES = [(loss, params, agg) for loss, params in LOSSES for agg in AGG_MODES if loss != "dr_grpo"] + [
    ("dr_grpo", {}, "seq_mean_token_sum_norm")  # defined by its aggregation: another is refused
]
SPLITS = {  # (DP ranks, max_tokens_per_microbatch, the wholly masked sample packed too)
    "1mb": (1, 64, False),
    "dp2-small": (2, 12, False),
    "packed-with-empty": (2, 12, True),
}


def test_the_cases_cover_every_registered_loss_and_mode():
    assert {loss for loss, _, _ in CASES} >= set(BUILTIN_LOSSES) | {"examples.losses.gmpo:gmpo", ENTROPY_BONUS}
    assert {agg for _, _, agg in CASES} == set(AGG_MODES)


def run_step(loss, params, agg, split):
    """The step through the trainer's path: (value, count, grad log pi, grad entropy, metrics, handed back)."""
    dp, budget, pack_empty = SPLITS[split]
    bound = bind_loss(
        TrainerConfig(
            loss=loss, loss_params=params, loss_agg=agg, kl_coef=KL_COEF, entropy_coef=ENTROPY_COEF, kl_estimator="k3"
        ),
        RolloutConfig(temperature=1.0, max_new_tokens=M),
        lag_bound=LAG_BOUND,
    )
    batch = samples()
    if pack_empty:  # as if the wholly masked sample reached the packing: it must add nothing there either
        kept, advantages = batch, compute_advantages(batch)
    else:
        kept, advantages, _ = shape_batch(batch, bound)
        assert kept == [batch[k] for k in (0, 1, 2, 4)]  # the wholly masked sample is left out
    # per response token (masked ones too) of every sample: leaves the gradient is read from
    logp = [torch.tensor(response((s[4], JUNK_LOGP), s), dtype=torch.float64, requires_grad=True) for s in SAMPLES]
    entropy = [
        torch.tensor(response((s[6], JUNK_ENTROPY), s), dtype=torch.float64, requires_grad=True) for s in SAMPLES
    ]
    ref = [torch.tensor(response((s[7], JUNK_REF), s), dtype=torch.float64) for s in SAMPLES]
    index = {id(s): k for k, s in enumerate(batch)}
    total, count, stats, micro_batches = 0.0, 0, [], []
    for rank in range(dp):
        plan = plan_micro_batches(kept, advantages, rank, dp, budget, False, False, version=VERSION)
        for mb in plan.micro_batches:
            # the row as the model would give it: junk at prompt and padding positions, each response
            # token's value (the masked tokens' junk included) where packing put it
            rows = {name: [torch.full((0,), 0.0, dtype=torch.float64)] for name in ("logp", "entropy", "ref")}
            for i in mb.sample_indices:
                k = index[id(kept[i])]
                junk = torch.full((SAMPLES[k][0] - 1,), JUNK_LOGP, dtype=torch.float64)
                for name, values in (("logp", logp), ("entropy", entropy), ("ref", ref)):
                    rows[name] += [junk, values[k]]
            pad = mb.length - sum(len(kept[i]) for i in mb.sample_indices)
            for name in rows:
                rows[name].append(torch.full((pad,), JUNK_LOGP, dtype=torch.float64))
            row = {name: torch.cat(parts) for name, parts in rows.items()}
            mb.ref_logprobs = row["ref"][None]
            on = trained_positions(mb)
            loss_sum, n, out = micro_batch_loss(bound, mb, on, row["logp"][on], row["entropy"][on])
            total, count = total + loss_sum, count + int(n)
            stats.append(out["stats"])
            micro_batches.append(mb)
    value = total / count  # Megatron divides by the step's count
    value.backward()
    totals = torch.stack(stats).sum(0)
    totals[BASE_FIELDS.index("ratio_max")] = torch.stack(stats)[:, BASE_FIELDS.index("ratio_max")].max()
    flat = torch.zeros(sum(s.trained_tokens for s in kept))
    trained_logprobs_flat(kept, micro_batches, flat)
    handed_back = per_sample_logprobs(kept, flat.tolist())
    return (
        value.item(),
        count,
        [x.grad for x in logp],
        [x.grad for x in entropy],
        metrics_from_totals(totals, LAG_BOUND),
        {index[id(s)]: h for s, h in zip(kept, handed_back)},
    )


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("loss, params, agg", CASES, ids=[f"{c[0].split(':')[-1]}{c[1] or ''}-{c[2]}" for c in CASES])
def test_masked_tokens_give_the_loss_of_the_batch_without_them(loss, params, agg, split):
    value, count, grad_logp, grad_entropy, m, handed_back = run_step(loss, params, agg, split)
    batch = reference_batch()
    r = objective(loss, params, agg, batch, M, kl_coef=KL_COEF, entropy_coef=ENTROPY_COEF)
    trained = sum(len(s.logp) for s in batch)
    assert count == trained == 11  # Megatron's normaliser: the trained tokens only
    assert value == pytest.approx(r.value, rel=1e-10, abs=1e-12)
    assert m["loss"] == pytest.approx(r.value, rel=1e-10, abs=1e-12)
    ref_grads = iter(zip(r.grad_logp, r.grad_entropy))
    for k, s in enumerate(SAMPLES):
        mask = s[3]
        g_logp = grad_logp[k].tolist() if grad_logp[k] is not None else [0.0] * len(mask)
        g_h = grad_entropy[k].tolist() if grad_entropy[k] is not None else [0.0] * len(mask)
        # a masked token: exactly no gradient, to log pi or to the entropy
        assert [g for g, keep in zip(g_logp + g_h, mask + mask) if not keep] == [0.0] * (2 * mask.count(0))
        if not s[4]:
            continue
        want_logp, want_h = next(ref_grads)
        assert [g for g, keep in zip(g_logp, mask) if keep] == pytest.approx(want_logp, rel=1e-10, abs=1e-13)
        assert [g for g, keep in zip(g_h, mask) if keep] == pytest.approx(want_h, rel=1e-10, abs=1e-13)
    # every metric over the trained tokens: none reads a placeholder
    assert all(math.isfinite(v) for v in m.values() if isinstance(v, float)), m
    want = mismatch_metrics(batch, LAG_BOUND)
    for key, expected in want.items():
        assert m[key] == pytest.approx(expected, rel=1e-10), key
    assert m["entropy"] == pytest.approx(sum(h for s in batch for h in s.entropy) / trained, rel=1e-10)
    k3 = [math.exp(q - lp) - (q - lp) - 1 for s in batch for lp, q in zip(s.logp, s.ref)]
    assert m["kl_ref"] == pytest.approx(sum(k3) / trained, rel=1e-10)
    seqs = len(batch)  # the wholly masked sample is no sequence of the step
    for name, flags in (("clip", r.clipped), ("mask", r.masked)):
        assert m[f"{name}_frac"] == pytest.approx(sum(map(sum, flags)) / trained, rel=1e-12), name
        assert m[f"{name}_seq_frac"] == pytest.approx(sum(any(f) for f in flags) / seqs, rel=1e-12), name
    # log pi handed back per response token: the trained ones' values, None at each masked token
    for k, s in enumerate(SAMPLES):
        if not s[4]:  # left out of the loss whole (shape_batch): nothing handed back
            assert handed_back.get(k) is None or handed_back[k] == [None] * len(s[3])
            continue
        assert [x is None for x in handed_back[k]] == [not keep for keep in s[3]]
        assert [x for x in handed_back[k] if x is not None] == pytest.approx(s[4], abs=1e-6)


def test_the_cases_exercise_clips_and_masks():
    # a flag the batch never raises would pass any implementation of it
    batch = reference_batch()
    for loss, params in [("aipo", {}), ("ppo_clip", {}), ("gspo", {"eps": 0.1, "eps_high": 0.2})]:
        flags = objective(loss, params, None, batch, M).clipped
        assert 0 < sum(map(sum, flags)) < sum(map(len, flags)), loss
    flags = objective("ppo_clip", {"eps_high": 0.28, "mask_c": 1.5}, None, batch, M).masked
    assert 0 < sum(map(sum, flags)) < sum(map(len, flags))


def test_check_lag_reads_only_trained_tokens():
    batch = samples()  # masked tokens carry version -1: 6 behind the trainer, and decreasing along a sample
    lags = check_lag(batch, VERSION, LAG_BOUND)
    assert lags == [VERSION - v for s in SAMPLES for v in s[8]]
    stale = samples()
    stale[2].policy_versions[0] = 2  # a trained token 3 behind
    with pytest.raises(StaleSampleError, match="sample 2 .*policy version 2"):
        check_lag(stale, VERSION, LAG_BOUND)
    decreasing = samples()
    decreasing[0].policy_versions[4] = 3  # trained tokens 4, 4, 3
    with pytest.raises(StaleSampleError, match="sample 0 .*decrease"):
        check_lag(decreasing, VERSION, LAG_BOUND)


def test_lag_policy_masks_only_trained_tokens_past_the_bound():
    """rollout.max_lag_policy at the trainer, 2 versions ahead of the batch: version 7, bound 2 leaves
    versions 3 and 4 behind -- two trained tokens each of samples 0 (versions 4, 4, 5; 6 response
    tokens: len_q3 of M = 8), 1 (3, 3; 4 tokens: len_q2) and 2 (4, 4, 5, 5; 8 tokens: len_q4); the
    placeholders (version -1) of masked tokens are no token at all."""
    want = {"trained_samples": (1, 2, 1, 1), "lag_stale_samples": (0, 1, 1, 1)}
    for policy in ("wait", "keep", "mask", "drop"):
        batch = samples()
        counts = apply_lag_policy(batch, 7, LAG_BOUND, policy, M)
        masked = (0, 2, 2, 2) if policy == "mask" else (0, 0, 0, 0)
        for name, per_bucket in {**want, "lag_masked_tokens": masked}.items():
            assert tuple(counts[f"{name}_len_q{q}"] for q in (1, 2, 3, 4)) == per_bucket, (policy, name)
        if policy != "mask":
            assert [s.loss_mask for s in batch] == [list(s[3]) for s in SAMPLES]  # nothing changes
            with pytest.raises(StaleSampleError, match="sample 0 .*policy version 4"):
                check_lag(batch, 7, LAG_BOUND)
            assert max(check_lag(batch, 7, LAG_BOUND, refuse=False)) == 4  # keep: trained as they are
            continue
        assert [s.loss_mask for s in batch] == [
            [0, 0, 0, 0, 1, 0],
            [0, 0, 0, 0],  # wholly masked now: its reward still counts in group 0's baseline
            [0, 0, 1, 1, 0, 0, 0, 0],
            [0, 0, 0],
            [1, 1],
        ]
        assert check_lag(batch, 7, LAG_BOUND) == [2] * 5


def test_packing_keeps_placeholders_out_of_every_row():
    batch = samples()
    plan = plan_micro_batches(batch, compute_advantages(batch), 0, 1, 64, False, False, version=VERSION)
    (mb,) = plan.micro_batches
    assert (mb.step_tokens, mb.step_sequences) == (11, 4)  # trained tokens; samples with one
    order = [SAMPLES[i] for i in mb.sample_indices]  # the row's order (longest first)
    assert mb.response_lengths.tolist() == [len(s[4]) for s in order]
    for row in (mb.behaviour_logprobs, mb.advantages, mb.lags, mb.policy_versions):
        assert torch.isfinite(row.double()).all()
    on = trained_positions(mb)
    assert int(on.sum()) == 11
    assert mb.behaviour_logprobs[0][on].tolist() == [x for s in order for x in s[5]]
    assert mb.policy_versions[0][on].tolist() == [v for s in order for v in s[8]]
    assert (mb.policy_versions[0][~on] == -1).all() and (mb.sample_ids[0][~on] == -1).all()
