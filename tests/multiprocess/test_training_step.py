"""One training step through Megatron's own schedule, DDP and distributed optimizer
gives the same loss, gradient norm and updated weights at every layout as at TP1 (and TP1 the
loss and gradient norm of transformers' model), to within fp32 rounding derived from the
arithmetic; and a run reloaded from a training checkpoint continues exactly like an unbroken one."""

import json

import pytest
import torch

from megarl.checkpointing.dist_checkpoint_reader import DistCheckpointReader
from tests.conftest import run_ranks
from tests.fp32_bounds import UNIT_ROUNDOFF, fp32_gradient_bound, fp32_logprob_bound, read_config
from tests.workers.lm_batch import GLOBAL_BATCH, SEQ, fixed_batch
from tests.workers.train_step_worker import SETTINGS

pytestmark = pytest.mark.slow

# In a world of 4: TP2 x PP2 (DP1); TP2 (DP2); PP2 (DP2); PP2 with 2 virtual stages (DP2); DP4.
LAYOUTS = ["2x2", "2x1", "1x2", "1x2x2", "1x1"]
VOCAB = 300


def max_weight_diff(a_dir, b_dir) -> float:
    a, b = DistCheckpointReader(a_dir / "release"), DistCheckpointReader(b_dir / "release")
    worst = 0.0
    for key in a.metadata.state_dict_metadata:
        if not key.startswith(("embedding", "decoder", "output")):
            continue
        x, y = a.read(key), b.read(key)
        if key.startswith(("embedding", "output")):  # padded vocabulary differs with TP
            x, y = x[:VOCAB], y[:VOCAB]
        worst = max(worst, (x - y).abs().max().item())
    return worst


