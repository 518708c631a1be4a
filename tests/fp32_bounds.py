"""How far two fp32 computations of a model's log-probs may differ, from the arithmetic rather than
measured on one CPU (the model tests/multiprocess/test_conversion_families.py uses for logits).

In the probabilistic model of Higham & Mary (SIAM J. Sci. Comput. 2019) a sum of n fp32 terms errs by
about LAMBDA sqrt(n) u of its terms' scale, u = 2**-24. A forward of L layers chains S = 6 L + 1 such
reductions (QKV, scores, scores x V, output projection, gate/up, down per layer, then the head), whose
independent errors add in quadrature: a logit errs by LAMBDA sqrt(S n) u max|logit|, n the longest
reduction (the widths, the sequence). log p = z - logsumexp(z) carries the token's logit error and at
most as much again through logsumexp, whose sum over the V-token vocabulary errs by LAMBDA sqrt(V) u
more (relative to a sum >= 1): eps = 2 LAMBDA sqrt(S n) u max|logit| + LAMBDA sqrt(V) u on each side,
and two fp32 computations (another kernel, reduction order, split of the prefill) differ by at most
delta = sqrt(2) eps."""

import json
from pathlib import Path

import torch

UNIT_ROUNDOFF = 2.0**-24
LAMBDA = 2.0


def fp32_logprob_bound(model_dir: Path, sequences, **load_kwargs) -> float:
    """delta above for the checkpoint in ``model_dir`` (fp32, temperature 1), max|logit| taken by
    transformers over ``sequences`` (lists of token ids); ``load_kwargs`` go to from_pretrained
    (experts_implementation="eager" for the MoE families)."""
    from transformers import AutoModelForCausalLM

    config = json.loads((Path(model_dir) / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **load_kwargs).eval()
    max_logit, longest_seq = 0.0, 0
    with torch.no_grad():
        for ids in sequences:
            max_logit = max(max_logit, model(torch.tensor([list(ids)])).logits.abs().max().item())
            longest_seq = max(longest_seq, len(ids))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    widths = [config["hidden_size"], config["intermediate_size"], config.get("moe_intermediate_size", 0)]
    longest = max(*widths, head_dim, longest_seq)
    logit = LAMBDA * ((6 * config["num_hidden_layers"] + 1) * longest) ** 0.5 * UNIT_ROUNDOFF * max_logit
    logsumexp = LAMBDA * config["vocab_size"] ** 0.5 * UNIT_ROUNDOFF
    return 2**0.5 * (2 * logit + logsumexp)
