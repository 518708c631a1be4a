"""The torch engine on Qwen2, Qwen3 and Qwen3-MoE at TP1: greedy tokens and log-probs equal
transformers', the routed experts it returns equal transformers' router top-k, and SGLang's
FusedMoE layout at --tp 4 --ep-size 2 holds the checkpoint's experts where SGLang's loader puts them."""

import pytest
import torch
from safetensors.torch import load_file

from megarl.generator.interface import GenerationRequest, SamplingParams
from megarl.generator.torch_engine.engine import TorchEngine
from megarl.generator.weights import load_generator_params
from megarl.models.hf_checkpoint import SafetensorsCheckpoint
from tests.engine_families import FAMILIES, MAX_NEW, build, prompts, reference, reference_routes


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_families")
    return {name: build(name, root) for name in FAMILIES}


def run_engine(model_dir, cpu_kernels):
    hf = SafetensorsCheckpoint(model_dir)
    engine = TorchEngine(
        hf.spec, load_generator_params(hf, 1, 0, torch.float32), max_running=2, max_seq_len=64, cpu_kernels=cpu_kernels
    )
    params = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)
    # three prompts on two slots: a sequence is prefilled while another decodes
    engine.submit([GenerationRequest(str(i), ids, params) for i, ids in enumerate(prompts())])
    return {int(c.request_id): c for c in engine.run_until_idle()}


@pytest.mark.parametrize("cpu_kernels", ["torch", "auto"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_greedy_tokens_equal_transformers(models, name, cpu_kernels):
    """A missing bias, q/k norm, a wrong expert or router normalisation changes the tokens (the tiny
    models' norms and biases are random, not 1 and 0)."""
    done = run_engine(models[name], cpu_kernels)
    for i, (tokens, logp) in enumerate(reference(models[name], prompts())):
        assert done[i].output_ids == tokens, (name, i)
        assert (torch.tensor(done[i].logprobs) - logp).abs().max().item() <= 1e-4, (name, i)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe_renormalised"])
def test_routed_experts_equal_transformers_router_topk(models, name):
    """Every fed position (prompt and output but the last token, SGLang's start_len 0) and MoE layer:
    the engine's experts are transformers' top-k, as a set; dense layers are -1."""
    done = run_engine(models[name], "auto")
    spec = SafetensorsCheckpoint(models[name]).spec
    for i, c in done.items():
        sequence = c.prompt_ids + c.output_ids
        routes = c.routed_experts
        assert routes.dtype == torch.int16 and tuple(routes.shape) == (
            len(sequence) - 1,
            spec.num_layers,
            spec.moe.top_k,
        )
        want = reference_routes(models[name], sequence)
        for layer in range(spec.num_layers):
            if layer in want:
                got = routes[:, layer].long().sort(-1).values
                assert torch.equal(got, want[layer].sort(-1).values), (name, i, layer)
            else:
                assert (routes[:, layer] == -1).all(), (name, i, layer)


def test_fused_moe_layout_at_tp4_ep2(models):
    """SGLang --tp 4 --ep-size 2: moe_tp = 2, rank r = ep_rank x 2 + moe_tp_rank; experts [2 ep_rank,
    2 ep_rank + 2) stacked; w13 = per expert [gate rows; up rows] of the rank's half of the
    intermediate dimension, w2 its columns; the router whole. Built here from the checkpoint file."""
    hf = SafetensorsCheckpoint(models["qwen3_moe"])
    weights = load_file(models["qwen3_moe"] / "model.safetensors")
    width = hf.spec.moe.ffn_hidden_size // 2
    layer = hf.spec.moe.layers[0]
    p = f"model.layers.{layer}.mlp."
    for rank in range(4):
        ep_rank, moe_tp_rank = divmod(rank, 2)
        got = load_generator_params(hf, 4, rank, torch.float32, ep=2)
        cols = slice(moe_tp_rank * width, (moe_tp_rank + 1) * width)
        experts = range(2 * ep_rank, 2 * ep_rank + 2)
        w13 = torch.stack(
            [torch.cat([weights[f"{p}experts.{e}.{x}_proj.weight"][cols] for x in ("gate", "up")]) for e in experts]
        )
        w2 = torch.stack([weights[f"{p}experts.{e}.down_proj.weight"][:, cols] for e in experts])
        assert torch.equal(got[p + "experts.w13_weight"], w13), rank
        assert torch.equal(got[p + "experts.w2_weight"], w2), rank
        assert torch.equal(got[p + "gate.weight"], weights[p + "gate.weight"]), rank
        assert "model.layers.0.mlp.gate_up_proj.weight" in got  # the dense first layer


def test_generator_ep_is_checked(models):
    from megarl.errors import ConfigError

    hf = SafetensorsCheckpoint(models["qwen3_moe"])
    with pytest.raises(ConfigError, match="generator.ep=3 does not divide generator tensor_parallel=2"):
        load_generator_params(hf, 2, 0, torch.float32, ep=3)
    with pytest.raises(ConfigError, match="generator.ep=2: model_type 'qwen3' has no experts"):
        load_generator_params(SafetensorsCheckpoint(models["qwen3"]), 2, 0, torch.float32, ep=2)
    with pytest.raises(ConfigError, match="generator.fp8"):
        load_generator_params(hf, 1, 0, torch.bfloat16, fp8=True)
