"""model.dtype / generator.dtype ``auto`` (megarl/runtime/cpu_dtype.py) and `megarl eval`'s dtype rule.

auto is bf16 on CUDA and on CPUs that multiply bf16 natively (x86: avx512_bf16 or
amx_bf16; Arm: the bf16 feature), fp32 elsewhere -- on an AVX2-only CPU PyTorch
emulates bf16 matmuls several times slower than fp32. The flag reading is tested
on fake /proc/cpuinfo lines; `megarl train` resolves auto before the ranks start,
and a resumed run keeps the dtype its config.json recorded.
"""

from __future__ import annotations

import json

import pytest

from megarl.checkpointing.recorded import recorded_dtypes
from megarl.config import load_config
from megarl.errors import ConfigError
from megarl.evaluate import _run_config, dtype_rule
from megarl.loop.loop_state import checkpoint_loop_state, resume_point
from megarl.runtime.cpu_dtype import (
    cpu_bf16_native,
    read_cpu_flags,
    resolve_auto_dtypes,
    resolve_dtype,
)

TINY = "configs/tiny_cpu.yaml"
EPYC_AVX2 = "fpu vme de pse tsc msr pae mce cx8 apic sse sse2 ssse3 fma cx16 sse4_1 sse4_2 avx f16c avx2 bmi2 sha_ni"
SAPPHIRE_RAPIDS = EPYC_AVX2 + " avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8"
ZEN4 = EPYC_AVX2 + " avx512f avx512bw avx512_bf16"
SKYLAKE_AVX512 = EPYC_AVX2 + " avx512f avx512bw avx512vl"  # AVX-512 without its bf16 extension: no
GRAVITON3 = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid sve svebf16 bf16 i8mm"
GRAVITON2 = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm dcpop"
A64FX = "fp asimd evtstrm sha1 sha2 crc32 atomics fphp asimdhp cpuid sve"  # SVE without bf16


@pytest.mark.parametrize(
    "flags, machine, native",
    [
        (EPYC_AVX2, "x86_64", False),
        (SKYLAKE_AVX512, "x86_64", False),
        (ZEN4, "x86_64", True),
        (SAPPHIRE_RAPIDS, "x86_64", True),
        (EPYC_AVX2 + " amx_bf16", "x86_64", True),
        (GRAVITON3, "aarch64", True),
        (GRAVITON2, "aarch64", False),
        (A64FX, "aarch64", False),
        (GRAVITON3, "riscv64", False),  # an unknown architecture: fp32, whatever it lists
        ("", "x86_64", False),
    ],
)
def test_native_bf16_is_read_from_the_cpu_flags(flags, machine, native):
    ok, why = cpu_bf16_native(flags, machine)
    assert ok is native, why
    value, line = resolve_dtype("model.dtype", "auto", cuda=False, flags=flags, machine=machine)
    assert value == ("bf16" if native else "fp32")
    assert line.startswith(f"model.dtype: auto -> {value} (")  # the log says what and why
    if machine == "x86_64" and not native:
        assert "avx512_bf16" in line and "amx_bf16" in line
    if flags == A64FX:
        assert "sve" in why


def test_cuda_is_bf16_and_concrete_values_pass_through():
    assert resolve_dtype("generator.dtype", "auto", cuda=True, flags=EPYC_AVX2, machine="x86_64")[0] == "bf16"
    assert resolve_dtype("generator.dtype", "fp32", cuda=True) == ("fp32", None)
    assert resolve_dtype("model.dtype", "bf16", cuda=False, flags=EPYC_AVX2, machine="x86_64") == ("bf16", None)


def test_cpuinfo_flags_line_is_read(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: " + EPYC_AVX2 + "\nbugs\t\t: sysret_ss_attrs\n"
    )
    assert read_cpu_flags(str(x86)) == EPYC_AVX2
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: " + GRAVITON3 + "\nCPU implementer\t: 0x41\n")
    assert read_cpu_flags(str(arm)) == GRAVITON3
    assert read_cpu_flags(str(tmp_path / "missing")) is None


def test_config_accepts_auto_and_refuses_other_names_naming_the_field():
    cfg = load_config(TINY, ["model.dtype=auto", "generator.dtype=auto"])
    assert (cfg.model.dtype, cfg.generator.dtype) == ("auto", "auto")  # resolved by megarl train, not here
    for field in ("model.dtype", "generator.dtype"):
        with pytest.raises(ConfigError, match=rf"{field}: 'fp16' is not one of \['fp32', 'bf16', 'auto'\]"):
            load_config(TINY, [f"{field}=fp16"])
        with pytest.raises(ConfigError, match=rf"{field}: 'Auto'"):
            load_config(TINY, [f"{field}=Auto"])


