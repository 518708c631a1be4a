"""What the engine tests of the Qwen families compare with: transformers' own greedy tokens and
its routers' top-k, on tiny random models (tests/conftest.py make_tiny_family)."""

from pathlib import Path
from typing import Dict, List

import torch

from tests.conftest import make_tiny_family, transformers_greedy

MAX_NEW = 12
# (family, make_tiny_family overrides): qwen3_moe's default has a dense first layer and
# softmax-then-top-k routing; the variant renormalises the top k and has experts in every layer
FAMILIES = {
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe_renormalised": ("qwen3_moe", dict(norm_topk_prob=True, mlp_only_layers=[], num_experts_per_tok=3)),
}
EAGER = dict(experts_implementation="eager")  # transformers' per-expert loop: the float reference


def build(name: str, root: Path) -> Path:
    family, overrides = FAMILIES[name]
    return make_tiny_family(family, root / name, **overrides)


def prompts(vocab: int = 300) -> List[List[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 11, 3)]


def reference(model_dir: Path, prompt_ids) -> list:
    return transformers_greedy(model_dir, prompt_ids, MAX_NEW, (), **EAGER)


def reference_routes(model_dir: Path, sequence: List[int]) -> Dict[int, torch.Tensor]:
    """transformers' router top-k per MoE layer for the fed positions of one sequence (all but
    its last token), by layer index: softmax of the router logits, then top-k."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **EAGER).eval()
    k = model.config.num_experts_per_tok
    with torch.no_grad():
        out = model(torch.tensor([sequence[:-1]]), output_router_logits=True)
    sparse = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    assert len(sparse) == len(out.router_logits)
    # router_logits: [tokens, experts] per MoE layer
    return {i: logits.softmax(-1).topk(k, dim=-1).indices for i, logits in zip(sparse, out.router_logits)}
