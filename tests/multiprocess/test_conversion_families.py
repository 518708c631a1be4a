"""HF <-> Megatron conversion of tiny random Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V3 and GLM-4.5 models
(transformers' own classes), checked against transformers: converted at TP2 x PP2 (x EP2 for the
experts; DeepSeek-V3 and GLM-4.5, 3 layers, at TP2 x EP2), exported back bitwise, and Megatron's
logits at several layouts (Megatron reshards on load) equal transformers'."""

import pytest
import torch

from tests.conftest import hf_logits, make_tiny_family, run_ranks, run_tool
from tests.fp32_bounds import fp32_logit_bound, read_config
from tests.multiprocess.test_conversion import read_safetensors_dir

# TPxPP[xEP[xETP]]; 4x1: more TP ranks than KV heads (QKV biases split inside a KV group)
LAYOUTS = {
    "qwen2": ["1x1", "2x2", "4x1"],
    "qwen3": ["1x1", "2x2", "4x1"],
    "qwen3_moe": ["1x1", "2x2", "1x1x4", "2x1x2", "1x2x2", "2x1x2x1"],
    # the other router (top-k renormalised: Megatron's softmax after top-k), every other layer sparse,
    # tied embeddings, 8 experts top-3
    "qwen3_moe_renormalised": ["1x1", "1x1x4", "1x2x2", "2x1x2x1"],
    # multi-head latent attention, YaRN, sigmoid router with expert bias in groups, shared experts
    "deepseek_v3": ["1x1", "2x1x2x1", "1x1x4"],
    # partial rotary, q/k/v biases, q/k norms, DeepSeek-V3's router and shared expert
    "glm4_moe": ["1x1", "2x1x2x1", "1x1x2"],
}
VARIANTS = {
    "qwen3_moe_renormalised": (
        "qwen3_moe",
        dict(norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[], tie_word_embeddings=True)
        | dict(num_experts=8, num_experts_per_tok=3),
    )
}
CONVERT_AT = {"qwen3_moe": ["--ep", 2, "--etp", 1], "qwen3_moe_renormalised": ["--ep", 2, "--etp", 1]}
CONVERT_AT |= {family: ["--pp", 1, "--ep", 2, "--etp", 1] for family in ("deepseek_v3", "glm4_moe")}
SIGMOID_ROUTED = ("deepseek_v3", "glm4_moe")


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def converted(request, tmp_path_factory):
    family = request.param
    base = tmp_path_factory.mktemp(family)
    hf_family, overrides = VARIANTS.get(family, (family, {}))
    hf = make_tiny_family(hf_family, base / "hf", **overrides)
    megatron = base / "megatron"
    run_tool(
        "convert_hf_to_megatron.py",
        "--hf-model",
        hf,
        "--output",
        megatron,
        "--tp",
        2,
        "--pp",
        2,
        *CONVERT_AT.get(family, []),
    )
    return family, hf, megatron, base


def test_export_is_bitwise_the_original(converted):
    """A wrong expert index, a q/k bias split by the weight's rule or a lost norm changes a tensor."""
    family, hf, megatron, base = converted
    run_tool("convert_megatron_to_hf.py", "--megatron", megatron, "--output", base / "back")
    original, back = read_safetensors_dir(hf), read_safetensors_dir(base / "back")
    assert sorted(back) == sorted(original)
    if family.startswith("qwen3_moe"):
        assert "model.layers.3.mlp.experts.3.down_proj.weight" in back and "model.layers.0.mlp.gate.weight" not in back
    if family in SIGMOID_ROUTED:  # dense first layer; the router's bias and the shared experts kept
        assert "model.layers.0.mlp.gate.weight" not in back and "model.layers.0.mlp.down_proj.weight" in back
        assert back["model.layers.2.mlp.gate.e_score_correction_bias"].abs().min() > 0
        assert "model.layers.2.mlp.shared_experts.down_proj.weight" in back
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    # labelled as its family (SGLang picks its model class by architectures), and transformers
    # builds the same model from it
    import json

    from transformers import AutoModelForCausalLM

    config = json.loads((base / "back" / "config.json").read_text())
    want = json.loads((hf / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == (want["model_type"], want["architectures"])
    kwargs = dict(experts_implementation="eager") if family in SIGMOID_ROUTED else {}
    model = AutoModelForCausalLM.from_pretrained(base / "back", dtype=torch.float32, **kwargs).eval()
    assert type(model).__name__ == want["architectures"][0]
    tokens = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(3))
    reference = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, **kwargs).eval()
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, reference(tokens).logits)


