"""RL gradients through Megatron (schedule, DDP, vocab-parallel log-probs, packing) equal a
plain PyTorch reference on transformers' model, at every layout and however the batch
is split into micro-batches: AIPO at every layout; GSPO, sequence-level truncated and
masked importance sampling, Dr.GRPO, the aggregation modes, the entropy bonus and a
user loss (GMPO) at TP2 x PP2 split into 1/2/4 micro-batches, at TP2 x DP2 and on one rank; AIPO with
sequence parallelism at TP2 x DP2 and TP2 x PP2; and the
loss mask at the same layouts: a batch with half of some responses masked (one sample wholly) against
the reference that leaves those tokens out of the loss. Two launches in all (1 and 4 ranks); each
loads the model once per layout."""

import json
import math
from dataclasses import replace

import pytest

from megarl.checkpointing.dist_checkpoint_reader import DistCheckpointReader
from megarl.checkpointing.megatron_checkpoint import read_spec
from megarl.models.hf_mapping import tensor_mappings, to_hf
from tests.conftest import run_ranks
from tests.fp32_bounds import fp32_gradient_bound, fp32_logprob_bound, read_config
from tests.rl_batch import (
    CASES,
    TEMPERATURE,
    VERSION,
    make_samples,
    masked_samples,
    reference_grads,
    response_logprobs,
    save_samples,
)

pytestmark = pytest.mark.slow

SEQ_CASES = "gspo,aipo_seq,ppo_mis,dr_grpo,gmpo"
MASKED_CASES = "aipo_masked,gspo_masked,aipo_seq_masked"
RUN_CASES = f"aipo,{SEQ_CASES},{MASKED_CASES}"
SINGLE = ["1x1:128", "1x1:64", "1x1:32"]  # 1, 2 and 4 micro-batches
# TP2.DP2, PP2.DP2, TP2xPP2, VP, DP4; TP2.DP2 and TP2xPP2 with sequence parallelism (on CPU through
# megatron_patches/torch_norm_sp.py: an unsummed norm-weight gradient fails them)
WORLD4 = ["2x1:32", "1x2:32", "2x2:64", "1x2x2:32", "1x1:16", "2x1sp:32", "2x2sp:64"]
SEQ_RUNS = ["1x1:32", "2x2:128", "2x2:64", "2x2:32", "2x1:32"]  # one rank; TP2xPP2 at 1/2/4 micro-batches; TP2.DP2


def megatron_grads_as_hf(ckpt_dir):
    reader = DistCheckpointReader(ckpt_dir / "release")
    spec = read_spec(ckpt_dir / "release")
    grads = {}
    for m in tensor_mappings(spec):
        for layer in range(spec.num_layers) if m.per_layer else [None]:
            grads.update(to_hf(m, spec, reader.read(m.megatron_key, layer), layer))
    return grads


@pytest.fixture(scope="module")
def batch(tiny_hf, tmp_path_factory):
    path = tmp_path_factory.mktemp("rl") / "samples.pt"
    samples = make_samples(tiny_hf, vocab_size=300)
    save_samples(samples, path)
    return samples, path


@pytest.fixture(scope="module")
def references(tiny_hf, batch):
    """case -> (gradients, loss, the loss's sensitivity to its log-probs: reference_grads)."""
    return {case: reference_grads(tiny_hf, batch[0], CASES[case], sensitivity=True) for case in RUN_CASES.split(",")}


# fp32 rounding, derived (tests/fp32_bounds.py), Megatron at its layout against transformers, both fp32:
# - a token's log-prob (at the sampling temperature): delta = fp32_logprob_bound;
# - the loss: every log-prob of the vocabulary moves by at most delta, so to first order the loss by
#   delta sum_t (|dL/d log p_t| + |dL/dH_t| (1 + H_t)) (the entropy H = -sum p log p by delta (1 + H)),
#   the sum read off the reference's own autograd (reference_grads' sensitivity);
# - the gradient: fp32_gradient_bound over the batch's positions, for the whole gradient's relative
#   error, twice it for the worst single tensor.
# test_the_bounds_catch_an_off_by_one_token_and_a_missing_term shows what those mistakes do.
@pytest.fixture(scope="module")
def bounds(tiny_hf, batch):
    samples = batch[0]
    positions = sum(len(s.prompt_tokens) + len(s.response_tokens) - 1 for s in samples)
    delta = fp32_logprob_bound(tiny_hf, [s.prompt_tokens + s.response_tokens for s in samples], TEMPERATURE)
    return {"logprob": delta, "gradient": fp32_gradient_bound(read_config(tiny_hf), positions)}


@pytest.fixture(scope="module")
def megatron_runs(tiny_megatron, batch, tmp_path_factory):
    out = tmp_path_factory.mktemp("rl_grads")
    common = ["--checkpoint", tiny_megatron, "--samples", batch[1], "--out", out]
    single = [r if r != "1x1:32" else f"{r}:{RUN_CASES}" for r in SINGLE]
    world4 = [r if r not in SEQ_RUNS else f"{r}:{RUN_CASES}" for r in WORLD4]
    world4 += [f"{r}:{SEQ_CASES},{MASKED_CASES}" for r in SEQ_RUNS if r not in WORLD4 and r not in SINGLE]
    run_ranks(1, "rl_grad_worker.py", *common, "--runs", *single)
    run_ranks(4, "rl_grad_worker.py", *common, "--runs", *world4)
    return out


