"""megarl's C elementwise ops of a decoder layer (generator/torch_engine/decoder_ops.c): the residual
add + RMSNorm, RoPE and SwiGLU, against fp64 references and against the torch ops the engine uses
where the kernels are off (the same roundings in bf16), and the engine's bf16 logits with them."""

import pytest
import torch
import torch.nn.functional as F

from megarl.generator.torch_engine import native
from megarl.generator.torch_engine.model import KVCache, Segment, SglangLayoutModel, _apply_rope
from megarl.generator.weights import load_generator_params
from megarl.models.hf_checkpoint import SafetensorsCheckpoint
from tests.conftest import CHAT_PROMPTS
from tests.unit.test_decode_attention import built

BF16_ULP = 2.0**-7  # relative spacing of bf16 values


def torch_norm(x, w, eps):
    """The engine's torch RMSNorm (transformers' LlamaRMSNorm): fp32 inside, rounded to x's dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def activations(rows, width, dtype, seed):
    """Rows like a residual stream's: mostly O(1), a few outlier features in the hundreds, one row of zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g)
    x[:, :3] *= 300.0
    x[-1] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_fp64_and_the_torch_ops(dtype, with_delta):
    built()
    eps, hidden = 1e-5, 576
    wide = activations(40, hidden + 64, dtype, 1)
    x = wide[:, :hidden]  # rows of a wider tensor: the kernel follows the row stride
    delta = activations(40, hidden, dtype, 2) if with_delta else None
    w = (1 + 0.2 * torch.randn(hidden, generator=torch.Generator().manual_seed(3))).to(dtype)
    before, untouched = x.clone(), wide[:, hidden:].clone()
    summed = (before.float() + delta.float()).to(dtype) if with_delta else before  # the add, rounded once
    out = native.add_rms_norm(x, w, eps, delta)

    assert torch.equal(x, summed)  # the residual updated in place, exactly
    assert torch.equal(wide[:, hidden:], untouched)
    s = summed.double()
    exact = w.double() * s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    assert torch.equal(out[-1], torch.zeros(hidden, dtype=dtype))  # a zero row: eps, no NaN
    # fp64 reference: two roundings to bf16 (normalised value, product) -> within 2 ulp; fp32 ~1e-6
    rel = ((out.double() - exact).abs() / exact.abs().clamp_min(1e-3)).max().item()
    assert rel <= (2 * BF16_ULP if dtype == torch.bfloat16 else 2e-6), rel
    # torch's ops: the same roundings; the sum of squares runs in another order, so a normalised
    # value that lands on a rounding boundary may round the other way (measured: 258 of 26M
    # values over a SmolLM2 decode) -- one ulp, rarely.
    ref = torch_norm(summed, w, eps)
    differ = (out != ref).float().mean().item()
    if dtype == torch.bfloat16:
        assert differ <= 1e-3, differ
        assert ((out.double() - ref.double()).abs() <= BF16_ULP * ref.double().abs() + 1e-30).all()
    else:
        assert torch.allclose(out, ref, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_is_bitwise_the_torch_ops_and_rotates_each_pair(dtype):
    built()
    rows, heads, d, width = 20, 5, 64, 7 * 64  # 5 heads rotated, 2 (the v heads) left alone
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(rows, width, generator=g).to(dtype)
    positions = torch.randint(0, 4000, (rows,), generator=g)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).double() / d))
    angles = positions.double()[:, None] * inv_freq[None, :]  # [rows, d / 2]
    f = angles.float()
    cos = torch.cat((f, f), -1).cos().to(dtype)[:, None]
    signed_sin = torch.cat((-f.sin(), f.sin()), -1).to(dtype)[:, None]
    before = qkv.clone()
    native.rope_(qkv, cos, signed_sin, heads, d)

    assert torch.equal(qkv[:, heads * d :], before[:, heads * d :])
    expected = _apply_rope(before[:, : heads * d].view(rows, heads, d), cos, signed_sin)
    assert torch.equal(qkv[:, : heads * d].view(rows, heads, d), expected)
    # independent: pair (x_i, x_{i + d/2}) turned by the angle position * inv_freq_i
    x = before[:, : heads * d].view(rows, heads, d).double()
    a, b = x[..., : d // 2], x[..., d // 2 :]
    c, s = angles.cos()[:, None], angles.sin()[:, None]
    turned = torch.cat((a * c - b * s, a * s + b * c), -1)
    got = qkv[:, : heads * d].view(rows, heads, d).double()
    # the tables are rounded to the dtype (and cos/sin of fp32 angles near 4000 rad): ~3 ulp of |x|
    tol = 4 * BF16_ULP if dtype == torch.bfloat16 else 2e-4
    assert ((got - turned).abs() <= tol * x.abs().amax(-1, keepdim=True)).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_matches_fp64_and_the_torch_ops(dtype):
    built()
    rows, inter = 33, 1536
    g = torch.Generator().manual_seed(5)
    gate_up = 4 * torch.randn(rows, 2 * inter, generator=g)
    gate_up[0, :6] = torch.tensor([-1000.0, -90.0, -20.0, 0.0, 20.0, 1000.0])  # exp's clamps
    gate_up = gate_up.to(dtype)
    out = native.silu_mul(gate_up)
    gate, up = gate_up.double().chunk(2, -1)
    exact = gate * torch.sigmoid(gate) * up
    scale = (gate.abs() * up.abs()).clamp_min(1e-6)
    rel = ((out.double() - exact).abs() / scale).max().item()
    assert rel <= (2 * BF16_ULP if dtype == torch.bfloat16 else 1e-6), rel
    ref = F.silu(gate_up.chunk(2, -1)[0]) * gate_up.chunk(2, -1)[1]
    assert (out != ref).float().mean().item() <= (1e-3 if dtype == torch.bfloat16 else 2e-2)


def test_bad_input_is_refused_naming_it():
    built()
    x = torch.zeros(4, 64)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        native.add_rms_norm(x, torch.ones(32), 1e-5)
    with pytest.raises(ValueError, match="delta must be contiguous"):
        native.add_rms_norm(x, torch.ones(64), 1e-5, torch.zeros(4, 32))
    with pytest.raises(ValueError, match="one dtype"):
        native.add_rms_norm(x, torch.ones(64, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="x must be 2-D"):
        native.add_rms_norm(torch.zeros(64, 4).t(), torch.ones(64), 1e-5)
    with pytest.raises(ValueError, match="cos must be contiguous"):
        native.rope_(torch.zeros(4, 128), torch.zeros(4, 32), torch.zeros(4, 64), 2, 64)
    with pytest.raises(ValueError, match="even"):
        native.rope_(torch.zeros(4, 14), torch.zeros(4, 7), torch.zeros(4, 7), 2, 7)
    with pytest.raises(ValueError, match="2 \\* inter"):
        native.silu_mul(torch.zeros(4, 7))
    with pytest.raises(ValueError, match="bf16 or fp32"):
        native.silu_mul(torch.zeros(4, 8, dtype=torch.float16))


def test_engine_bf16_logits_with_the_kernels_are_as_close_to_fp32_as_with_torch_ops(smollm2_hf):
    """The kernels wired into the engine's forward (in-place residual and RoPE, fused gate_up):
    a prefill of chat prompts in bf16 with them (cpu_kernels="auto") and with torch's ops, each
    against the same model in fp32. bf16 itself moves the logits (KL ~1e-3 nats per position); a
    wiring mistake (a head rotated twice, a residual added twice) moves them by far more."""
    built()
    from megarl.generator.tokenizer import encode_prompt, load_tokenizer

    hf = SafetensorsCheckpoint(smollm2_hf)
    tokenizer = load_tokenizer(smollm2_hf)
    prompts = [encode_prompt(tokenizer, p) for p in CHAT_PROMPTS]
    tokens = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    offsets = [sum(map(len, prompts[:i])) for i in range(len(prompts))]
    segments = [Segment(i, 0, len(p), o) for i, (p, o) in enumerate(zip(prompts, offsets))]
    logits = {}
    for name, dtype, kernels in (
        ("fp32", torch.float32, "torch"),
        ("native", torch.bfloat16, "auto"),
        ("torch", torch.bfloat16, "torch"),
    ):
        model = SglangLayoutModel(hf.spec, load_generator_params(hf, 1, 0, dtype), cpu_kernels=kernels)
        assert model.native_ops == (kernels == "auto")
        cache = KVCache(hf.spec.num_layers, len(prompts), model.kv_heads, 256, hf.spec.head_dim, dtype)
        logits[name] = torch.log_softmax(model.forward(tokens, positions, segments, cache), -1)
    ref = logits["fp32"]

    def kl(name):
        return (ref.exp() * (ref - logits[name])).sum(-1).mean().item()

    def agree(name):
        return (logits[name].argmax(-1) == ref.argmax(-1)).float().mean().item()

    print(
        f"KL(fp32 || bf16) native {kl('native'):.2e} torch {kl('torch'):.2e}; argmax agreement "
        f"{agree('native'):.3f} / {agree('torch'):.3f} over {len(tokens)} positions"
    )
    assert kl("native") <= 2 * kl("torch")
    assert agree("native") >= agree("torch") - 0.03
