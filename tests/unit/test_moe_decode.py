"""The engine's MoE layer routed on the device (megarl/generator/torch_engine/moe.py) against the
per-expert loop it replaced (moe.expert_loop): the same floats bit for bit, so the same tokens,
log-probs and routed experts from the engine, and no value read on the host inside the layer."""

import pytest
import torch

from megarl.generator.interface import GenerationRequest, SamplingParams
from megarl.generator.torch_engine import moe
from megarl.generator.torch_engine.engine import TorchEngine
from megarl.generator.torch_engine.model import KVCache, Segment, SglangLayoutModel
from megarl.generator.weights import load_generator_params
from megarl.models.hf_checkpoint import SafetensorsCheckpoint
from tests.conftest import make_tiny_family

EXPERTS, TOP_K, HIDDEN, INTER = 8, 3, 64, 32


def layer_inputs(tokens: int, dtype: torch.dtype, seed: int = 0):
    """One layer's hidden states, a random router's choice and stacked experts at the scale of
    transformers' tiny init (0.2 std)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    gate = (0.2 * torch.randn(EXPERTS, HIDDEN, generator=g)).to(dtype)
    w13 = (0.2 * torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g)).to(dtype)
    w2 = (0.2 * torch.randn(EXPERTS, HIDDEN, INTER, generator=g)).to(dtype)
    weights, experts = moe.route(h, gate, TOP_K, renormalise=False)
    return h, weights, experts, w13, w2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 64])
def test_grouped_experts_equal_the_loop_bit_for_bit(dtype, tokens):
    """1 and 3 tokens: most experts get none and the others one row (a decode step of one or a few
    sequences); 64: every expert several rows."""
    h, weights, experts, w13, w2 = layer_inputs(tokens, dtype)
    got = moe.apply_experts(h, weights, experts, w13, w2, 0)
    assert torch.equal(got, moe.expert_loop(h, weights, experts, w13, w2, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_summation_order_is_what_makes_the_floats_equal(dtype):
    """The guarded mistake: each token's expert outputs summed in the router's order (largest weight
    first) instead of ascending expert id rounds differently -- bit-for-bit equality can see it."""
    h, weights, experts, w13, w2 = layer_inputs(64, dtype)
    loop = moe.expert_loop(h, weights, experts, w13, w2, 0)
    router_order = torch.zeros_like(h)
    for r in range(TOP_K):  # one expert at a time through the loop: its output for the tokens in slot r
        alone = torch.where(torch.arange(TOP_K) == r, experts, -1)
        router_order += moe.expert_loop(h, weights, alone, w13, w2, 0)
    assert torch.allclose(router_order.float(), loop.float(), rtol=1e-2, atol=1e-2)  # the same sum...
    assert not torch.equal(router_order, loop)  # ...rounded differently


@pytest.mark.parametrize("first", [0, 4])
def test_an_ep_rank_applies_its_own_experts_only(first):
    """SGLang --ep-size 2 with 8 experts: a rank holds experts [first, first + 4) and gives exact
    zeros to a token routed to none of them (the grouped GEMM leaves such rows unwritten)."""
    h, weights, experts, w13, w2 = layer_inputs(64, torch.float32, seed=1)
    experts[0] = torch.tensor([4 - first, 5 - first, 7 - first])  # token 0: only the other rank's experts
    mine = slice(first, first + 4)
    got = moe.apply_experts(h, weights, experts, w13[mine], w2[mine], first)
    assert torch.equal(got, moe.expert_loop(h, weights, experts, w13[mine], w2[mine], first))
    assert torch.equal(got[0], torch.zeros(HIDDEN))
    # the two ranks' parts sum to the whole layer (in a different order: to rounding)
    other = slice(4 - first, 8 - first)
    both = got + moe.apply_experts(h, weights, experts, w13[other], w2[other], 4 - first)
    whole = moe.apply_experts(h, weights, experts, w13, w2, 0)
    assert torch.allclose(both, whole, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got, whole, rtol=1e-2, atol=1e-2)


def run_engine(model_dir, dtype):
    hf = SafetensorsCheckpoint(model_dir)
    engine = TorchEngine(hf.spec, load_generator_params(hf, 1, 0, dtype), max_running=3, max_seq_len=48)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, hf.spec.vocab_size, (n,), generator=g).tolist() for n in (6, 2, 9, 4)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    sampled = SamplingParams(temperature=0.9, max_new_tokens=10, seed=11)
    # four prompts on three slots: prefills beside decodes; greedy and sampled rows in one batch
    engine.submit([GenerationRequest(str(i), ids, greedy if i % 2 else sampled) for i, ids in enumerate(prompts)])
    return {c.request_id: c for c in engine.run_until_idle()}


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    # 8 experts top 3 in every layer, renormalised: decode batches leave experts empty or with one row
    return make_tiny_family(
        "qwen3_moe",
        tmp_path_factory.mktemp("moe_decode") / "model",
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        mlp_only_layers=[],
        norm_topk_prob=True,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_tokens_logprobs_and_routes_equal_the_loop(moe_model, monkeypatch, dtype):
    # one thread: both paths multiply the same per-expert shapes, but a loaded machine can hand a GEMM
    # fewer threads from one call to the next (MKL's dynamic threading), which splits its sums otherwise
    # (seen once in a suite run beside a benchmark); bitwise equality is a claim about the paths, not that
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _tokens_logprobs_and_routes_equal_the_loop(moe_model, monkeypatch, dtype)
    finally:
        torch.set_num_threads(threads)


def _tokens_logprobs_and_routes_equal_the_loop(moe_model, monkeypatch, dtype):
    new = run_engine(moe_model, dtype)
    monkeypatch.setattr(moe, "apply_experts", moe.expert_loop)
    old = run_engine(moe_model, dtype)
    assert sorted(new) == sorted(old) == ["0", "1", "2", "3"]
    for rid in old:
        assert new[rid].output_ids == old[rid].output_ids, rid
        assert new[rid].logprobs == old[rid].logprobs, rid
        assert torch.equal(new[rid].routed_experts, old[rid].routed_experts), rid


def meta_model(model_dir):
    """The tiny model's parameters as bf16 tensors on the meta device: shapes, no values. An op that
    must read a value on the host to go on (``item``, ``tolist``, ``nonzero``, a boolean mask, a
    data-sized output) raises there -- what on a GPU is a host synchronisation. bf16: the dtype a GPU
    engine runs, and the one the meta kernel of grouped_mm accepts (it checks CUDA's constraints)."""
    hf = SafetensorsCheckpoint(model_dir)
    params = load_generator_params(hf, 1, 0, torch.bfloat16)
    return hf.spec, SglangLayoutModel(hf.spec, {n: p.to("meta") for n, p in params.items()}, cpu_kernels="torch")


def meta_forward(spec, model):
    cache = KVCache(spec.num_layers, 1, model.kv_heads, 16, spec.head_dim, torch.bfloat16, "meta")
    tokens = torch.zeros(5, dtype=torch.long, device="meta")
    # a prefill: its attention reads no value on the host (a decode's plan reads the longest length once)
    return model.forward(tokens, torch.arange(5, device="meta"), [Segment(0, 0, 5, 0)], cache)


def test_moe_layers_read_no_value_on_the_host(moe_model, monkeypatch):
    """A forward through every MoE layer, its routes recorded on the device; the loop it replaced fails."""
    spec, model = meta_model(moe_model)
    assert meta_forward(spec, model).shape == (5, spec.vocab_size)
    assert model.routes.device.type == "meta" and tuple(model.routes.shape) == (5, spec.num_layers, TOP_K)
    monkeypatch.setattr(moe, "apply_experts", moe.expert_loop)
    with pytest.raises(NotImplementedError, match="nonzero"):
        meta_forward(spec, model)