def test_resolution_replaces_auto_in_place_and_logs_each_field():
    cfg = load_config(TINY, ["model.dtype=auto", "generator.dtype=bf16"])
    lines = resolve_auto_dtypes(cfg, cuda=False, flags=EPYC_AVX2, machine="x86_64")
    assert (cfg.model.dtype, cfg.generator.dtype) == ("fp32", "bf16")
    assert len(lines) == 1 and lines[0].startswith("model.dtype: auto -> fp32")
    assert cfg.to_dict()["model"]["dtype"] == "fp32"  # what RUN_DIR/config.json records
    cfg = load_config(TINY, ["model.dtype=auto", "generator.dtype=auto"])
    resolve_auto_dtypes(cfg, cuda=False, flags=SAPPHIRE_RAPIDS, machine="x86_64")
    assert (cfg.model.dtype, cfg.generator.dtype) == ("bf16", "bf16")


def test_a_resumed_run_keeps_the_dtype_it_started_in(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": {"dtype": "bf16"}, "generator": {"dtype": "fp32"}}))
    assert recorded_dtypes(run) == {}  # no checkpoint yet: a fresh run decides on this machine
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("3\n")
    assert recorded_dtypes(run) == {"model.dtype": "bf16", "generator.dtype": "fp32"}
    cfg = load_config(TINY, ["model.dtype=auto", "generator.dtype=auto"])
    lines = resolve_auto_dtypes(cfg, cuda=False, flags=EPYC_AVX2, machine="x86_64", recorded=recorded_dtypes(run))
    assert (cfg.model.dtype, cfg.generator.dtype) == ("bf16", "fp32")
    assert all("the dtype this run started in" in line for line in lines)


def test_eval_dtype_rule(tmp_path):
    run_config = {"generator": {"dtype": "bf16"}}
    assert dtype_rule(None, run_config) == ("bf16", "the run's generator.dtype")
    assert dtype_rule("fp32", run_config) == ("fp32", "--dtype")  # --dtype wins
    assert dtype_rule(None, {}) == ("fp32", "default (no run config)")  # converted / HF checkpoints
    assert dtype_rule("auto", {})[0] in ("fp32", "bf16")
    # the run config is found two levels above the iteration directory
    (tmp_path / "checkpoints" / "iter_0000002").mkdir(parents=True)
    (tmp_path / "config.json").write_text(json.dumps(run_config))
    assert _run_config(tmp_path / "checkpoints" / "iter_0000002") == run_config
    assert _run_config(tmp_path / "checkpoints") == {}


def test_time_budget_is_checked_and_its_clock_is_in_the_loop_state():
    assert load_config(TINY, ["run.time_budget_min=0.5"]).run.time_budget_min == 0.5
    for bad in ("-1", ".inf", "nan"):
        with pytest.raises(ConfigError, match="run.time_budget_min: must be a finite number of minutes >= 0"):
            load_config(TINY, [f"run.time_budget_min={bad}"])
    with pytest.raises(ConfigError, match="run.time_budget_min: expected a number"):
        load_config(TINY, ["run.time_budget_min=half an hour"])
    state = checkpoint_loop_state(4, 5, [], None, train_seconds=123.5)
    assert resume_point(state).train_seconds == 123.5
    assert resume_point({"step": 4}).train_seconds == 0.0  # checkpoints from before the budget


def test_the_planner_prices_auto_as_bf16():
    from megarl.plan.config_plan import _precision

    assert _precision("model.dtype", "auto", "") == "bf16"
    with pytest.raises(ConfigError, match="model.dtype: 'fp32'"):
        _precision("model.dtype", "fp32", "")


@pytest.mark.parametrize(
    "cap, native",
    [
        ("AVX2", False),  # how the suite runs as an AVX2-only machine would (docs/testing.md)
        ("avx512_core", False),  # AVX-512 without its bf16 kernels; oneDNN reads the value case-blind
        ("AVX512_CORE_BF16", True),
        ("AVX512_CORE_AMX", True),
        ("ALL", True),
    ],
)
def test_a_onednn_isa_cap_below_bf16_makes_auto_fp32(cap, native):
    """ONEDNN_MAX_CPU_ISA below AVX512_CORE_BF16 sends PyTorch's bf16 matmuls to its emulation
    (measured: 1.2 GFLOP/s against 790 uncapped on a Zen 4 EPYC), so auto must not pick bf16 there."""
    ok, why = cpu_bf16_native(ZEN4, "x86_64", environ={"ONEDNN_MAX_CPU_ISA": cap})
    assert ok is native, why
    if not native:
        assert f"ONEDNN_MAX_CPU_ISA={cap}" in why
    assert cpu_bf16_native(ZEN4, "x86_64", environ={"DNNL_MAX_CPU_ISA": cap})[0] is native  # oneDNN's old name
    assert cpu_bf16_native(EPYC_AVX2, "x86_64", environ={"ONEDNN_MAX_CPU_ISA": cap})[0] is False  # no flags, no bf16


def test_described_flags_ignore_this_process_cap(monkeypatch):
    """Flags passed in describe some CPU, not this process: a cap in os.environ does not apply to them,
    while the flags read from this machine do take it."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert cpu_bf16_native(ZEN4, "x86_64")[0] is True
    assert cpu_bf16_native(None, "x86_64")[0] is False  # this machine's flags, capped
