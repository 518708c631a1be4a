"""Whole RL optimizer steps through PolicyTrainer: a user loss picked by dotted path,
the non-finite guard, a KL penalty against a frozen reference model, and the metrics.
The user loss's value, gradient norm and importance-ratio metrics are checked against
transformers' reference of that loss (and shown to differ from plain AIPO's)."""

import json
import math

import pytest
import torch

from megarl.checkpointing.dist_checkpoint_reader import DistCheckpointReader
from tests.conftest import run_ranks
from tests.rl_batch import RHO, make_samples, reference_grads, response_logprobs, save_samples
from tests.workers.rl_step_worker import ENTROPY_COEF, KL_LR

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stepped(tiny_hf, tiny_megatron, tmp_path_factory):
    out = tmp_path_factory.mktemp("rl_step")
    samples = make_samples(tiny_hf, vocab_size=300)
    save_samples(samples, out / "samples.pt")
    run_ranks(
        2,
        "rl_step_worker.py",
        "--checkpoint",
        tiny_megatron,
        "--samples",
        out / "samples.pt",
        "--out",
        out,
        "--layout",
        "1x2",
    )
    return out, json.loads((out / "metrics.json").read_text()), samples


def grad_norm(grads):
    return math.sqrt(sum((g.double() ** 2).sum().item() for g in grads.values()))


def weights(ckpt, vocab=300):
    """Global weights; vocabulary tensors cut to the real vocabulary (padding depends on TP)."""
    reader = DistCheckpointReader(ckpt / "release")
    out = {}
    for key in reader.metadata.state_dict_metadata:
        if key.startswith(("embedding", "decoder", "output")):
            out[key] = reader.read(key)[:vocab] if key.startswith(("embedding", "output")) else reader.read(key)
    return out


def test_user_loss_by_dotted_path_takes_a_real_step(stepped, tiny_megatron, tiny_hf):
    out, metrics, samples = stepped
    m = metrics["custom"][0]
    assert not m["skipped"] and m["response_tokens"] == 84 and m["samples"] == 8
    # the user loss (AIPO + entropy bonus), written out on transformers, and plain AIPO
    ours_grads, ours_loss = reference_grads(
        tiny_hf, samples, dict(loss="aipo", loss_params={"rho": RHO}, entropy_coef=ENTROPY_COEF)
    )
    aipo_grads, aipo_loss = reference_grads(tiny_hf, samples, dict(loss="aipo", loss_params={"rho": RHO}))
    print(
        f"loss {m['loss']:.6f} (reference {ours_loss:.6f}, AIPO alone {aipo_loss:.6f}); grad norm "
        f"{m['grad_norm']:.6f} (reference {grad_norm(ours_grads):.6f}, AIPO alone {grad_norm(aipo_grads):.6f})"
    )
    assert m["loss"] == pytest.approx(ours_loss, rel=1e-5) and m["loss"] != pytest.approx(aipo_loss, rel=1e-2)
    # the bonus changes the norm little (its gradient is nearly orthogonal to AIPO's) but far more
    # than Megatron and the reference differ
    assert abs(m["grad_norm"] - grad_norm(ours_grads)) < 0.05 * abs(grad_norm(ours_grads) - grad_norm(aipo_grads))
    # importance-ratio metrics from transformers' log-probs of the same tokens
    model = __import__("transformers").AutoModelForCausalLM.from_pretrained(tiny_hf, dtype=torch.float32).eval()
    with torch.no_grad():
        ratios = [
            math.exp(lp - mu)
            for s in samples
            for lp, mu in zip(
                response_logprobs(model, s.prompt_tokens, s.response_tokens, 0.8).tolist(), s.behaviour_logprobs
            )
        ]
    assert m["ess"] == pytest.approx(sum(ratios) ** 2 / (len(ratios) * sum(r * r for r in ratios)), rel=1e-4)
    assert m["clip_frac"] == sum(r > RHO for r in ratios) / len(ratios) and m["ratio_max"] == pytest.approx(
        max(ratios), rel=1e-4
    )
    assert m["kl_mu_pi"] == pytest.approx(sum(r - 1 - math.log(r) for r in ratios) / len(ratios), rel=1e-4)
    assert m["tokens_per_s"] > 0
    assert m["packing_efficiency"] == pytest.approx(1.0)  # 16-position samples fill 32-position rows
    before, after = weights(tiny_megatron), weights(out / "custom")
    assert max((after[k] - before[k]).abs().max().item() for k in before) > 1e-3


def test_non_finite_loss_skips_the_step_and_keeps_the_weights(stepped, tiny_megatron):
    out, metrics, _ = stepped
    m = metrics["nan"][0]
    assert m["skipped"] and m["skip_reason"].startswith("non-finite loss")
    before, after = weights(tiny_megatron), weights(out / "nan")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_overlong_samples_are_left_out_of_the_loss(stepped):
    _, metrics, samples = stepped
    m = metrics["overlong"][0]
    # samples 0 and 3 (14 and 8 response tokens) are cut: 84 - 22 tokens trained
    assert (m["truncated_frac"], m["overlong_masked"], m["response_tokens"]) == (0.25, 2, 84 - 22)
    assert m["samples"] == 8 and not m["skipped"]
    assert m["handed_back"] == [i not in (0, 3) for i in range(8)]


def test_kl_penalty_pulls_the_policy_back_to_the_reference(stepped):
    """Step 1 moves pi away from the reference; steps 2-3 see zero advantages, so their only
    gradient is the KL term's: plain SGD must then bring KL(pi || ref) on the batch down, by
    what a gradient step on it predicts to first order (lr * |grad|^2)."""
    _, metrics, _ = stepped
    first, second, third = metrics["kl"]
    assert first["kl_ref"] == 0.0  # policy == reference before the first update
    assert not any(m["skipped"] for m in metrics["kl"])
    assert second["kl_ref"] > 1e-4
    # with A = 0 the step's loss is the KL term alone
    assert second["loss"] == pytest.approx(second["kl_ref"], rel=1e-6)
    # SGD moves by -lr * g; d KL = g . step = -lr |g|^2 to first order
    predicted = KL_LR * second["grad_norm"] ** 2
    drop = second["kl_ref"] - third["kl_ref"]
    print(
        f"KL(pi || ref): {second['kl_ref']:.3e} -> {third['kl_ref']:.3e}, drop {drop:.3e}, "
        f"first-order prediction {predicted:.3e}"
    )
    assert third["kl_ref"] < 0.9 * second["kl_ref"]
    assert drop == pytest.approx(predicted, rel=0.2)