# The fp32 rounding of the logits, from the arithmetic (tests/fp32_bounds.py: LAMBDA sqrt(S n) u max|logit|,
# S = 6 L + 1 chained reductions, n the longest; multi-head latent attention chains 3 more per layer).
# Reduction order (TP splits, another CPU's kernels) moves the error within that bound, not past it:
# transformers' own fp32 logits are held to it too, against the same float64 reference.


def float64_model(hf, family):
    from transformers import AutoModelForCausalLM

    kwargs = dict(experts_implementation="eager") if family.startswith("qwen3_moe") or family in SIGMOID_ROUTED else {}
    return AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float64, **kwargs).eval()


def mapping_errors(family):
    """What the mapping mistakes this test guards against do, each a change made to a copy of the
    float64 reference model: Megatron's default layernorm_epsilon (1e-5) in place of the checkpoint's
    rms_norm_eps (1e-6), the heads' q biases in another order, the router's top-k renormalisation
    flipped, and for the sigmoid routers the expert bias, routed_scaling_factor or group limit lost. (Megatron builds the q/k norms with the same layernorm_epsilon as every other norm, so
    the mapping has one epsilon to get wrong; the q/k norms' alone moves these logits by ~1x the bound.)"""

    def norm_epsilon(model):
        for module in model.modules():
            if hasattr(module, "variance_epsilon"):
                module.variance_epsilon = 1e-5

    def reversed_q_bias_heads(model):
        for layer in model.model.layers:
            bias = layer.self_attn.q_proj.bias.data
            bias.copy_(bias.view(-1, model.config.head_dim).flip(0).reshape(-1))

    def flipped_topk_renormalisation(model):
        for module in model.modules():
            if hasattr(module, "norm_topk_prob"):
                module.norm_topk_prob = not module.norm_topk_prob

    def expert_bias_dropped(model):
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.zero_()

    def routed_scaling_ignored(model):
        for module in model.modules():
            if hasattr(module, "routed_scaling_factor"):
                module.routed_scaling_factor = 1.0

    def group_limit_off(model):
        for module in model.modules():
            if hasattr(module, "topk_group"):
                module.topk_group = module.num_group

    cases = {"every norm's epsilon 1e-5": norm_epsilon}
    if family in SIGMOID_ROUTED:
        cases["the router's expert bias dropped"] = expert_bias_dropped
        cases["routed_scaling_factor ignored"] = routed_scaling_ignored
        cases["no group limit"] = group_limit_off
    if family == "qwen2":  # QKV biases
        cases["q biases of the heads reversed"] = reversed_q_bias_heads
    if family.startswith("qwen3_moe"):
        cases["top-k renormalisation flipped"] = flipped_topk_renormalisation
    return cases


def test_logits_match_transformers(converted):
    """Megatron's fp32 logits at every layout are transformers' float64 logits to within fp32 rounding
    (fp32_logit_bound, derived above, not measured); the mistakes a mapping can make (router
    settings, norm epsilons, the QKV bias layout) each move the logits by more than twice the bound,
    shown on the float64 model itself."""
    import copy

    family, hf, megatron, base = converted
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(7))
    torch.save(tokens, base / "tokens.pt")
    run_ranks(
        4,
        "logits_worker.py",
        "--checkpoint",
        megatron,
        "--tokens",
        base / "tokens.pt",
        "--out",
        base,
        "--layouts",
        *LAYOUTS[family],
    )
    model = float64_model(hf, family)
    with torch.no_grad():
        reference = model(tokens).logits
    max_logit = reference.abs().max().item()
    assert max_logit > 5  # a real signal, not near-zero logits
    bound = fp32_logit_bound(read_config(hf), tokens.shape[1], max_logit)
    moe = family.startswith("qwen3_moe") or family in SIGMOID_ROUTED
    kwargs = dict(experts_implementation="eager") if moe else {}
    hf32 = (hf_logits(hf, tokens, **kwargs).double() - reference).abs().max().item()
    print(f"{family}: bound {bound:.2e} (max |logit| {max_logit:.1f}); transformers fp32 {hf32:.2e}")
    assert hf32 <= bound  # the bound covers an independent fp32 implementation on this machine
    for layout in LAYOUTS[family]:
        diff = (torch.load(base / f"logits_{layout}.pt").double() - reference).abs().max().item()
        print(f"{family} {layout}: max |logit - float64| = {diff:.2e} ({diff / bound:.2f} of the bound)")
        assert diff <= bound, (layout, diff, bound)
    for name, make_mistake in mapping_errors(family).items():
        wrong = copy.deepcopy(model)
        make_mistake(wrong)
        with torch.no_grad():
            moved = (wrong(tokens).logits - reference).abs().max().item()
        print(f"{family} {name}: moves the logits by {moved:.2e} ({moved / bound:.1f}x the bound)")
        assert moved > 2 * bound, (name, moved, bound)
