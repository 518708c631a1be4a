"""Fused vocab-parallel log-probs and entropy vs log_softmax over the full vocabulary."""

import pytest
import torch

from megarl.trainer.logprobs import vocab_parallel_logprobs

# Logit scale keeps |log p| < 16, where one fp32 ulp is below the 1e-6 tolerance.
VOCAB, PADDED, TOKENS, TEMPERATURE = 300, 512, 23, 1.3


def make_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, TOKENS, PADDED, generator=g)
    logits[..., VOCAB:] = torch.randn(2, TOKENS, PADDED - VOCAB, generator=g) * 50  # pad columns: garbage
    return {
        "logits": logits,
        "targets": torch.randint(0, VOCAB, (2, TOKENS), generator=g),
        "temperature": TEMPERATURE,
        "vocab_size": VOCAB,
        "w_logp": torch.randn(2, TOKENS, generator=g),
        "w_entropy": torch.randn(2, TOKENS, generator=g),
    }


def reference(case):
    """float64 log_softmax over the real vocabulary, differentiated by autograd."""
    x = case["logits"].double().requires_grad_(True)
    logp_all = torch.log_softmax(x[..., :VOCAB] / case["temperature"], dim=-1)
    logp = logp_all.gather(-1, case["targets"][..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    (logp * case["w_logp"].double() + entropy * case["w_entropy"].double()).sum().backward()
    return logp.detach(), entropy.detach(), x.grad


@pytest.mark.parametrize("chunk_tokens", [1, 7, 1024])
def test_tp1_matches_log_softmax(chunk_tokens):
    case = make_case()
    x = case["logits"].clone().requires_grad_(True)
    logp, entropy = vocab_parallel_logprobs(x, case["targets"], VOCAB, TEMPERATURE, True, chunk_tokens)
    (logp * case["w_logp"] + entropy * case["w_entropy"]).sum().backward()
    ref_logp, ref_entropy, ref_grad = reference(case)
    assert (logp.double() - ref_logp).abs().max() <= 1e-6
    assert (entropy.double() - ref_entropy).abs().max() <= 1e-6
    assert (x.grad.double() - ref_grad).abs().max() <= 1e-6
    assert not x.grad[..., VOCAB:].any()  # pad columns get no gradient


def test_bf16_logits_are_computed_in_fp32():
    case = make_case(1)
    logp, _ = vocab_parallel_logprobs(case["logits"].bfloat16(), case["targets"], VOCAB, TEMPERATURE)
    assert logp.dtype == torch.float32
    case["logits"] = case["logits"].bfloat16().float()
    ref_logp, _, _ = reference(case)
    assert (logp.double() - ref_logp).abs().max() <= 1e-5


def test_inputs_are_not_modified():
    case = make_case(3)
    x = case["logits"].clone().requires_grad_(True)
    logp, entropy = vocab_parallel_logprobs(x, case["targets"], VOCAB, TEMPERATURE, True, 5)
    (logp.sum() + entropy.sum()).backward()
    assert torch.equal(x.detach(), case["logits"])
