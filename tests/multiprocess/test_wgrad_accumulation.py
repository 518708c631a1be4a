"""On CPU, weight gradients accumulate into main_grad (megatron_patches/cpu_wgrad_accumulation.py) and
DDP's one-rank collectives are skipped (megatron_patches/single_rank_grad_sync.py): the gradients
equal those of Megatron's own unfused path and gloo reduce-scatter, for tied and untied embeddings,
in fp32 and bf16, accumulated over three packed micro-batches."""

import json
import sys

from tests.conftest import WORKERS, run_command


def test_fused_accumulation_gives_megatrons_gradients_without_dense_embedding_grads_or_collectives():
    proc = run_command([sys.executable, WORKERS / "wgrad_accumulation_checks.py"])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(out) == ["tied_bf16", "tied_fp32", "untied_bf16", "untied_fp32"]
    # trainer.gradient_accumulation_fusion: false: Megatron's unfused path (a dense embedding gradient per
    # micro-batch), the same gradients
    off = out["tied_fp32"].pop("fusion_off")
    assert off["dense_embedding_backward"] == 3 and off["max_relative_diff"] <= 1e-6, off
    for case, got in out.items():
        assert got["zero_grads"] == [], case  # every gradient is there to compare
        # fp32: the same sums in another order; bf16: Megatron's unfused path rounds the embedding's
        # rows (and, tied, their sum with the output layer's gradient) to bf16 before adding them in
        # fp32 -- 2^-9 relative per rounding. A dropped or doubled contribution would show as ~1.
        tol = 1e-6 if case.endswith("fp32") else 1e-2
        worst = max(got["relative_diff"].items(), key=lambda kv: kv[1])
        assert worst[1] <= tol, (case, worst)
        # Megatron's path built a dense [vocab, hidden] embedding gradient per micro-batch; megarl's none
        assert got["dense_embedding_backward"][0] == 3 and got["dense_embedding_backward"][1] == 0, case
        # gloo's reduce-scatter over the one DP rank ran for Megatron's sync only; both left the grads as they were
        assert got["reduce_scatter"][0] >= 1 and got["reduce_scatter"][1] == 0, case
        assert got["sync_changed"] == [False, False], case
    # the tied embedding's gradient has two parts: both arrived (untied, the output layer has its own)
    assert "embedding.word_embeddings.weight" in out["tied_fp32"]["relative_diff"]
    assert "output_layer.weight" in out["untied_fp32"]["relative_diff"]
