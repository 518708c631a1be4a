"""Megatron-Core's MoE layers on CPU at expert parallelism 2 (megatron_patches/moe_cpu.py)."""

import json

from tests.conftest import run_ranks


def test_alltoall_dispatcher_equals_allgather_and_router_equals_torch(tmp_path):
    """The alltoall dispatcher (its split sizes made numbers by the patch) gives the allgather
    dispatcher's outputs and gradients on the same weights and tokens, at EP2 with different tokens
    per rank; the router's gating linear (the branch the te_general_gemm fix selects) equals x @ w.T."""
    run_ranks(2, "moe_dispatch_worker.py", "--out", tmp_path)
    for rank in (0, 1):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["have_te"] is False and r["megatron_returns_tensor_splits"] is True  # both fixes needed here
        assert r["output_max"] > 0.1
        assert r["output_max_diff"] <= 1e-5 * r["output_max"], r
        assert r["grad_max_diff"] <= 1e-6, r
        assert len(r["expert_grads"]) == 8, r  # 2 layers x 2 local experts x (fc1, fc2), all with gradients
        assert r["router_logits_diff"] == 0.0 and r["router_grad_diff"] <= 1e-6, r
