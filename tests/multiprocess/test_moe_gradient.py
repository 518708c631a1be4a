"""RL (AIPO) gradients of a tiny random Qwen3-MoE through Megatron's MoE layers (router, alltoall
dispatcher, SequentialMLP experts, expert-data-parallel gradient reduction) at EP4, EP2 (over DP4:
two expert-data-parallel replicas), PP2 x EP2, and TP2 x EP2 at ETP2 and ETP1 equal a plain PyTorch
reference on transformers' Qwen3-MoE. TP2 runs with sequence parallelism, which Megatron's MoELayer
needs at TP > 1 (on CPU: megatron_patches/torch_norm_sp.py and gloo_uneven_collectives.py). No aux
loss (moe_router_load_balancing_type "none", megarl's default); the aux-loss terms are still to do."""

import pytest
import torch
from safetensors.torch import load_file

from megarl.checkpointing.dist_checkpoint_reader import DistCheckpointReader
from megarl.checkpointing.megatron_checkpoint import read_spec
from megarl.convert.megatron_to_hf import hf_tensors
from tests.conftest import make_tiny_family, run_ranks, run_tool
from tests.rl_batch import CASES, make_samples, reference_grads, save_samples

pytestmark = pytest.mark.slow

RUNS = ["1x1e4:64", "1x1e2:64", "1x2e2:64", "2x1e2sp:64", "2x1e2t1sp:64"]


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


@pytest.mark.parametrize("run", RUNS)
def test_aipo_gradient_matches_transformers_reference(run, moe):
    """A wrong router setting, expert index or a missing expert-data-parallel reduction of the
    expert gradients changes them by far more than the bound."""
    hf, base, samples = moe
    weights = load_file(hf / "model.safetensors")
    ref_grads, ref_loss = reference_grads(hf, samples, CASES["aipo"])
    ref = hub_names(ref_grads, weights)
    ckpt = base / f"{run.replace(':', '_')}_aipo" / "release"
    reader, spec = DistCheckpointReader(ckpt), read_spec(ckpt)
    ours = {}
    for layer in [None, *range(spec.num_layers)]:
        ours.update(hf_tensors(reader, spec, layer))
    assert sorted(ours) == sorted(ref)
    diff_sq = sum(((ours[k] - r) ** 2).sum().item() for k, r in ref.items())
    overall = (diff_sq / sum((r**2).sum().item() for r in ref.values())) ** 0.5
    worst = max(((ours[k] - r).norm() / max(r.norm(), 1e-30)).item() for k, r in ref.items())
    expert_norm = sum(r.norm().item() for k, r in ref.items() if ".experts." in k)
    print(
        f"{run}: relative gradient error {overall:.2e} (worst tensor {worst:.2e}), expert grad norm {expert_norm:.3f}"
    )
    assert expert_norm > 1e-3  # the experts are trained, not zero-gradient bystanders
    assert overall <= 1e-5 and worst <= 2e-5