def relative_errors(ours: dict, ref_grads: dict):
    """(relative error of the whole gradient, of the worst single tensor)."""
    diff_sq = sum(((ours[k] - ref) ** 2).sum().item() for k, ref in ref_grads.items())
    ref_sq = sum((ref**2).sum().item() for ref in ref_grads.values())
    worst = max(((ours[k] - ref).norm() / ref.norm()).item() for k, ref in ref_grads.items())
    return (diff_sq / ref_sq) ** 0.5, worst


def check(out, run, case, reference, bounds):
    ref_grads, ref_loss, sensitivity = reference
    name = f"{run.replace(':', '_')}_{case}"
    record = json.loads((out / f"{name}.json").read_text())
    ours = megatron_grads_as_hf(out / name)
    assert sorted(ours) == sorted(ref_grads)
    loss_diff = abs(record["loss_sum"] / record["tokens"] - ref_loss)
    loss_bound = bounds["logprob"] * sensitivity
    overall, worst = relative_errors(ours, ref_grads)
    bound = bounds["gradient"]
    print(
        f"{run} {case}: {record['micro_batches']} micro-batches, relative gradient error {overall:.2e} "
        f"(worst tensor {worst:.2e}; {overall / bound:.3f} and {worst / (2 * bound):.3f} of the bound {bound:.2e}), "
        f"loss {record['loss_sum'] / record['tokens']:.6f} vs {ref_loss:.6f} ({loss_diff / loss_bound:.3f} of "
        f"the bound {loss_bound:.2e})"
    )
    assert loss_diff <= loss_bound
    assert overall <= bound and worst <= 2 * bound
    # the output layer computed logits for the trained tokens alone (trainer/response_logits.py),
    # not for the prompts packed with them nor for masked response tokens; under sequence parallelism
    # its input is split over TP and it computes every position
    if not run.split(":")[0].endswith("sp"):
        assert record["output_layer_rows"] == record["tokens"], (record["output_layer_rows"], record["tokens"])
    return record


@pytest.mark.parametrize("run", SINGLE + WORLD4)
def test_aipo_gradient_matches_transformers_reference(run, megatron_runs, references, bounds):
    record = check(megatron_runs, run, "aipo", references["aipo"], bounds)
    assert record["clipped"] > 0  # the batch exercises the clip


@pytest.mark.parametrize("case", SEQ_CASES.split(","))
@pytest.mark.parametrize("run", SEQ_RUNS)
def test_sequence_losses_match_transformers_reference(run, case, megatron_runs, references, bounds):
    m = check(megatron_runs, run, case, references[case], bounds)["metrics"]
    # the batch exercises what the case names: some but not all tokens clipped / masked, and
    # where it acts on whole sequences (gspo's clip, aipo_seq's weight, ppo_mis's mask), some
    # but not all sequences (token-level flags touch every sample of this noisy batch)
    flags = {
        "gspo": ["clip_seq"],
        "aipo_seq": ["clip_seq", "mask"],
        "ppo_mis": ["clip", "mask_seq"],
        "dr_grpo": ["clip"],
        "gmpo": ["clip"],
    }[case]
    for flag in flags:
        assert 0 < m[f"{flag}_frac"] < 1, (flag, m[f"{flag}_frac"])


@pytest.mark.parametrize("case", MASKED_CASES.split(","))
@pytest.mark.parametrize("run", SEQ_RUNS)
def test_masked_tokens_are_left_out_as_the_reference_leaves_them_out(
    run, case, tiny_hf, batch, megatron_runs, references, bounds
):
    """Half of some responses masked (NaN behaviour log-probs, version -1), one sample wholly: the
    gradient and loss equal the reference without those tokens (check), only trained tokens reach the
    output layer, the counts and the lag buckets; log pi is handed back as None at each masked token."""
    import torch
    from transformers import AutoModelForCausalLM

    record = check(megatron_runs, run, case, references[case], bounds)
    samples = masked_samples(batch[0])
    trained = [[j for j, m in enumerate(s.loss_mask) if m] for s in samples]
    all_tokens = sum(len(s.response_tokens) for s in samples)
    assert record["tokens"] == sum(len(k) for k in trained) < all_tokens  # the masked ones are not counted
    assert record["seqs"] == sum(1 for k in trained if k) == len(samples) - 1  # nor the wholly masked sample
    m = record["metrics"]
    per_lag = {0: 0, 1: 0, 2: 0}
    for s in samples:
        for v in s.trained(s.policy_versions):
            per_lag[VERSION - v] += 1
    assert [m[f"tokens_lag{b}"] for b in range(3)] == [per_lag[b] for b in range(3)]
    assert all(math.isfinite(m[k]) for k in ("loss", "ess", "kl_mu_pi", "ratio_mean", "entropy"))
    model = AutoModelForCausalLM.from_pretrained(tiny_hf, dtype=torch.float32).eval()
    for s, k, handed_back in zip(samples, trained, record["trainer_logprobs"]):
        if not k:  # left out of the loss whole: not trained, nothing handed back
            assert handed_back is None
            continue
        with torch.no_grad():
            logp = response_logprobs(model, s.prompt_tokens, s.response_tokens, 0.8).tolist()
        assert [j for j, x in enumerate(handed_back) if x is not None] == k
        worst = max(abs(handed_back[j] - logp[j]) for j in k)
        print(f"{run} {case} log pi: max |ours - transformers| {worst:.2e} ({worst / bounds['logprob']:.3f} of delta)")
        assert [handed_back[j] for j in k] == pytest.approx([logp[j] for j in k], abs=bounds["logprob"])


