"""`megarl bench moe-decode` on the tiny-moe preset: what it reports besides times is right -- the
loop reads one value on the host per expert per layer, the device-routed path none, whatever the
batch; the two paths' layer outputs, logits and routes are the same."""

from megarl.bench import moe_decode


def test_counts_and_equalities_of_the_tiny_moe_bench(capsys):
    result = moe_decode.run(moe_decode.MoeDecodeBench(preset="tiny-moe", layers=2, batch=(1, 6), context=8, reps=1))
    assert (result["experts"], result["top_k"]) == (4, 2)
    for batch in ("1", "6"):
        layer, step = result["layer"][batch], result["step"][batch]
        assert layer["host_reads"] == {"device_routed": 0, "loop": 4}  # a nonzero per expert
        assert layer["equal"] and step["equal_logits"] and step["equal_routes"]
        assert layer["speedup"] == layer["loop_ms"] / layer["device_routed_ms"]
    # the loop's launches grow with the experts that get tokens; the device-routed path's do not
    assert result["layer"]["1"]["aten_ops"]["loop"] < result["layer"]["6"]["aten_ops"]["loop"]
    assert result["layer"]["1"]["aten_ops"]["device_routed"] == result["layer"]["6"]["aten_ops"]["device_routed"]
    assert '"preset": "tiny-moe"' in capsys.readouterr().out
