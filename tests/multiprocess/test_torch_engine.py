"""The reference torch engine on SmolLM2-135M: greedy decoding and log-probs vs transformers,
continuous batching, seeded sampling, in-flight weight updates, block fp8."""

import pytest
import torch

from tests.conftest import transformers_greedy
from tests.unit.test_torch_engine import (
    MAX_NEW,
    smol,  # noqa: F401 (fixtures: pytest finds them by name)
)


@pytest.mark.slow
def test_tensor_parallel_engine_tp3_matches_transformers(smol, smollm2_hf, tmp_path):
    import json

    from tests.conftest import run_ranks

    _, prompts, stops = smol
    (tmp_path / "prompts.json").write_text(json.dumps({"prompts": prompts, "stops": list(stops)}))
    run_ranks(
        3,
        "engine_worker.py",
        "--hf",
        smollm2_hf,
        "--prompts",
        tmp_path / "prompts.json",
        "--out",
        tmp_path / "out.json",
    )
    got = json.loads((tmp_path / "out.json").read_text())
    for i, (tokens, logp) in enumerate(transformers_greedy(smollm2_hf, prompts, MAX_NEW, stops)):
        assert got[str(i)]["tokens"] == tokens, i
        assert (torch.tensor(got[str(i)]["logprobs"]) - logp).abs().max().item() <= 1e-4
