"""The HF <-> Megatron tensor layouts, on labelled rows (independent of any model)."""

import pytest
import torch

from megarl.models.hf_mapping import fuse_qkv, pad_vocab, split_qkv
from megarl.models.spec import ModelSpec
from tests.unit.test_spec import llama_config


def labelled(rows_per_head: int, heads: int, tag: float, cols: int = 3) -> torch.Tensor:
    """Row r of head h holds tag + h + r/100 in every column."""
    values = torch.tensor([tag + h + r / 100 for h in range(heads) for r in range(rows_per_head)])
    return values.unsqueeze(1).repeat(1, cols)


def test_qkv_grouped_per_kv_group():
    # 4 q heads, 2 KV heads, head_dim 16: Megatron's rows are, per KV group g,
    # [q heads of g (2 of them); k_g; v_g].
    spec = ModelSpec.from_hf_config(llama_config())
    d = spec.head_dim
    q, k, v = labelled(d, 4, 100.0), labelled(d, 2, 200.0), labelled(d, 2, 300.0)
    fused = fuse_qkv(q, k, v, spec)
    head_tags = fused[::d, 0].floor().tolist()
    assert head_tags == [100, 101, 200, 300, 102, 103, 201, 301]
    assert torch.equal(fused[:d], q[:d]) and torch.equal(fused[2 * d : 3 * d], k[:d])
    back = split_qkv(fused, spec)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))


def test_qkv_matches_megatrons_own_split():
    # Megatron's SelfAttention views the fused projection as
    # [groups, (q_per_group + 2) * head_dim] and splits q | k | v inside each group.
    spec = ModelSpec.from_hf_config(llama_config())
    d, g, qpg = spec.head_dim, spec.num_kv_heads, spec.q_per_kv
    q, k, v = torch.randn(4 * d, 8), torch.randn(2 * d, 8), torch.randn(2 * d, 8)
    x = torch.randn(8)
    mixed = (fuse_qkv(q, k, v, spec) @ x).view(g, (qpg + 2) * d)
    mq, mk, mv = torch.split(mixed, [qpg * d, d, d], dim=1)
    assert torch.allclose(mq.reshape(-1), q @ x) and torch.allclose(mk.reshape(-1), k @ x)
    assert torch.allclose(mv.reshape(-1), v @ x)


def test_vocab_padding_appends_zero_rows():
    w = torch.randn(300, 4)
    padded = pad_vocab(w, 384)
    assert padded.shape == (384, 4) and torch.equal(padded[:300], w) and not padded[300:].any()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_hf_tensor_shapes_are_the_checkpoint_files_tensors(family, tmp_path):
    # the names and shapes save_pretrained writes (hub layout: one tensor per expert)
    import transformers
    from safetensors import safe_open

    from megarl.models.hf_mapping import hf_tensor_shapes

    shape = dict(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4)
    shape.update(num_key_value_heads=2, head_dim=16)
    if family == "qwen3_moe":
        shape.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12, mlp_only_layers=[1])
    config = transformers.AutoConfig.for_model(family, **shape)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert saved == hf_tensor_shapes(ModelSpec.from_hf_config(config))