def reference_step(hf, per_rank: int = GLOBAL_BATCH):
    """transformers' model on the worker's batch: (loss, gradient norm, the first Adam update
    lr g_c / (|g_c| + 1) of the clipped gradient g_c, max |w|, ||w||). The loss is the token mean of
    each group of ``per_rank`` sequences, averaged over the groups: the step's token mean when it is
    the whole batch, a per-DP-rank (or per-micro-batch) mean in place of it otherwise (a mistake)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    inputs, labels, mask = fixed_batch(VOCAB)
    ce = torch.nn.functional.cross_entropy(model(inputs).logits.transpose(1, 2), labels, reduction="none") * mask
    groups = range(0, GLOBAL_BATCH, per_rank)
    loss = sum(ce[i : i + per_rank].sum() / mask[i : i + per_rank].sum() for i in groups) / len(groups)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
    clipped = [g * min(1.0, SETTINGS.clip_grad / norm) for g in grads]
    update = torch.cat([(SETTINGS.lr * g / (g.abs() + SETTINGS.adam_eps)).flatten() for g in clipped])
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    return loss.item(), norm, update, weights.abs().max().item(), weights.norm().item()


# fp32 rounding, derived (tests/fp32_bounds.py), for two computations of the step in other orders:
# - loss (a token mean of -log p): delta = fp32_logprob_bound;
# - gradient: relative error eps = fp32_gradient_bound over the batch's positions, so the gradient norm
#   differs by at most eps |g| (triangle inequality) and the clipped gradient g_c = g min(1, c / |g|)
#   by 2 eps min(|g|, c) (the clip coefficient carries |g|'s error once more);
# - weights: Adam with eps 1 at step 1 moves w by lr g_c / (|g_c| + 1), 1-Lipschitz in g_c, and at
#   step 2 by lr m^ / (sqrt(v^) + 1), m^ a convex combination of g_c,1 and g_c,2 (|g_c| << 1, so the
#   v^ term moves it by O(|g_c|) more): max |w - w'| <= |w - w'|_2 <= lr 2 eps (2 c_1 + c_2), c_k =
#   min(|g_k|, clip), plus the rounding of w - update, u max|w| per side and step;
# - the loss at step 2 is taken at weights that differ by that much after step 1: delta + |g_2| |dw_1|_2,
#   |dw_1|_2 <= lr 2 eps c_1 + 2 u |w|_2. (The gradient norm at step 2: eps |g_2|, the effect of dw_1 on
#   the gradient, |H dw_1|, second order in the rounding, left out.)
# A per-DP-rank or per-micro-batch mean of the loss in place of the step's token mean moves the loss,
# the gradient norm and the first update far past these (test_the_bounds_catch_a_wrong_loss_normalisation).
def derived_bounds(hf, steps):
    config = read_config(hf)
    inputs, _, _ = fixed_batch(VOCAB)
    delta = fp32_logprob_bound(hf, inputs.tolist())
    eps = fp32_gradient_bound(config, GLOBAL_BATCH * SEQ)
    _, _, _, max_w, norm_w = reference_step(hf)
    c = [min(step["grad_norm"], SETTINGS.clip_grad) for step in steps]
    lr, u = SETTINGS.lr, UNIT_ROUNDOFF
    weights = lr * 2 * eps * (2 * c[0] + c[1]) + 2 * 2 * u * max_w
    loss = [delta, delta + steps[1]["grad_norm"] * (lr * 2 * eps * c[0] + 2 * u * norm_w)]
    grad_norm = [eps * step["grad_norm"] for step in steps]
    return loss, grad_norm, weights


@pytest.fixture(scope="module")
def trained(tiny_megatron, tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    (out / "reference").mkdir()
    run_ranks(1, "train_step_worker.py", "--checkpoint", tiny_megatron, "--out", out / "reference", "--layouts", "1x1")
    run_ranks(4, "train_step_worker.py", "--checkpoint", tiny_megatron, "--out", out, "--layouts", *LAYOUTS)
    return out


def test_tp1_matches_transformers(trained, tiny_hf):
    """The TP1 reference itself: its first step's loss and gradient norm are transformers' (both fp32,
    to within the bounds above)."""
    reference = json.loads((trained / "reference" / "1x1.json").read_text())
    loss, norm, _, _, _ = reference_step(tiny_hf)
    loss_bound, norm_bound, _ = derived_bounds(tiny_hf, reference)
    print(
        f"TP1 vs transformers: loss {abs(reference[0]['loss'] - loss):.2e} (bound {loss_bound[0]:.2e}), "
        f"grad norm {abs(reference[0]['grad_norm'] - norm):.2e} (bound {norm_bound[0]:.2e})"
    )
    assert abs(reference[0]["loss"] - loss) <= loss_bound[0]
    assert abs(reference[0]["grad_norm"] - norm) <= norm_bound[0]


def test_the_bounds_catch_a_wrong_loss_normalisation(trained, tiny_hf):
    """The token mean over the whole step (Megatron's per-token loss, summed over micro-batches and DP
    ranks, then divided by the step's tokens) against the mistakes a layout can make: each DP2 rank's
    own token mean, or each micro-batch's, averaged. Each moves the loss, the gradient norm and the first
    update past twice the bounds (on transformers' model, the same weights and batch)."""
    reference = json.loads((trained / "reference" / "1x1.json").read_text())
    loss_bound, norm_bound, weight_bound = derived_bounds(tiny_hf, reference)
    loss, norm, update, _, _ = reference_step(tiny_hf)
    for name, per_rank in (("per-DP-rank mean", GLOBAL_BATCH // 2), ("per-micro-batch mean", 1)):
        wrong_loss, wrong_norm, wrong_update, _, _ = reference_step(tiny_hf, per_rank)
        moved = (wrong_update - update).abs().max().item()
        print(
            f"{name}: loss moves {abs(wrong_loss - loss):.2e} ({abs(wrong_loss - loss) / loss_bound[0]:.0f}x), "
            f"grad norm moves {abs(wrong_norm - norm):.2e} ({abs(wrong_norm - norm) / norm_bound[0]:.0f}x "
            f"the bound), the first update {moved:.2e} ({moved / weight_bound:.0f}x)"
        )
        assert abs(wrong_loss - loss) > 2 * loss_bound[0]
        assert abs(wrong_norm - norm) > 2 * norm_bound[0] and moved > 2 * weight_bound


@pytest.mark.parametrize("layout", LAYOUTS)
def test_step_matches_tp1(layout, trained, tiny_megatron, tiny_hf):
    reference = json.loads((trained / "reference" / "1x1.json").read_text())
    ours = json.loads((trained / f"{layout}.json").read_text())
    loss_bound, norm_bound, weight_bound = derived_bounds(tiny_hf, reference)
    for step, (ref_step, our_step) in enumerate(zip(reference, ours)):
        loss_diff, norm_diff = (
            abs(our_step["loss"] - ref_step["loss"]),
            abs(our_step["grad_norm"] - ref_step["grad_norm"]),
        )
        print(
            f"{layout} step {step + 1}: loss {loss_diff:.2e} ({loss_diff / loss_bound[step]:.3f} of the bound), "
            f"grad norm {norm_diff:.2e} ({norm_diff / norm_bound[step]:.3f})"
        )
        assert loss_diff <= loss_bound[step] and norm_diff <= norm_bound[step]
    diff = max_weight_diff(trained / layout, trained / "reference" / "1x1")
    moved = max_weight_diff(trained / "reference" / "1x1", tiny_megatron)
    print(
        f"{layout}: max |w - w_TP1| = {diff:.2e} ({diff / weight_bound:.3f} of the bound {weight_bound:.2e}; "
        f"update size {moved:.2e})"
    )
    assert moved > 1e-2  # the step really changed the weights
    assert diff <= weight_bound


def test_resume_continues_like_an_unbroken_run(tiny_megatron, tiny_hf, tmp_path):
    """At the save layout the resumed run is the unbroken one bitwise (the same arithmetic on the same
    state). Through another layout: the state saved there untrained and loaded back continues bitwise
    too (the round trip: any weight or Adam moment that moves on the way shows); training on at that
    layout has the step counts, and its first step (on the same weights) the unbroken loss to within
    fp32 rounding of the forward, delta. (Past that first step, plain Adam's m^ / sqrt(v^) divides a
    rounding of g by |g| per element: no bound derived from the gradient's error holds the weights.)"""
    run_ranks(
        4,
        "resume_worker.py",
        "--checkpoint",
        tiny_megatron,
        "--out",
        tmp_path,
        "--save-layout",
        "2x1",
        "--resume-layouts",
        "2x1",
        "1x2",
    )
    records = json.loads((tmp_path / "records.json").read_text())
    assert records["resumed_2x1"] == records["unbroken"]
    assert max_weight_diff(tmp_path / "resumed_2x1", tmp_path / "unbroken") == 0.0
    assert records["round_trip_1x2"] == records["unbroken"]
    assert max_weight_diff(tmp_path / "round_trip_1x2", tmp_path / "unbroken") == 0.0
    inputs, _, _ = fixed_batch(VOCAB)
    delta = fp32_logprob_bound(tiny_hf, inputs.tolist())
    first = abs(records["resumed_1x2"][0]["loss"] - records["unbroken"][0]["loss"])
    print(f"resumed at 1x2: first loss {first:.2e} from the unbroken one ({first / delta:.3f} of delta {delta:.2e})")
    assert first <= delta
    for layout in ("2x1", "1x2"):
        assert records[f"loop_state_{layout}"] == {"policy_version": 1, "iteration": 1}
        # torch Adam: every parameter has its own step counter, at 1 + 2 steps.
        steps = records[f"adam_steps_{layout}"]
        assert steps["values"] == [3.0] and steps["distinct_objects"] == steps["n"]
