"""Fused vocab-parallel log-probs and entropy vs log_softmax over the full vocabulary."""

import torch

from tests.conftest import run_ranks
from tests.unit.test_logprobs import make_case, reference


def test_tp2_matches_log_softmax(tmp_path):
    case = make_case(2)
    torch.save(case, tmp_path / "case.pt")
    run_ranks(2, "logprobs_worker.py", "--case", tmp_path / "case.pt", "--out", tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    ref_logp, ref_entropy, ref_grad = reference(case)
    for r in ranks:
        assert (r["logp"].double() - ref_logp).abs().max() <= 1e-6
        assert (r["entropy"].double() - ref_entropy).abs().max() <= 1e-6
    grad = torch.cat([r["grad"] for r in ranks], dim=-1)
    assert (grad.double() - ref_grad).abs().max() <= 1e-6
