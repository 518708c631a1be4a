"""RL (AIPO) gradients of a tiny random Qwen3-MoE through Megatron's MoE layers (router, alltoall
dispatcher, SequentialMLP experts, expert-data-parallel gradient reduction) at EP4, EP2 (over DP4:
two expert-data-parallel replicas), PP2 x EP2, and TP2 x EP2 at ETP2 and ETP1 equal a plain PyTorch
reference on transformers' Qwen3-MoE. TP2 runs with sequence parallelism, which Megatron's MoELayer
needs at TP > 1 (on CPU: megatron_patches/torch_norm_sp.py and gloo_uneven_collectives.py). Without
aux losses (moe_router_load_balancing_type "none", megarl's default) and, at EP2 and EP4, with the
load-balancing and z losses, against a reference that adds them per micro-batch and layer."""

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from megarl.checkpointing.dist_checkpoint_reader import DistCheckpointReader
from megarl.checkpointing.megatron_checkpoint import read_spec
from megarl.convert.megatron_to_hf import hf_tensors
from tests.conftest import make_tiny_family, run_ranks, run_tool
from tests.fp32_bounds import fp32_gradient_bound as shared_gradient_bound
from tests.fp32_bounds import read_config
from tests.rl_batch import CASES, make_samples, moe_router_terms, reference_grads, save_samples, with_random_routes

pytestmark = pytest.mark.slow

RUNS = ["1x1e4:64", "1x1e2:64", "1x2e2:64", "2x1e2sp:64", "2x1e2t1sp:64"]
# with rl_batch.MOE_AUX's load-balancing and z losses: EP2 and EP4 over DP4, at one and two micro-batches
# per DP rank (each sample spans 16 positions, two samples per DP rank). No pipeline run: its rows are
# padded to the budget, and Megatron routes the padding too (the reference would need it)
AUX_RUNS = ["1x1e2aux:32", "1x1e2aux:16", "1x1e4aux:16"]


def hub_names(grads: dict, weights: dict) -> dict:
    """transformers 5 fuses a layer's experts in memory (gate_up_proj [E, 2I, H], down_proj [E, H, I]);
    the checkpoint (and megarl's export) has one tensor per expert. The split is checked on the weights:
    the fused tensors must equal the checkpoint's per-expert ones."""
    out = {}
    for name, grad in grads.items():
        if ".mlp.experts.gate_up_proj" in name or ".mlp.experts.down_proj" in name:
            prefix = name.split("mlp.experts.")[0] + "mlp.experts."
            for e in range(grad.shape[0]):
                if "gate_up_proj" in name:
                    gate, up = grad[e].chunk(2, dim=0)
                    out.update({f"{prefix}{e}.gate_proj.weight": gate, f"{prefix}{e}.up_proj.weight": up})
                else:
                    out[f"{prefix}{e}.down_proj.weight"] = grad[e]
        else:
            out[name] = grad
    assert sorted(out) == sorted(weights)
    return out


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    base = tmp_path_factory.mktemp("moe_grad")
    hf = make_tiny_family("qwen3_moe", base / "hf")
    run_tool("convert_hf_to_megatron.py", "--hf-model", hf, "--output", base / "megatron")
    samples = make_samples(hf, vocab_size=300)
    save_samples(samples, base / "samples.pt")
    run_ranks(
        4,
        "rl_grad_worker.py",
        "--checkpoint",
        base / "megatron",
        "--samples",
        base / "samples.pt",
        "--out",
        base,
        "--runs",
        *RUNS,
        *AUX_RUNS,
    )
    return hf, base, samples


