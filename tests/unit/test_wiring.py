"""The wiring's decisions from run.mode and generator.backend (loop/wiring.py), without starting a rank."""

import pytest

from megarl.config import load_config
from megarl.loop.schedule import AsyncSchedule, SyncSchedule
from megarl.loop.wiring import collective_timeout_s, lag_bound, schedule, topology

TINY = "configs/tiny_cpu.yaml"


def test_async_torch_engines_are_ranks_of_their_own():
    cfg = load_config(TINY, ["trainer.tp=2", "generator.tp=2", "generator.replicas=2", "rollout.max_lag=3"])
    topo = topology(cfg)
    assert (topo.colocated, topo.drivers_only, topo.world_size) == (False, False, 6)
    assert topo.executors["generator"] == (2, 3, 4, 5) and topo.runs_generator(3)
    assert isinstance(schedule(cfg), AsyncSchedule) and lag_bound(cfg) == 3


def test_sync_colocates_tp1_engines_and_trains_on_lag_0():
    cfg = load_config(TINY, ["run.mode=sync", "rollout.max_lag=3"])
    topo = topology(cfg)
    assert topo.colocated and topo.executors["generator"] == topo.executors["trainer"]
    assert (topo.generator.tp, topo.generator.replicas) == (1, topo.trainer.world_size)
    assert isinstance(schedule(cfg), SyncSchedule)
    assert lag_bound(cfg) == 0  # generation and training alternate: every token is of the policy trained


def test_sglang_replicas_run_their_generator_on_the_driver_rank_only():
    cfg = load_config(TINY, ["generator.backend=sglang", "generator.tp=2", "generator.sglang_startup_timeout_s=100"])
    topo = topology(cfg)
    first, second = topo.executors["generator"]
    assert topo.drivers_only and topo.runs_generator(first) and not topo.runs_generator(second)
    # the first weight sync waits for the servers: the collectives' timeout covers two start-ups
    assert collective_timeout_s(cfg) == pytest.approx(max(600.0 + 200.0, cfg.run.hang_timeout_s + 120))
