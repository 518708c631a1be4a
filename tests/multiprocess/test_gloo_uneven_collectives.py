"""Megatron's uneven first-dimension all-gather (megatron_patches/gloo_uneven_collectives.py) and
reduce-scatter (Megatron's own) on gloo, against results computed without collectives."""

import json

from tests.conftest import run_ranks


def test_uneven_gather_and_reduce_scatter_equal_the_reference_where_megatrons_own_fail(tmp_path):
    """Rank r holds r + 1 rows (and, second, a rank with none): the gathered rows, the reduce-scattered
    sums and the gather's gradient (a reduce-scatter of the same splits) are exact; Megatron's own
    gather raises on gloo, which is why the patch exists (when it stops raising, delete the patch)."""
    run_ranks(3, "uneven_collectives_worker.py", "--out", tmp_path)
    for rank in range(3):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["gather_uneven_shape"] == [6, 5] and r["gather_with_empty_shape"] == [4, 5], r
        assert r["reduce_scatter_uneven_shape"] == [rank + 1, 5], r
        assert r["reduce_scatter_with_empty_shape"] == [0 if rank == 0 else 2, 5], r
        for label in ("uneven", "with_empty"):
            assert r[f"gather_{label}_diff"] == 0.0, r
            assert r[f"reduce_scatter_{label}_diff"] == 0.0, r
            assert r[f"gather_grad_{label}_diff"] == 0.0, r
        assert "invalid tensor size" in r["megatron_gather_error"], r
