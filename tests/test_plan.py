"""megarl.plan: LlamaRL s.7 (Theorem 7.5, memory, layout search) and PipelineRL App. A.

Pure arithmetic: no torch ranks, no GPU. The whole file runs in a few seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import random

import pytest

from megarl.errors import ConfigError
from megarl.models.presets import preset_spec
from megarl.plan import llamarl_theorem as thm
from megarl.plan.cli import add_plan_args, run_plan
from megarl.plan.costs import H100CostModel, Workload
from megarl.plan.hardware import GB, H100
from megarl.plan.inputs import FixedLayout, GeneratorLayout, LengthDistribution, PlanInputs, TrainerLayout
from megarl.plan.llamarl_model import evaluate_async, plan_from_inputs, theorem_setting
from megarl.plan.pipeline_appendix import (AppendixInputs, conventional, ideal_tokens_s, knee_lag, pipeline,
                                           speedup_curve)

PAPER_CASES = [("llama3-8b", 256), ("llama3-70b", 256), ("llama3-405b", 1024)]


def _plan(model, gpus, **kw):
    return plan_from_inputs(PlanInputs(model=model, gpus=gpus, weight_sync=kw.pop("weight_sync", "estimate"), **kw))


def _costs(model):
    return H100CostModel(preset_spec(model), H100, Workload(512, LengthDistribution()))


# -- Theorem 7.5 on its own assumptions --------------------------------------------------------


def _random_system(rng: random.Random) -> thm.AbstractSystem:
    def eta(scale):
        a, d, beta, wiggle = rng.uniform(0.2, 1.3), rng.uniform(0.5, 20), rng.uniform(0.3, 1.5), rng.uniform(0, 0.4)
        # strictly decreasing in b; any dependence on m (here not even monotone)
        return lambda m, b: scale * m ** -a * (1 + wiggle * math.sin(m)) * (1 + d / b ** beta)

    trainer_state = rng.uniform(60, 900)  # GB of weights + grads + optimizer per replica
    return thm.AbstractSystem(
        gpus=rng.choice([64, 256, 1024]), batch=rng.choice([512, 2048]), memory=80.0,
        trainer_state=trainer_state, generator_weights=trainer_state * rng.uniform(0.05, 0.4),
        activation_per_sample=rng.uniform(0.2, 3.0), kv_per_sample=rng.uniform(0.5, 4.0),
        eta_t=eta(rng.uniform(0.1, 2.0)), eta_g=eta(rng.uniform(0.5, 20.0)),
    )


def test_theorem_7_5_random_decreasing_eta():
    rng = random.Random(7)
    checked = 0
    for _ in range(40):
        s = _random_system(rng)
        sync = thm.best_sync(s)
        if sync is None:  # the trainer state fits no m of the grid
            continue
        best = thm.best_async(s)
        proof = thm.witness(s, sync)
        assert 0 < best.theta < 1
        assert best.seconds < sync.seconds * (1 - 1e-9), (s, sync, best)
        # the proof's own construction: same m and b_t, a bigger generator batch, strictly faster
        assert proof.m_t == proof.m_g == sync.m and proof.b_g > sync.b_g
        assert best.seconds <= proof.seconds < sync.seconds
        checked += 1
    assert checked >= 30


def test_theorem_needs_decreasing_eta():
    """Without the assumption (eta flat in b, perfect scaling in m) asynchrony gains nothing."""
    s = thm.AbstractSystem(gpus=256, batch=2048, memory=80.0, trainer_state=300.0, generator_weights=60.0,
                           activation_per_sample=1.0, kv_per_sample=1.0,
                           eta_t=lambda m, b: 2.0 / m, eta_g=lambda m, b: 10.0 / m)
    sync, best = thm.best_sync(s), thm.best_async(s)
    assert sync.seconds == pytest.approx(2048 / 256 * 12.0)
    assert best.seconds == pytest.approx(sync.seconds, rel=1e-12)


@pytest.mark.parametrize("model,gpus", PAPER_CASES)
def test_theorem_holds_for_default_h100_model(model, gpus):
    """Same eta_g for both (bf16, continuous batching): the discrete best async still wins."""
    r = plan_from_inputs(theorem_setting(PlanInputs(model=model, gpus=gpus, weight_sync="estimate")))
    assert r.best_sync.generator_precision == "bf16" and r.best_sync.batching == "continuous"
    assert r.best_async.step_seconds < r.best_sync.step_seconds
    assert r.speedup > 1.1


# -- memory ------------------------------------------------------------------------------------


def test_405b_trainer_at_tp1_overflows_on_weights():
    costs = _costs("llama3-405b")
    mem = costs.trainer_memory(TrainerLayout(1, 1), dp=512, batch=2048)
    assert not mem.fits and mem.overflow == "weights"
    assert mem.parts["weights"] / GB == pytest.approx(2 * costs.shape.params / 1e9)
    assert mem.parts["weights"] / GB > 800 and "weights overflows" in mem.describe()
    # a fixed layout asking for it is evaluated and flagged, not silently dropped
    fixed = FixedLayout(TrainerLayout(1, 1), GeneratorLayout(8), trainer_gpus=512)
    r = plan_from_inputs(PlanInputs(model="llama3-405b", gpus=1024, layout=fixed, weight_sync="skip"))
    assert not r.best_async.fits and r.best_async.trainer_memory.overflow == "weights"
    assert r.best_async.generator_memory.fits  # TP8 fp8: 51 GB of weights + KV


def test_memory_names_each_overflowing_part():
    costs = _costs("llama3-70b")
    # 70B at TP8 without data parallelism: the unsharded Adam state (12 B/param / 8) overflows
    mem = costs.trainer_memory(TrainerLayout(8, 1), dp=1, batch=2048)
    assert mem.overflow == "optimizer" and mem.parts["optimizer"] / GB == pytest.approx(12 * 70.55 / 8, rel=0.01)
    # selective recomputation of a 4.6k-token 405B micro-batch at TP8 x PP6 does not fit; full does
    big = _costs("llama3-405b")
    assert big.trainer_memory(TrainerLayout(8, 6, 1, "selective"), 80, 2048).overflow == "activations"
    assert big.trainer_memory(TrainerLayout(8, 6, 1, "full"), 80, 2048).fits
    # a generator asked to hold too many sequences runs out of KV cache
    small = _costs("llama3-8b")
    room = small.max_sequences(GeneratorLayout(1), "fp8", "continuous")
    assert 200 < room < 320  # (80 - 6 - 9 GB) / (2.3k tokens x 128 KiB)
    assert small.generator_memory(GeneratorLayout(1), "fp8", room, "continuous").fits
    assert small.generator_memory(GeneratorLayout(1), "fp8", room + 1, "continuous").overflow == "kv_cache"


# -- the search ------------------------------------------------------------------------------


@pytest.mark.parametrize("model,gpus", PAPER_CASES)
def test_search_layouts_respect_constraints(model, gpus):
    r = _plan(model, gpus)
    a, s, batch = r.best_async, r.best_sync, 2048
    # every GPU used, whole nodes and whole replicas, TP within a node
    assert a.trainer_gpus + a.generator_gpus == gpus
    assert a.trainer_gpus % 8 == 0 and a.generator_gpus % 8 == 0
    assert a.trainer_gpus % a.trainer.m == 0 and a.generator_gpus % a.generator.m == 0
    assert a.trainer.tp <= 8 and a.generator.tp <= 8 and s.trainer.tp <= 8
    assert s.gpus == gpus and gpus % s.trainer.m == 0
    assert a.fits and s.fits and a.sequences >= 1 and s.sequences >= 1
    # the step times are s.7's formulas
    assert a.generate_seconds == pytest.approx(batch / a.replicas * a.eta_g)
    assert a.step_seconds == pytest.approx(max(a.train_seconds, a.generate_seconds) + a.weight_sync_seconds)
    assert s.generate_seconds == pytest.approx(math.ceil(batch / (gpus / s.trainer.m)) * s.eta_g)
    assert s.train_seconds >= batch / (gpus / s.trainer.m) * s.eta_t
    assert r.speedup == pytest.approx(s.step_seconds / a.step_seconds)
    # no other split of the GPUs with these layouts is faster
    costs = _costs(model)
    for t in range(a.trainer.m * 8 // math.gcd(a.trainer.m, 8), gpus, 8):
        if t % a.trainer.m or (gpus - t) % a.generator.m:
            continue
        other = evaluate_async(costs, r.inputs, a.trainer, t, a.generator)
        assert not other.fits or other.step_seconds >= a.step_seconds - 1e-9


def test_default_predictions():
    """The default H100 model's numbers (uniform [512, 4096] responses); see the report for the paper's."""
    got = {m: _plan(m, g).speedup for m, g in PAPER_CASES}
    assert got["llama3-8b"] == pytest.approx(1.87, abs=0.05)
    assert got["llama3-70b"] == pytest.approx(1.84, abs=0.05)
    assert got["llama3-405b"] == pytest.approx(3.64, abs=0.1)
    # a long-tailed response distribution (the synchronous step waits for the longest)
    tail = LengthDistribution.truncated_exponential(2048, 16384)
    assert tail.mean == pytest.approx(2048, rel=0.01) and tail.max > 6 * tail.mean
    r = _plan("llama3-405b", 1024, lengths=tail)
    assert r.speedup == pytest.approx(10.7, rel=0.15)  # LlamaRL Table 3
    assert r.best_async.step_seconds == pytest.approx(59.5, rel=0.15)  # the paper's measured async step


def test_measured_table_replaces_eta():
    measured = {"trainer": {"8,1": 0.05, "16,1": 0.03},
                "generator": [{"tp": 4, "b": 64, "seconds_per_sample": 0.4},
                              {"tp": 4, "b": 128, "seconds_per_sample": 0.25}],
                "sync_generator": {"8,16": 1.5, "8,64": 0.9, "16,64": 0.8}}
    r = _plan("llama3-8b", 256, measured=measured)
    a, s = r.best_async, r.best_sync
    assert (a.trainer.tp, a.trainer.pp) in {(8, 1), (8, 2)} and a.generator.tp == 4
    assert a.eta_t in (0.05, 0.03)
    assert a.eta_g == (0.25 if a.sequences >= 128 else 0.4 if a.sequences >= 64 else 0.4 * 64 / a.sequences)
    # the baseline: only measured layouts, each replica holding 2048 / (256 / m) samples
    assert (s.trainer.m, s.sequences) in {(8, 64), (16, 128)}
    assert s.eta_g == {8: 0.9, 16: 0.8}[s.trainer.m]
    assert s.step_seconds == pytest.approx(2048 / (256 / s.trainer.m) * (s.eta_g + s.eta_t))
    with pytest.raises(ConfigError, match="measured.trainer"):
        _plan("llama3-8b", 256, measured={"trainer": {"eight": 1.0}})


def test_weight_sync_predictor_is_used_for_the_chosen_layout():
    pytest.importorskip("torch")
    r = _plan("llama-mini", 16, weight_sync="predict")
    a = r.best_async
    assert a.weight_sync_method == "predict" and a.weight_sync_seconds > 0
    estimate = evaluate_async(_costs("llama-mini"), r.inputs, a.trainer, a.trainer_gpus, a.generator)
    assert a.weight_sync_seconds == pytest.approx(estimate.weight_sync_seconds, rel=2.0)


def test_bad_inputs_name_the_field():
    with pytest.raises(ConfigError, match="gpus=12"):
        _plan("llama3-8b", 12)
    with pytest.raises(ConfigError, match="generator_precision"):
        _plan("llama3-8b", 256, generator_precision="int3")
    with pytest.raises(ConfigError, match="response_tokens_min"):
        LengthDistribution.uniform(4096, 512)
    with pytest.raises(ConfigError, match="trainer_gpus"):
        plan_from_inputs(PlanInputs(layout=FixedLayout(TrainerLayout(8, 1), GeneratorLayout(8), 256)))


# -- PipelineRL Appendix A ---------------------------------------------------------------------


def test_pipeline_appendix_case_study():
    a = AppendixInputs()  # N = B = 128, uniform lengths, H100 roofline
    u_max, tau, h_sat = a.u(1e9), a.tau, a.saturation
    assert h_sat == pytest.approx(221.4, abs=0.1) and u_max / tau == pytest.approx(4.5)
    # conventional RL in the memory-bound regime has a closed form: the drain costs Lmax h_sat / U_max
    c = conventional(a, 64)
    assert c.inflight == 65 and c.generate_seconds == pytest.approx(8192 * h_sat / u_max, rel=1e-3)
    assert c.tokens_s == pytest.approx(128 * 65 * 4096.5 / (8192 * h_sat / u_max + 65 * 4096.5 / tau), rel=1e-3)
    rows = {row.g_max: row for row in speedup_curve(a, [1, 64, 133, 1000])}
    for row in rows.values():
        assert row.pipeline.lag <= row.g_max + 1e-9
    assert rows[1].speedup < 1  # at lag ~0 only the conventional loop can stay on-policy
    assert rows[133].speedup == pytest.approx(1.409, abs=0.005)
    assert rows[133].speedup == pytest.approx(1.57, rel=0.15)  # the paper's case study
    assert rows[1000].speedup == pytest.approx(1.0, abs=0.01)  # with enough lag both reach the ideal
    knee = knee_lag(a)
    assert knee == 80
    assert pipeline(a, knee).tokens_s >= 0.99 * ideal_tokens_s(a)
    assert pipeline(a, knee).tokens_s / conventional(a, knee).tokens_s == pytest.approx(1.80, abs=0.01)


# -- the command line ---------------------------------------------------------------------------


def _args(*argv):
    parser = argparse.ArgumentParser()
    add_plan_args(parser)
    return parser.parse_args(list(argv))


def test_cli_json_line(capsys):
    result = run_plan(_args("--model", "llama3-70b", "--gpus", "256", "--batch", "2048", "--weight-sync", "estimate",
                            "--json"))
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and json.loads(out[0]) == json.loads(json.dumps(result))
    assert result["speedup"] == pytest.approx(_plan("llama3-70b", 256).speedup, abs=1e-3)
    assert result["asynchronous"]["memory"]["trainer"]["fits"] is True
    run_plan(_args("--pipeline-appendix", "--lags", "133"))
    text = capsys.readouterr().out
    assert "1.41x" in text and "g_max = 80" in text
    with pytest.raises(ConfigError, match="--hardware"):
        run_plan(_args("--hardware", "warp_speed=9"))
