"""How far fp32 computations of a model may stray, from the arithmetic rather than measured on one CPU.

In the probabilistic model of Higham & Mary (SIAM J. Sci. Comput. 2019) a sum of n fp32 terms errs by
about LAMBDA sqrt(n) u of its terms' scale, u = 2**-24. A forward of L layers chains S = 6 L + 1 such
reductions (QKV, scores, scores x V, output projection, gate/up, down per layer, then the head), whose
independent errors add in quadrature: a logit errs by LAMBDA sqrt(S n) u max|logit| (fp32_logit_bound),
n the longest reduction (the widths, the sequence). Reduction order (TP splits, another CPU's kernels)
moves the error within that bound, not past it.

log p = z - logsumexp(z) carries the token's logit error and at most as much again through logsumexp,
whose sum over the V-token vocabulary errs by LAMBDA sqrt(V) u more (relative to a sum >= 1):
eps = 2 LAMBDA sqrt(S n) u max|logit| + LAMBDA sqrt(V) u on each side, and two fp32 computations
(another kernel, reduction order, split of the prefill) differ by at most delta = sqrt(2) eps
(fp32_logprob_bound). A mean of per-token losses -log p (cross entropy) is held to the same delta.

A weight's gradient chains the forward's 6 L + 1 reductions, as many again back to that layer (each
GEMM's input gradient), and the sum over the batch's positions for the weight gradient itself:
S = 2 (6 L + 1) + 1, n the longest of them; two fp32 computations differ by sqrt(2) LAMBDA sqrt(S n) u
of the gradient's norm (fp32_gradient_bound), for the whole gradient; a single tensor, the max over
some 40 tensors of errors of that one scale, is held to twice it."""

import json
from pathlib import Path

import torch

UNIT_ROUNDOFF = 2.0**-24
LAMBDA = 2.0


def _widths(config: dict) -> list:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    moe = config.get("moe_intermediate_size") or 0
    widths = [config["hidden_size"], config["intermediate_size"], moe, head_dim]
    widths.append(moe * (config.get("n_shared_experts") or 0))  # shared experts: one MLP that wide
    if config.get("kv_lora_rank"):  # multi-head latent attention: the latent ranks and the output projection
        widths += [config.get("q_lora_rank") or 0, config["kv_lora_rank"], config["qk_nope_head_dim"]]
        widths.append(config["num_attention_heads"] * config["v_head_dim"])
    return widths


def _reductions_per_layer(config: dict) -> int:
    """QKV, scores, scores x V, output projection, gate/up, down; multi-head latent attention chains
    three more (q and kv each a down then an up projection: 4 products where QKV is one)."""
    return 6 + (3 if config.get("kv_lora_rank") else 0)


def read_config(model_dir) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def fp32_logit_bound(config: dict, seq_len: int, max_logit: float) -> float:
    """LAMBDA sqrt(S n) u max|logit|: one fp32 forward's logits against exact arithmetic, for the
    model of ``config`` (config.json's fields) on sequences of ``seq_len`` positions."""
    longest = max(*_widths(config), seq_len)
    reductions = _reductions_per_layer(config) * config["num_hidden_layers"] + 1
    return LAMBDA * (reductions * longest) ** 0.5 * UNIT_ROUNDOFF * max_logit


def fp32_gradient_bound(config: dict, positions: int) -> float:
    """sqrt(2) LAMBDA sqrt(S n) u: two fp32 computations of the gradient of a loss summed over
    ``positions`` positions, relative to the gradient's norm."""
    longest = max(*_widths(config), positions)
    reductions = 2 * (_reductions_per_layer(config) * config["num_hidden_layers"] + 1) + 1
    return 2**0.5 * LAMBDA * (reductions * longest) ** 0.5 * UNIT_ROUNDOFF


def fp32_logprob_bound(model_dir: Path, sequences, temperature: float = 1.0, **load_kwargs) -> float:
    """delta above for the checkpoint in ``model_dir`` (fp32, log-probs of logits / ``temperature``),
    max|logit| taken by transformers over ``sequences`` (lists of token ids); ``load_kwargs`` go to
    from_pretrained (experts_implementation="eager" for the MoE families)."""
    from transformers import AutoModelForCausalLM

    config = read_config(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **load_kwargs).eval()
    max_logit, longest_seq = 0.0, 0
    with torch.no_grad():
        for ids in sequences:
            max_logit = max(max_logit, model(torch.tensor([list(ids)])).logits.abs().max().item())
            longest_seq = max(longest_seq, len(ids))
    logit = fp32_logit_bound(config, longest_seq, max_logit / temperature)
    logsumexp = LAMBDA * config["vocab_size"] ** 0.5 * UNIT_ROUNDOFF
    return 2**0.5 * (2 * logit + logsumexp)
