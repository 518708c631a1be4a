"""Sync mode's colocated copy: every trainer rank (any TP x PP x DP) fills its own TP-1
engine from the Megatron shards, on the parameters' device, without a full-model temporary.

One torchrun world of 4 CPU ranks walks the layouts (TP2 x PP2, TP1 x PP2 x DP2, TP4
splitting KV groups, PP4, DP4) of an untied and a tied-embedding model, into fp32 / bf16 /
fp8 engines; every rank's engine is compared bitwise with the HF tensors sliced SGLang's
way (tests/sglang_reference.py).
"""

import pytest
import torch

from megarl.models.spec import ModelSpec
from megarl.weight_sync import fp8 as fp8_format
from megarl.weight_sync.colocated import _quantise_band, build_copy_program
from tests.conftest import TINY_CONFIG
from tests.sglang_reference import block_fp8


def tiny_spec(**overrides) -> ModelSpec:
    return ModelSpec.from_hf_config({**TINY_CONFIG, "model_type": "llama", **overrides})


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 2), (4, 1), (1, 4), (4, 2)])
def test_program_moves_each_parameter_once(tp, pp, tied):
    # build_copy_program itself checks that every engine element is written exactly once
    program = build_copy_program(tiny_spec(tie_word_embeddings=tied), tp, pp)
    names = [(s.stage, s.name) for s in program.steps]
    assert len(names) == len(set(names))
    assert all(n == 1 for n in program.dst_steps.values())  # each engine tensor from one Megatron parameter
    # norms are never TP-gathered; a tied last-stage output layer is never moved
    assert all(s.replicated == (tp == 1 or s.name.endswith("norm.weight")) for s in program.steps)
    assert ("output_layer.weight" in {s.name for s in program.steps}) == (not tied)


@pytest.mark.parametrize("shape", [(300, 200), (256, 384), (64, 96), (129, 1)])
def test_in_place_band_quantiser_is_fp8_quantize(shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * 3
    w[:128, :128] *= 1e-6  # a block under MIN_AMAX
    w[-1, -1] = -50.0  # a block whose |max| is negative
    q, scale = torch.empty(shape, dtype=fp8_format.FP8_DTYPE), torch.empty(fp8_format.scale_shape(shape))
    _quantise_band(w.clone(), q, scale)
    want_q, want_scale = fp8_format.quantize(w)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)
    ref_q, ref_scale = block_fp8(w)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale, ref_scale)
