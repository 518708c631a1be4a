"""megarl's C decode-attention kernel (generator/torch_engine/decode_attention.c) against an
fp64 reference: ragged lengths, scattered cache slots, grouped query heads, bf16 and fp32."""

import math
import shutil

import pytest
import torch

from megarl.generator.torch_engine import native


def reference(q, k_cache, v_cache, slots, lengths):
    """Plain fp64 softmax attention, one sequence at a time; query head j reads KV head j // group."""
    batch, heads, d = q.shape
    group = heads // k_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(batch):
        n = int(lengths[b])
        k = k_cache[slots[b], :, :n].double().repeat_interleave(group, 0)  # [heads, n, d]
        v = v_cache[slots[b], :, :n].double().repeat_interleave(group, 0)
        scores = torch.einsum("hd,hnd->hn", q[b].double(), k) / math.sqrt(d)
        out[b] = torch.einsum("hn,hnd->hd", torch.softmax(scores, -1), v)
    return out


def built():
    """The kernel, built: every machine of this project's kind has gcc, so a failed build is a failure."""
    assert shutil.which("cc") or shutil.which("gcc"), "no C compiler: the engine would fall back to SDPA"
    assert native.load() is not None, native.why_not()


def test_the_kernel_builds_where_a_compiler_is():
    built()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("kv_heads,group,d", [(3, 3, 64), (2, 4, 128), (1, 1, 32)])
def test_matches_fp64_attention(dtype, tol, kv_heads, group, d):
    built()
    g = torch.Generator().manual_seed(d + group)
    slots_total, max_len, batch = 12, 70, 7
    k_cache = torch.randn(slots_total, kv_heads, max_len, d, generator=g).to(dtype)
    v_cache = torch.randn(slots_total, kv_heads, max_len, d, generator=g).to(dtype)
    q = (2 * torch.randn(batch, kv_heads * group, d, generator=g)).to(dtype)
    slots = torch.tensor([9, 0, 4, 11, 2, 7, 5])
    lengths = torch.tensor([1, 70, 33, 2, 69, 17, 50])  # a first token, a full slot, the rest ragged
    got = native.decode_attention(q, k_cache, v_cache, slots, lengths, 1.0 / math.sqrt(d))
    want = reference(q, k_cache, v_cache, slots, lengths)
    assert got.dtype == dtype and got.shape == q.shape
    # a length-1 sequence attends to its one key: the output is that value row
    assert torch.equal(got[0], v_cache[9, :, 0].repeat_interleave(group, 0))
    err = (got.double() - want).abs().max().item()
    assert err <= tol * want.abs().max().item(), err
    # keys past a sequence's length do not count: poisoning them changes nothing
    k_cache[4, :, 33:] = 1e4  # slot 4: sequence 2, 33 keys
    v_cache[4, :, 33:] = float("nan")
    again = native.decode_attention(q, k_cache, v_cache, slots, lengths, 1.0 / math.sqrt(d))
    assert torch.equal(again, got)


def test_new_keys_and_values_are_written_then_attended_from_views_of_the_fused_rows():
    built()
    g = torch.Generator().manual_seed(3)
    kv_heads, group, d, batch = 2, 3, 64, 4
    heads = kv_heads * group
    k_cache = torch.randn(6, kv_heads, 40, d, generator=g).bfloat16()
    v_cache = torch.randn(6, kv_heads, 40, d, generator=g).bfloat16()
    fused = torch.randn(batch, (heads + 2 * kv_heads) * d, generator=g).bfloat16()  # one token's q | k | v
    q = fused[:, : heads * d].view(batch, heads, d)
    k = fused[:, heads * d : (heads + kv_heads) * d].view(batch, kv_heads, d)
    v = fused[:, (heads + kv_heads) * d :].view(batch, kv_heads, d)
    slots, lengths = torch.tensor([5, 1, 3, 0]), torch.tensor([7, 1, 40, 22])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for b in range(batch):
        want_k[slots[b], :, lengths[b] - 1] = k[b]
        want_v[slots[b], :, lengths[b] - 1] = v[b]
    want = reference(q, want_k, want_v, slots, lengths)
    got = native.decode_attention(q, k_cache, v_cache, slots, lengths, 1.0 / math.sqrt(d), new_k=k, new_v=v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert (got.double() - want).abs().max().item() <= 1.6e-2 * want.abs().max().item()
    assert torch.equal(got[1], v[1].repeat_interleave(group, 0))  # a first token sees only itself


def test_bad_input_is_refused_with_the_reason():
    built()
    cache = torch.zeros(2, 1, 8, 64)
    q = torch.zeros(1, 1, 64)
    with pytest.raises(ValueError, match="length outside"):
        native.decode_attention(q, cache, cache, torch.tensor([0]), torch.tensor([9]), 0.125)
    with pytest.raises(ValueError, match="slot outside"):
        native.decode_attention(q, cache, cache, torch.tensor([2]), torch.tensor([1]), 0.125)
    with pytest.raises(ValueError, match="one dtype"):
        native.decode_attention(q.bfloat16(), cache, cache, torch.tensor([0]), torch.tensor([1]), 0.125)
    with pytest.raises(ValueError, match="multiple of 16"):
        odd = torch.zeros(2, 1, 8, 24)
        native.decode_attention(torch.zeros(1, 1, 24), odd, odd, torch.tensor([0]), torch.tensor([1]), 0.2)
    with pytest.raises(ValueError, match="heads contiguous"):
        native.decode_attention(
            torch.zeros(1, 64, 2)[:, :, 0].view(1, 1, 64), cache, cache, torch.tensor([0]), torch.tensor([1]), 0.125
        )