def test_micro_batch_counts(megatron_runs):
    counts = [
        json.loads((megatron_runs / f"{r.replace(':', '_')}_aipo.json").read_text())["micro_batches"] for r in SINGLE
    ]
    assert counts == [1, 2, 4]
    counts = [
        json.loads((megatron_runs / f"{r.replace(':', '_')}_gspo.json").read_text())["micro_batches"]
        for r in ("2x2:128", "2x2:64", "2x2:32")
    ]
    assert counts == [1, 2, 4]


def test_mismatch_metrics_and_trainer_logprobs_match_the_reference(tiny_hf, batch, megatron_runs, bounds):
    """The per-lag KL(mu || pi) and ratio spread, ESS, and the log pi handed back per sample
    (gathered over TP2 x PP2 ranks) against transformers' log-probs of the same tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    samples = batch[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_hf, dtype=torch.float32).eval()
    buckets = {0: [], 1: [], 2: []}
    ratios = []
    record = json.loads((megatron_runs / "2x2_32_gspo.json").read_text())
    assert len(record["trainer_logprobs"]) == len(samples)  # one per sample: the zip below drops none
    for s, handed_back in zip(samples, record["trainer_logprobs"]):
        with torch.no_grad():
            logp = response_logprobs(model, s.prompt_tokens, s.response_tokens, 0.8).tolist()
        worst = max(abs(a - b) for a, b in zip(handed_back, logp))
        print(f"2x2 gspo log pi: max |ours - transformers| {worst:.2e} ({worst / bounds['logprob']:.3f} of delta)")
        assert handed_back == pytest.approx(logp, abs=bounds["logprob"])
        for lp, mu, v in zip(logp, s.behaviour_logprobs, s.policy_versions):
            buckets[VERSION - v].append(math.exp(lp - mu))
            ratios.append(math.exp(lp - mu))
    m = record["metrics"]
    assert all(len(b) > 0 for b in buckets.values())
    for b, rs in buckets.items():
        mean = sum(rs) / len(rs)
        assert m[f"tokens_lag{b}"] == len(rs)
        assert m[f"kl_mu_pi_lag{b}"] == pytest.approx(sum(r - 1 - math.log(r) for r in rs) / len(rs), rel=1e-4)
        assert m[f"ratio_std_lag{b}"] == pytest.approx(math.sqrt(sum((r - mean) ** 2 for r in rs) / len(rs)), rel=1e-4)
    assert m["ess"] == pytest.approx(sum(ratios) ** 2 / (len(ratios) * sum(r * r for r in ratios)), rel=1e-4)


def test_the_bounds_catch_an_off_by_one_token_and_a_missing_term(tiny_hf, batch, references, bounds):
    """The mistakes a trainer's loss can make each move the reference's gradient and loss past twice
    the bounds above: every response token scored one position early (its log-prob read from the
    logits that predict the token before it), the entropy bonus left out, and the loss divided by one
    token too many."""
    samples = batch[0]
    early = [
        replace(s, prompt_tokens=s.prompt_tokens[:-1], response_tokens=s.prompt_tokens[-1:] + s.response_tokens[:-1])
        for s in samples
    ]
    tokens = sum(len(s.response_tokens) for s in samples)
    no_entropy = {**CASES["aipo_seq"], "entropy_coef": 0.0}
    mistakes = {
        "a token off by one": ("aipo", reference_grads(tiny_hf, early, CASES["aipo"])),
        "the entropy bonus left out": ("aipo_seq", reference_grads(tiny_hf, samples, no_entropy)),
        "one token too many": (
            "aipo",
            ({k: g * tokens / (tokens + 1) for k, g in references["aipo"][0].items()}, None),
        ),
    }
    for name, (case, (grads, loss)) in mistakes.items():
        ref_grads, ref_loss, sensitivity = references[case]
        overall, _ = relative_errors(grads, ref_grads)
        print(f"{name}: moves the gradient by {overall:.2e} ({overall / bounds['gradient']:.0f}x the bound)")
        assert overall > 2 * bounds["gradient"]
        if loss is not None:
            assert abs(loss - ref_loss) > 2 * bounds["logprob"] * sensitivity, (name, loss, ref_loss)
