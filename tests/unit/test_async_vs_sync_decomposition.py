"""`megarl bench async-vs-sync`'s decomposition check: measured per-sample times through the planner.

A decomposition, not a prediction: the per-sample times come from the runs whose steps they are
composed into. Every expected number below is worked out by hand from the per-step times the
test gives (LlamaRL s.7: T_sync = B/(N/m) (eta_g + eta_t), T_async = max(B/dp eta_t,
B/r eta_g) + weight sync); the code under test goes through the planner's measured tables and
evaluate_async / evaluate_sync.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megarl.errors import ConfigError
from megarl.models.presets import preset_spec
from megarl.parallel_dims import GeneratorDims, ParallelDims
from megarl.plan.measured_ratio import BenchLayouts, ReplicaBatchCosts, decompose, steady_records

APPROX = dict(rel=1e-9)


def _rec(step, train, gen, reward=0.0, sync=0.0, wall=None, samples=8):
    wall = wall if wall is not None else train + sync
    return {
        "step": step,
        "samples": samples,
        "time_train": train,
        "time_generate": gen,
        "time_reward": reward,
        "time_weight_sync": sync,
        "time_step": wall,
        "idle_trainer": wall - train - sync,
    }


# tiny_cpu at trainer.tp=1: 1 trainer rank + 1 generator rank (async), 2 ranks of DP2 (sync), B = 4 x 2
TWO_RANKS = BenchLayouts(
    ranks=2,
    prompts=4,
    samples_per_prompt=2,
    trainer=ParallelDims(tp=1, pp=1, dp=1),
    generator=GeneratorDims(tp=1, replicas=1),
    sync=ParallelDims(tp=1, pp=1, dp=2),
    max_running=8,
    generate_while_waiting=False,
)


ASYNC_4 = [
    _rec(1, 5.0, 3.0, 0.9, 0.02, wall=5.5),  # warm-up: left out
    _rec(2, 1.00, 0.50, 0.06, 0.02, wall=1.05),
    _rec(3, 1.08, 0.54, 0.06, 0.02, wall=1.13),
    _rec(4, 0.90, 0.0, 0.0, 0.0, wall=0.90),
]  # the drain: nothing generated, left out


SYNC_4 = [
    _rec(1, 3.0, 0.9, 1.0, 0.01, wall=5.0, samples=8),  # warm-up: left out
    _rec(2, 0.70, 0.38, 0.02, 0.01, wall=1.15),
    _rec(3, 0.72, 0.40, 0.02, 0.01, wall=1.17),
    _rec(4, 0.68, 0.42, 0.02, 0.01, wall=1.13),
]


def test_steady_steps_leave_out_warm_up_and_drain():
    assert [r["step"] for r in steady_records(ASYNC_4, "async")] == [2, 3]
    assert [r["step"] for r in steady_records(SYNC_4, "sync")] == [2, 3, 4]
    # too short to leave anything out but the drain
    assert [r["step"] for r in steady_records(ASYNC_4[2:], "async")] == [3]
    assert [r["step"] for r in steady_records(SYNC_4[:1], "sync")] == [1]


def test_two_ranks_hand_computed():
    p = decompose(TWO_RANKS, ASYNC_4, SYNC_4, preset_spec("tiny"), prompt_tokens=128, max_new_tokens=16)
    a, s = p.async_candidate, p.sync_candidate
    # async, steps 2-3: train 1.04 s for 8 samples on one replica; generate 0.52 + reward 0.06 for 8
    assert a.eta_t == pytest.approx(1.04 / 8, **APPROX)
    assert a.eta_g == pytest.approx(0.58 / 8, **APPROX)
    assert a.train_seconds == pytest.approx(1.04, **APPROX)
    assert a.generate_seconds == pytest.approx(0.58, **APPROX)
    assert a.step_seconds == pytest.approx(1.04 + 0.02, **APPROX)  # max(train, generate) + weight sync
    # sync, steps 2-4: each of 2 replicas trains 4 samples in 0.70 s, generates them in 0.40 + 0.02
    assert s.eta_t == pytest.approx(0.175, **APPROX)
    assert s.eta_g == pytest.approx(0.105, **APPROX)
    assert s.step_seconds == pytest.approx(4 * (0.105 + 0.175), **APPROX)  # generate, then train: 1.12
    assert p.composed_ratio == pytest.approx(1.12 / 1.06, **APPROX)
    # measured: 8 samples per 1.09 s (async steps 2-3) vs 8 per 1.15 s (sync steps 2-4)
    assert p.measured_ratio == pytest.approx(1.15 / 1.09, **APPROX)
    out = p.to_dict()
    assert out["composed_ratio"] == pytest.approx(1.0566, abs=1e-4)
    assert not any("pred" in k for k in out) and not any("pred" in k for m in ("async", "sync") for k in out[m])
    assert out["async"]["bottleneck"] == "trainer" and out["async"]["steady_steps"] == [2, 3]
    assert out["sync"]["b_t"] == 4 and out["async"]["b_t"] == 8
    assert out["sync"]["unpriced_copy_s"] == pytest.approx(0.01)


def test_generate_while_waiting_hides_the_generators_work_not_the_step():
    """Decoding ahead, the generator's time per step grows to the trainer's: eta_g is then an upper
    bound, the async step (max) is unchanged, and the trainer, never waiting, is the bottleneck."""
    from dataclasses import replace

    ahead = [dict(r, time_generate=r["time_train"] - r["time_reward"]) if r["time_generate"] else r for r in ASYNC_4]
    p = decompose(replace(TWO_RANKS, generate_while_waiting=True), ahead, SYNC_4, preset_spec("tiny"), 128, 16)
    assert p.async_candidate.generate_seconds == pytest.approx(1.04, **APPROX)  # = the trainer's step
    assert p.async_candidate.step_seconds == pytest.approx(1.06, **APPROX)  # as with the generator's own 0.58
    out = p.to_dict()
    assert out["async"]["bottleneck"] == "trainer" and out["async"]["eta_g_is"].startswith("at most")


def test_generator_bound_with_tp_and_replicas_hand_computed():
    # async: trainer TP2 (2 ranks, DP1) + 2 generator replicas of TP1; sync: TP2 x DP2; B = 4 x 3 = 12
    layouts = BenchLayouts(
        ranks=4,
        prompts=4,
        samples_per_prompt=3,
        trainer=ParallelDims(tp=2, dp=1),
        generator=GeneratorDims(tp=1, replicas=2),
        sync=ParallelDims(tp=2, dp=2),
        max_running=6,
    )
    async_recs = [_rec(i, 0.6, 1.1, 0.1, 0.05, wall=1.3, samples=12) for i in (1, 2, 3)] + [
        _rec(4, 0.6, 0.0, wall=0.6, samples=12)
    ]
    sync_recs = [_rec(i, 0.45, 0.75, 0.03, 0.01, wall=1.27, samples=12) for i in (1, 2, 3, 4)]
    p = decompose(layouts, async_recs, sync_recs, preset_spec("tiny"), prompt_tokens=64, max_new_tokens=32)
    a, s = p.async_candidate, p.sync_candidate
    assert a.eta_t == pytest.approx(0.6 / 12, **APPROX)  # one trainer replica, all 12 samples
    assert a.eta_g == pytest.approx(1.2 / 6, **APPROX)  # each generator replica makes 6
    assert a.sequences == 6
    # the generator is the bottleneck: max(12 x 0.05, 6 x 0.2) + 0.05
    assert a.step_seconds == pytest.approx(1.25, **APPROX)
    assert s.eta_t == pytest.approx(0.45 / 6, **APPROX) and s.eta_g == pytest.approx(0.78 / 6, **APPROX)
    assert s.step_seconds == pytest.approx(6 * (0.13 + 0.075), **APPROX)  # 1.23
    assert p.composed_ratio == pytest.approx(1.23 / 1.25, **APPROX)
    assert p.measured_ratio == pytest.approx(1.27 / 1.3, **APPROX)
    out = p.to_dict()
    assert out["async"]["bottleneck"] == "generator"  # the trainer waited 0.65 s of each 1.3 s step
    assert out["async"]["eta_g_is"].startswith("at most")  # generate_while_waiting (the default) is on


def test_trainer_time_is_looked_up_at_the_replica_batch():
    from megarl.plan.inputs import TrainerLayout
    from megarl.plan.llamarl_model import build_costs
    from megarl.plan.measured_ratio import plan_inputs

    def at_dp(dp):
        return TrainerLayout(ParallelDims(tp=1, pp=1, dp=dp), 1, "none")

    inputs = plan_inputs(TWO_RANKS, preset_spec("tiny"), 128, 16)
    costs = ReplicaBatchCosts(
        build_costs(inputs),
        {
            "trainer": [
                {"tp": 1, "pp": 1, "samples_per_replica": 8, "recompute": "none", "seconds_per_sample": 0.13},
                {"tp": 1, "pp": 1, "samples_per_replica": 4, "recompute": "none", "seconds_per_sample": 0.175},
            ]
        },
    )
    assert costs.trainer_seconds_per_sample(at_dp(1), 8) == 0.13
    assert costs.trainer_seconds_per_sample(at_dp(2), 8) == 0.175
    assert costs.trainer_step_overhead(at_dp(2)) == 0.0
    with pytest.raises(ConfigError, match="3 samples per replica"):
        costs.trainer_seconds_per_sample(at_dp(3), 8)


def test_layouts_must_add_up():
    from dataclasses import replace

    def layouts(sync):
        return BenchLayouts(
            ranks=2,
            prompts=4,
            samples_per_prompt=2,
            trainer=ParallelDims(),
            generator=GeneratorDims(),
            sync=sync,
            max_running=8,
        )

    with pytest.raises(ConfigError, match="sync: TP1 x PP1 x DP3 = 3 ranks != 2"):
        layouts(ParallelDims(dp=3)).check()
    with pytest.raises(ConfigError, match="sync: TP2 x PP1 x DP1 must run the async trainer's"):
        layouts(ParallelDims(tp=2)).check()
    with pytest.raises(ConfigError, match="async: trainer"):
        replace(layouts(ParallelDims(dp=2)), generator=GeneratorDims(replicas=2)).check()


def test_bench_prints_both_ratios_and_the_decomposition(tmp_path, monkeypatch, capsys):
    """The bench's own logic around two (stand-in) runs: workdir replaced, each run's thread split
    its own, one JSON line with the measured ratios and the planner's composition of their phases."""
    from megarl.bench import async_vs_sync
    from megarl.model_source import PreparedModel

    seen = {}

    def fake_train(config, overrides, prepare_only=False):
        opts = dict(o.split("=", 1) for o in overrides)
        mode, out = opts["run.mode"], Path(opts["run.output_dir"])
        seen[mode] = (opts, os.environ.get("OMP_NUM_THREADS"), sorted(p.name for p in out.parent.glob(f"{mode}/*")))
        os.environ.setdefault("OMP_NUM_THREADS", "7")  # as runtime/launch.py does for its world
        out.mkdir(parents=True)
        records = ASYNC_4 if mode == "async" else SYNC_4
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        wall = sum(r["time_step"] for r in records) + (1.0 if mode == "async" else 0.0)
        return {"samples": 32, "wall_s": wall, "samples_per_s": 32 / wall}

    # the names as the bench module bound them at its import
    monkeypatch.setattr(async_vs_sync, "train", fake_train)
    monkeypatch.setattr(
        async_vs_sync,
        "prepare_model",
        lambda model_cfg: PreparedModel(None, "none", preset_spec("tiny").to_dict()),
    )
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    (tmp_path / "async").mkdir()
    (tmp_path / "async" / "stale").write_text("a previous bench's run")
    result = async_vs_sync.run(
        "configs/tiny_cpu.yaml",
        ["trainer.tp=1", "run.steps=4", "generator.generate_while_waiting=false"],
        str(tmp_path),
    )
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == json.loads(json.dumps(result))
    assert seen["async"][2] == []  # the stale run was removed before the new one
    assert seen["sync"][1] is None  # the async run's OMP_NUM_THREADS did not carry over
    assert seen["sync"][0]["trainer.dp"] == "2" and seen["sync"][0]["trainer.cpu_threads"] == "0"
    assert printed["measured_ratio"] == pytest.approx(1.15 / 1.09, abs=1e-4)
    assert printed["composed_ratio"] == pytest.approx(1.12 / 1.06, abs=1e-4)
    assert not any("pred" in k for k in printed)  # a decomposition check, named as one
    wall_async, wall_sync = 5.5 + 1.05 + 1.13 + 0.9 + 1.0, 5.0 + 1.15 + 1.17 + 1.13
    assert printed["ratio_async_over_sync"] == pytest.approx(wall_sync / wall_async, rel=1e-9)
    dec = printed["decomposition"]
    assert dec["kind"].startswith("decomposition check")
    assert dec["devices"] == 2 and dec["threads"]["sync_rank"] >= 1
    assert dec["tables"]["sync_generator"][0]["b"] == 4
    assert json.loads((tmp_path / "decomposition.json").read_text())["composed_ratio"] == printed["composed_ratio"]
