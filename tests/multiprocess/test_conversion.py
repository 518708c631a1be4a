"""HF <-> Megatron conversion of a tiny random Llama, checked against transformers.

The tiny model has GQA, untied embeddings, Llama-3 RoPE scaling with
non-default parameters and a vocabulary that is not a multiple of 128. It is
converted once at TP2 x PP2, then loaded by Megatron's GPTModel at four
layouts (Megatron reshards on load), and exported back.
"""

import json

import pytest
import torch
from safetensors import safe_open

from tests.conftest import hf_logits, run_ranks, run_tool

LAYOUTS = ["1x1", "2x1", "1x2", "2x2", "4x1"]  # 4x1: more TP ranks than KV heads


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokens") / "tokens.pt"
    tok = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(7))
    torch.save(tok, path)
    return path


@pytest.fixture(scope="module")
def megatron_logits(tiny_megatron, tokens, tmp_path_factory):
    out = tmp_path_factory.mktemp("logits")
    run_ranks(
        4, "logits_worker.py", "--checkpoint", tiny_megatron, "--tokens", tokens, "--out", out, "--layouts", *LAYOUTS
    )
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_match_transformers(layout, megatron_logits, tiny_hf, tokens):
    reference = hf_logits(tiny_hf, torch.load(tokens))
    ours = torch.load(megatron_logits / f"logits_{layout}.pt")
    assert ours.shape == reference.shape == (2, 24, 300)
    assert reference.abs().max() > 5  # a real signal, not near-zero logits
    diff = (ours - reference).abs().max().item()
    print(f"TP x PP = {layout}: max |logit diff| = {diff:.3e}")
    assert diff <= 1e-4


@pytest.fixture(scope="module")
def exported(tiny_megatron, tmp_path_factory):
    out = tmp_path_factory.mktemp("exported") / "hf"
    run_tool("convert_megatron_to_hf.py", "--megatron", tiny_megatron, "--output", out)
    return out


def read_safetensors_dir(path):
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, framework="pt") as handle:
            tensors.update({k: handle.get_tensor(k) for k in handle.keys()})
    return tensors


def test_round_trip_is_bitwise_identical(tiny_hf, exported):
    original, back = read_safetensors_dir(tiny_hf), read_safetensors_dir(exported)
    assert sorted(original) == sorted(back)
    for name in original:
        assert back[name].dtype == original[name].dtype, name
        assert torch.equal(back[name], original[name]), name


def test_exported_model_loads_in_transformers(tiny_hf, exported, tokens):
    tok = torch.load(tokens)
    assert torch.equal(hf_logits(exported, tok), hf_logits(tiny_hf, tok))
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 300


def test_export_streams_into_bounded_shards(tiny_megatron, tiny_hf, tmp_path):
    out = tmp_path / "sharded"
    run_tool("convert_megatron_to_hf.py", "--megatron", tiny_megatron, "--output", out, "--max-shard-gb", "0.0001")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 5 and all((out / f).exists() for f in files)
    original, back = read_safetensors_dir(tiny_hf), read_safetensors_dir(out)
    assert all(torch.equal(back[k], original[k]) for k in original) and sorted(back) == sorted(original)


def test_bf16_conversion_keeps_bf16(tiny_hf, tmp_path):
    out = tmp_path / "bf16"
    run_tool("convert_hf_to_megatron.py", "--hf-model", tiny_hf, "--output", out, "--dtype", "bf16")
    back = tmp_path / "bf16_hf"
    run_tool("convert_megatron_to_hf.py", "--megatron", out, "--output", back)
    original, exported_bf16 = read_safetensors_dir(tiny_hf), read_safetensors_dir(back)
    for name, tensor in original.items():
        assert exported_bf16[name].dtype == torch.bfloat16
        assert torch.equal(exported_bf16[name], tensor.to(torch.bfloat16)), name


# -- bad input: one clear error, exit code 2, nothing written ---------------------------------


def test_missing_path(tmp_path):
    proc = run_tool(
        "convert_hf_to_megatron.py", "--hf-model", tmp_path / "nope", "--output", tmp_path / "o", expect_rc=2
    )
    assert "nope: no such file or directory" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


def test_unsupported_architecture_names_the_field(tmp_path):
    from tests.conftest import make_tiny_llama

    model = make_tiny_llama(tmp_path / "biased", attention_bias=True)
    proc = run_tool("convert_hf_to_megatron.py", "--hf-model", model, "--output", tmp_path / "o", expect_rc=2)
    assert "attention_bias=True is not supported" in proc.stderr and "Traceback" not in proc.stderr
    config = json.loads((model / "config.json").read_text())
    # Qwen2 has q/k/v biases but none on o_proj: the Llama's o_proj biases are named, not dropped
    config.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    (model / "config.json").write_text(json.dumps(config))
    proc = run_tool("convert_hf_to_megatron.py", "--hf-model", model, "--output", tmp_path / "o", expect_rc=2)
    assert "'model.layers.0.self_attn.o_proj.bias'" in proc.stderr and "model_type 'qwen2'" in proc.stderr
    assert not (tmp_path / "o").exists()
    config.update(model_type="mistral", architectures=["MistralForCausalLM"])
    (model / "config.json").write_text(json.dumps(config))
    proc = run_tool("convert_hf_to_megatron.py", "--hf-model", model, "--output", tmp_path / "o", expect_rc=2)
    assert "unsupported architecture model_type='mistral'" in proc.stderr


def test_tp_not_dividing_heads_names_both_numbers(tiny_hf, tmp_path):
    proc = run_tool(
        "convert_hf_to_megatron.py", "--hf-model", tiny_hf, "--output", tmp_path / "o", "--tp", 3, expect_rc=2
    )
    assert "tensor_model_parallel_size=3 does not divide num_attention_heads=4" in proc.stderr


def test_not_a_megatron_checkpoint(tiny_hf, tmp_path):
    proc = run_tool("convert_megatron_to_hf.py", "--megatron", tiny_hf, "--output", tmp_path / "o", expect_rc=2)
    assert "not a Megatron dist checkpoint" in proc.stderr and str(tiny_hf) in proc.stderr


def test_refuses_to_overwrite_output(tiny_hf, tiny_megatron):
    before = sorted(p.name for p in tiny_megatron.rglob("*"))
    proc = run_tool("convert_hf_to_megatron.py", "--hf-model", tiny_hf, "--output", tiny_megatron, expect_rc=2)
    assert "not empty; refusing to overwrite" in proc.stderr
    assert sorted(p.name for p in tiny_megatron.rglob("*")) == before
