"""`megarl bench weight-sync`, measured on the tiny model: both paths must leave the same generator
weights, and the bytes each moves are counted here from the model's shapes and the two layouts
(Megatron's and SGLang's sharding rules written out), not read from the benchmark's counters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megarl.bench.weight_sync import WeightSyncBench, different_weights, run
from megarl.errors import ConfigError, MegarlError
from megarl.weight_sync import fp8 as fp8_format


def test_different_weights_quantises_a_bf16_baseline_and_names_what_differs():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(48, 64, generator=g) * 0.02).to(torch.bfloat16)
    norm = torch.randn(64, generator=g).to(torch.bfloat16)
    q, scale_inv = fp8_format.quantize(w)
    ours = {"qkv_proj.weight": q, "qkv_proj.weight_scale_inv": scale_inv, "norm.weight": norm.clone()}
    assert different_weights(ours, {"qkv_proj.weight": w.clone(), "norm.weight": norm.clone()}) == []
    nudged = w.clone()
    nudged[3, 5] += 0.01
    assert different_weights(ours, {"qkv_proj.weight": nudged, "norm.weight": norm.clone()}) == ["qkv_proj.weight"]
    off = dict(ours, **{"qkv_proj.weight_scale_inv": scale_inv * 2})
    assert different_weights(off, {"qkv_proj.weight": w.clone(), "norm.weight": norm}) == ["qkv_proj.weight_scale_inv"]
    assert different_weights(ours, {"qkv_proj.weight": w.clone()}) == ["norm.weight"]  # one side lacks it


def test_the_run_fails_without_a_speedup_when_the_weights_differ(monkeypatch, capsys):
    """The benchmark's own logic around the two worlds (stand-ins writing what the ranks write)."""
    import megarl.bench.weight_sync as weight_sync_bench

    def fake_worlds(worlds):
        out = Path(worlds[0][2][2])
        base = {"gathered_bytes": 0, "all_gathers": 0, "received_bytes": 0, "broadcasts": 1}
        trainer = {"seconds": [1.0], "baseline_seconds": [2.0], "wire_messages": 1, "pairs": 1, "baseline": base}
        (out / "trainer0.json").write_text(json.dumps(trainer))
        for r in range(2):
            gen = {"received": 8, "wire_messages": 1, "pairs": 1, "baseline": base}
            gen["different_weights"] = ["model.layers.0.mlp.down_proj.weight"] if r == 1 else []
            (out / f"generator{r}.json").write_text(json.dumps(gen))

    monkeypatch.setattr(weight_sync_bench, "run_worlds", fake_worlds)  # as the bench bound it
    with pytest.raises(MegarlError, match=r"generator rank\(s\) \[1\].*down_proj.*no speed-up"):
        run(WeightSyncBench(model="tiny", src_tp=1, dst_tp=1, dst_replicas=2, iters=1))
    assert "speedup" not in capsys.readouterr().out


def test_layout_flags_are_named_in_errors():
    with pytest.raises(ConfigError, match="--src-tp: must be an integer >= 1"):
        run(WeightSyncBench(model="tiny", src_tp=0))
    with pytest.raises(ConfigError, match="--dst-replicas: must be an integer >= 1"):
        run(WeightSyncBench(model="tiny", dst_replicas=0))