def test_fused_expert_split_is_the_checkpoints(moe):
    """The split hub_names applies to gradients, checked on the weights (a swapped gate/up fails)."""
    from transformers import AutoModelForCausalLM

    hf, _, _ = moe
    weights = load_file(hf / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    split = hub_names(dict(model.named_parameters()), weights)
    for name, tensor in weights.items():
        assert torch.equal(split[name], tensor), name


# The fp32 rounding of a gradient, from the arithmetic (tests/fp32_bounds.py, the model
# test_conversion_families.py uses for logits): S = 2 (6 L + 1) + 1 chained reductions (the forward, back
# to each layer, the sum over the batch's positions), n the longest; Megatron at its layout and
# transformers in its order differ by sqrt(2) LAMBDA sqrt(S n) u of the gradient's norm, the worst single
# tensor by twice it. A wrong router setting, expert index or a lost reduction moves the gradient by 1e-2
# and more: some 1000x the bound.


def fp32_gradient_bound(hf, samples) -> float:
    positions = sum(len(s.prompt_tokens) + len(s.response_tokens) - 1 for s in samples)
    return shared_gradient_bound(read_config(hf), positions)


def errors(ours: dict, ref: dict):
    """(relative error of the whole gradient, of the worst single tensor)."""
    diff_sq = sum(((ours[k] - r) ** 2).sum().item() for k, r in ref.items())
    overall = (diff_sq / sum((r**2).sum().item() for r in ref.values())) ** 0.5
    worst = max(((ours[k] - r).norm() / max(r.norm(), 1e-30)).item() for k, r in ref.items())
    return overall, worst


def megatron_grads(base, run):
    ckpt = base / f"{run.replace(':', '_')}_aipo" / "release"
    reader, spec = DistCheckpointReader(ckpt), read_spec(ckpt)
    ours = {}
    for layer in [None, *range(spec.num_layers)]:
        ours.update(hf_tensors(reader, spec, layer))
    return ours


def record_of(base, run) -> dict:
    return json.loads((base / f"{run.replace(':', '_')}_aipo.json").read_text())


@pytest.mark.parametrize("run", RUNS)
def test_aipo_gradient_matches_transformers_reference(run, moe):
    """A wrong router setting, expert index or a missing expert-data-parallel reduction of the
    expert gradients changes them by far more than the bound."""
    hf, base, samples = moe
    weights = load_file(hf / "model.safetensors")
    ref_grads, ref_loss = reference_grads(hf, samples, CASES["aipo"])
    ref = hub_names(ref_grads, weights)
    ours = megatron_grads(base, run)
    assert sorted(ours) == sorted(ref)
    overall, worst = errors(ours, ref)
    bound = fp32_gradient_bound(hf, samples)
    expert_norm = sum(r.norm().item() for k, r in ref.items() if ".experts." in k)
    print(
        f"{run}: relative gradient error {overall:.2e} (worst tensor {worst:.2e}; bound {bound:.2e}, "
        f"{overall / bound:.2f} and {worst / (2 * bound):.2f} of it), expert grad norm {expert_norm:.3f}"
    )
    assert expert_norm > 1e-3  # the experts are trained, not zero-gradient bystanders
    assert overall <= bound and worst <= 2 * bound
    assert "moe_load_balancing_loss" not in record_of(base, run)["moe_metrics"]  # off unless configured


@pytest.mark.parametrize("run", AUX_RUNS)
def test_aux_losses_reach_the_gradient_per_micro_batch_as_megatron_defines_them(run, moe):
    """With load-balancing and z losses on, the gradient equals the reference that adds each
    micro-batch's and layer's losses (times its routed positions, over the step's trained tokens), on
    the micro-batches this run packed; the logged per-layer losses equal the reference's mean over
    micro-batches. The reference without them is far off (the losses move the gradient), and so is the
    reference on another split of the same batch: with aux losses the gradient is no longer invariant
    to the micro-batch split (the RL loss part still is: test_rl_gradient), it is exact for each split."""
    from transformers import AutoModelForCausalLM

    hf, base, samples = moe
    weights = load_file(hf / "model.safetensors")
    record = record_of(base, run)
    # every row is its samples' positions, nothing padded (the reference routes exactly those)
    for rank in record["packed"]:
        for indices, length in rank:
            assert length == sum(len(samples[i].prompt_tokens) + len(samples[i].response_tokens) - 1 for i in indices)
    micro_batches = [indices for rank in record["packed"] for indices, _ in rank]
    assert sorted(i for mb in micro_batches for i in mb) == list(range(len(samples)))
    ours = megatron_grads(base, run)
    ref = hub_names(reference_grads(hf, samples, CASES["aipo"], moe_micro_batches=micro_batches)[0], weights)
    overall, worst = errors(ours, ref)
    without = errors(ours, hub_names(reference_grads(hf, samples, CASES["aipo"])[0], weights))[0]
    other_split = [[i for mb in micro_batches[j : j + 2] for i in mb] for j in range(0, len(micro_batches), 2)]
    if len(other_split) == len(micro_batches):  # one micro-batch per row already: split each instead
        other_split = [[i] for mb in micro_batches for i in mb]
    split = errors(
        ours, hub_names(reference_grads(hf, samples, CASES["aipo"], moe_micro_batches=other_split)[0], weights)
    )[0]
    bound = fp32_gradient_bound(hf, samples)
    print(
        f"{run}: {len(micro_batches)} micro-batches, relative gradient error {overall:.2e} (worst {worst:.2e}; "
        f"bound {bound:.2e}); vs the reference without aux losses {without:.2e}, on another split {split:.2e}"
    )
    assert overall <= bound and worst <= 2 * bound
    assert without > 100 * bound and split > 10 * bound
    # the logged losses: per MoE layer, the mean over micro-batches (every DP rank has as many here)
    assert len({len(rank) for rank in record["packed"]}) == 1
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    with torch.no_grad():
        terms = moe_router_terms(model, samples, micro_batches, model.config.num_experts_per_tok)
    metrics = record["moe_metrics"]
    moe_layers = sorted(int(k.rsplit("layer", 1)[1]) for k in metrics if k.startswith("moe_z_loss/layer"))
    assert len(moe_layers) == len(terms[0])
    for _position, (metric, which) in enumerate([("moe_load_balancing_loss", 0), ("moe_z_loss", 1)]):
        expected = [sum(mb[j][which].item() for mb in terms) / len(terms) for j in range(len(moe_layers))]
        logged = [metrics[f"{metric}/layer{layer}"] for layer in moe_layers]
        assert logged == pytest.approx(expected, rel=1e-5), (metric, logged, expected)
        assert metrics[metric] == pytest.approx(sum(expected) / len(expected), rel=1e-5)


# routing replay (trainer/router_replay.py) of random routes: EP2 over DP4 at one micro-batch per DP
# rank, and PP2 x EP2 (padded rows) without and with full recomputation at four micro-batches per rank
# (1F1B runs two forwards before the first backward, whose recompute re-runs the routers), and PP2 x
# VPP2 (one layer per virtual stage: interleaved 1F1B runs each chunk's micro-batches at other times)
REPLAY_RUNS = ["1x1e2replay:32", "1x2e2rcreplay:16", "1x2e2replay:64", "1x2x2e2rcreplay:16"]


@pytest.fixture(scope="module")
def moe_replay(moe):
    hf, base, samples = moe
    routed = with_random_routes(samples, hf)
    save_samples(routed, base / "routed_samples.pt")
    run_ranks(
        4,
        "rl_grad_worker.py",
        "--checkpoint",
        base / "megatron",
        "--samples",
        base / "routed_samples.pt",
        "--out",
        base,
        "--runs",
        *REPLAY_RUNS,
    )
    return hf, base, routed


@pytest.fixture(scope="module")
def replay_reference(moe_replay):
    hf, _, routed = moe_replay
    weights = load_file(hf / "model.safetensors")
    own = hub_names(reference_grads(hf, [replace(s, routed_experts=None) for s in routed])[0], weights)
    return hub_names(reference_grads(hf, routed)[0], weights), own


@pytest.mark.parametrize("run", REPLAY_RUNS)
def test_routing_replay_gradient_is_the_reference_routed_by_the_generators_experts(run, moe_replay, replay_reference):
    """With trainer.moe_enable_routing_replay the gradient equals transformers' model whose routers
    are forced to the recorded experts (random ones, not the model's own: the reference routed by its
    own top-k is far off), also under full recomputation with two micro-batches per rank (a recompute
    that reused the last micro-batch's routes would differ) and PP2 x EP2."""
    hf, base, routed = moe_replay
    ref, own = replay_reference
    ours = megatron_grads(base, run)
    overall, worst = errors(ours, ref)
    apart, _ = errors(own, ref)
    bound = fp32_gradient_bound(hf, routed)
    print(
        f"{run}: relative gradient error {overall:.2e} (worst {worst:.2e}; bound {bound:.2e}); "
        f"own routing vs replayed {apart:.2e}"
    )
    assert apart > 1e-2  # the recorded routes change the gradient
    assert overall <= bound and worst <= 2 * bound
    metrics = record_of(base, run)["moe_metrics"]
    assert metrics["moe_routes_replayed"] == 1.0
    # 4 experts, top 2: a random pair is the router's own one time in six
    assert 0.0 < metrics["moe_route_agreement"] < 0.5
