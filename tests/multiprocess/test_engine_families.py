"""The torch engine on Qwen2, Qwen3 and Qwen3-MoE tensor-parallel over two ranks (the MoE models also
with SGLang's --ep-size 2 inside TP: one expert half per rank, moe_tp 1): greedy tokens equal
transformers', and the routed experts every rank returns equal transformers' router top-k."""

import json

import pytest
import torch

from tests.conftest import run_ranks
from tests.engine_families import MAX_NEW, build, prompts, reference, reference_routes

pytestmark = pytest.mark.slow

CASES = [("qwen2", 1), ("qwen3", 1), ("qwen3_moe", 1), ("qwen3_moe", 2), ("qwen3_moe_renormalised", 2)]


@pytest.mark.parametrize("name,ep", CASES, ids=[f"{n}-tp2-ep{e}" for n, e in CASES])
def test_tp2_engine_matches_transformers(name, ep, tmp_path):
    model = build(name, tmp_path)
    (tmp_path / "prompts.json").write_text(json.dumps({"prompts": prompts(), "stops": []}))
    out = tmp_path / "out.json"
    run_ranks(
        2,
        "engine_worker.py",
        "--hf",
        model,
        "--prompts",
        tmp_path / "prompts.json",
        "--out",
        out,
        "--max-new-tokens",
        MAX_NEW,
        "--ep",
        ep,
    )
    got = json.loads(out.read_text())
    for i, (tokens, logp) in enumerate(reference(model, prompts())):
        assert got[str(i)]["tokens"] == tokens, i
        assert (torch.tensor(got[str(i)]["logprobs"]) - logp).abs().max().item() <= 1e-4, i
        if name.startswith("qwen3_moe"):
            routes = torch.tensor(got[str(i)]["routes"])
            for layer, want in reference_routes(model, prompts()[i] + tokens).items():
                assert torch.equal(routes[:, layer].sort(-1).values, want.sort(-1).values), (i, layer)
        else:
            assert got[str(i)]["routes"] is None
