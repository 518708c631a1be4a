"""`megarl bench machine` and megarl/bench/roofline.py against independent arithmetic, on tiny shapes."""

import json
import math
import types

import pytest
import torch
import torch.nn.functional as F

from megarl.bench import machine
from megarl.bench import roofline as rl
from megarl.models.presets import preset_spec

TINY = preset_spec("tiny")  # hidden 64, ffn 96, 4 layers, 4 heads / 2 KV heads, head_dim 16, vocab 300, untied


SMALL = machine.MachineBench(
    decode_rows=4, train_rows=32, context=16, train_row_tokens=16, min_time=0.005, train_max_out=64
)


def fake_clock(step: float = 1e-3):
    """A time module whose perf_counter advances ``step`` seconds per call: every timed call takes ``step``."""
    ticks = iter(range(10**9))
    return types.SimpleNamespace(perf_counter=lambda: next(ticks) * step)


def tiny_matmul_params_by_hand():
    # per layer: q 64x64, k and v 2 heads x 16 = 32 rows each, o 64x64, gate + up + down 3 x 64 x 96
    per_layer = 64 * 64 + 2 * (64 * 32) + 64 * 64 + 3 * 64 * 96
    return 4 * per_layer + 300 * 64  # + the head (a matmul; the input embedding is a lookup)


def test_parameter_counts_by_hand():
    assert rl.matmul_params(TINY) == tiny_matmul_params_by_hand()
    # the same from ModelSpec's full count: less the norms (2 per layer + final) and the input embedding
    assert rl.matmul_params(TINY) == TINY.num_parameters() - (2 * 4 + 1) * 64 - 300 * 64
    smol = machine.demo_spec()
    # SmolLM2-135M: 30 x (576 x 960 + 576 x 576 + 576 x 3072 + 1536 x 576) + 49152 x 576 (tied head)
    assert rl.matmul_params(smol) == 30 * (552960 + 331776 + 1769472 + 884736) + 28311552 == 134479872


@pytest.mark.parametrize("path", rl.PATHS)
def test_gemm_flop_count_is_2mkn_per_call(monkeypatch, path):
    monkeypatch.setattr(rl, "time", fake_clock(1e-3))
    rate = rl.gemm_gflops(path, rows=3, k=8, n=5, min_time=0.0035)
    assert rate == pytest.approx(2 * 3 * 8 * 5 / 1e-3 / 1e9, rel=1e-9)


def test_onednn_path_computes_the_linear():
    x, w = torch.randn(4, 24), torch.randn(40, 24)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 4)
    out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_decode_attention_forms_compute_the_same_product():
    # the roofline takes the faster form; both must be the one product, against a float64 softmax
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 1, 16, generator=g)
    k, v = torch.randn(3, 2, 10, 16, generator=g), torch.randn(3, 2, 10, 16, generator=g)
    kk, vv = k.double().repeat_interleave(2, dim=1), v.double().repeat_interleave(2, dim=1)  # query head h -> h // 2
    want = torch.softmax(q.double() @ kk.transpose(-1, -2) / 4.0, -1) @ vv
    forms = rl.decode_attention_forms(TINY, q, k, v)
    from megarl.generator.torch_engine import native

    assert set(forms) == {"sdpa_gqa", "engine_grouped"} | ({"engine_native"} if native.load() else set())
    for name, form in forms.items():
        torch.testing.assert_close(form().double(), want, rtol=1e-5, atol=1e-6, msg=name)


