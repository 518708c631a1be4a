"""`megarl bench machine` and megarl/bench/roofline.py against independent arithmetic, on tiny shapes."""

import pytest

from megarl.bench import roofline as rl
from tests.unit.test_bench_machine import TINY, fake_clock


def test_attention_and_bandwidth_counts(monkeypatch):
    # decode: QK^T + PV = 2 x 2 x head_dim FLOPs per (head, key), all layers
    assert rl.decode_attention_flops(TINY, batch=3, context=10) == 4 * 4 * 4 * 16 * 10 * 3
    pairs = sum(t + 1 for t in range(12))  # causal: token t sees t + 1 keys
    assert rl.causal_attention_flops(TINY, rows=2, row_tokens=12) == 4 * 4 * 4 * 16 * pairs * 2
    monkeypatch.setattr(rl, "time", fake_clock(1e-3))
    assert rl.attention_gflops(TINY, "fp32", 2, 1, 10, False, min_time=0.002) == pytest.approx(
        4 * 2 * 4 * 16 * 10 / 1e-3 / 1e9
    )
    assert rl.attention_gflops(TINY, "fp32", 1, 6, 6, True, min_time=0.002) == pytest.approx(
        4 * 4 * 16 * 21 / 1e-3 / 1e9
    )
    assert rl.bandwidth_gb_s(megabytes=8, repeats=2) == pytest.approx(8 * 2**20 / 1e-3 / 1e9)