def test_decode_and_train_roofline_by_hand():
    rates = {"qkv": 11.0, "o": 13.0, "gate_up": 17.0, "down": 19.0, "lm_head": 23.0}
    batch, ctx, bw, att = 8, 20, 0.001, 5.0  # a tiny bandwidth: memory-bound
    shapes = {
        "qkv": (64, 128, 4),
        "o": (64, 64, 4),
        "gate_up": (64, 192, 4),
        "down": (96, 64, 4),
        "lm_head": (64, 300, 1),
    }
    compute = sum(c * 2 * batch * k * n / (rates[name] * 1e9) for name, (k, n, c) in shapes.items())
    compute += 4 * 4 * 4 * 16 * ctx * batch / (att * 1e9)
    memory = (tiny_matmul_params_by_hand() * 4 + 2 * 4 * 2 * 16 * ctx * batch * 4) / (bw * 1e9)
    got = rl.decode_from_rates(TINY, rates, att, bw, "fp32", batch, ctx)
    assert got["bound"] == "memory" and memory > compute
    assert got["tokens_per_s"] == pytest.approx(batch / memory, rel=1e-12)
    got = rl.decode_from_rates(TINY, rates, att, 1e6, "bf16", batch, ctx)
    assert got["bound"] == "compute"
    assert got["tokens_per_s"] == pytest.approx(batch / compute, rel=1e-12)
    train = sum(c * 6 * k * n / (rates[name] * 1e9) for name, (k, n, c) in shapes.items())
    train += 3 * 4 * 4 * 4 * 16 * (16 * 17 / 2) / 16 / (att * 1e9)
    assert rl.train_from_rates(TINY, rates, att, 16)["tokens_per_s"] == pytest.approx(1 / train, rel=1e-12)


def test_measured_json_matches_its_own_rates(capsys):
    result = machine.run(SMALL, spec=TINY, model="tiny")
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["roofline"] == json.loads(json.dumps(result["roofline"])) and line["model"] == "tiny"
    threads = str(torch.get_num_threads())
    assert set(line["gemm_gflops"]) == set(rl.PATHS) and set(line["bandwidth_gb_s"]) == {"1", threads}
    mp = tiny_matmul_params_by_hand()
    shapes = {
        "qkv": (64, 128, 4),
        "o": (64, 64, 4),
        "gate_up": (64, 192, 4),
        "down": (96, 64, 4),
        "lm_head": (64, 300, 1),
    }
    for path in rl.PATHS:
        elem = 2 if path == "bf16" else 4
        dtype = "bf16" if path == "bf16" else "fp32"
        rates = line["gemm_gflops"][path][threads]["decode"]
        assert all(r > 0 and math.isfinite(r) for r in rates.values())
        att = line["attention_gflops"][dtype][threads]["decode"]
        compute = sum(c * 2 * 4 * k * n / (rates[name] * 1e9) for name, (k, n, c) in shapes.items())
        compute += 4 * 4 * 4 * 16 * 16 * 4 / (att * 1e9)
        memory = (mp * elem + 2 * 4 * 2 * 16 * 16 * 4 * elem) / (line["bandwidth_gb_s"][threads] * 1e9)
        assert line["roofline"][path]["decode"]["tokens_per_s"] == pytest.approx(4 / max(compute, memory))
        trates = line["gemm_gflops"][path][threads]["train"]
        tatt = line["attention_gflops"][dtype][threads]["train"]
        train = sum(c * 6 * k * n / (trates[name] * 1e9) for name, (k, n, c) in shapes.items())
        train += 3 * 4 * 4 * 4 * 16 * (16 * 17 / 2) / 16 / (tatt * 1e9)
        assert line["roofline"][path]["train"]["tokens_per_s"] == pytest.approx(1 / train)
    for phase in ("decode", "train"):
        best = max(rl.PATHS, key=lambda p: line["roofline"][p][phase]["tokens_per_s"])
        assert line["fastest"][phase]["path"] == best


def test_cpu_flags_read_from_cpuinfo(tmp_path):
    fake = tmp_path / "cpuinfo"
    fake.write_text("model name\t: Test CPU\nflags\t\t: fpu avx2 fma avx512f amx_bf16\n")
    flags = machine.cpu_flags(str(fake))
    assert flags["model_name"] == "Test CPU"
    assert (flags["avx2"], flags["fma"], flags["avx512f"], flags["amx_bf16"]) == (True, True, True, True)
    assert (flags["avx512_bf16"], flags["amx_tile"]) == (False, False)


def test_roofline_functions_for_other_benchmarks():
    dec = rl.decode_roofline(TINY, "fp32", batch=4, context=16, min_time=0.005)
    assert dec["path"] in ("fp32-mkl", "fp32-onednn")
    assert dec["tokens_per_s"] == max(dec["tokens_per_s_by_path"].values())
    tr = rl.train_roofline(TINY, "bf16", tokens_per_row=16, train_rows=32, min_time=0.005)
    assert tr["path"] == "bf16" and tr["tokens_per_s"] == tr["tokens_per_s_by_path"]["bf16"] > 0
