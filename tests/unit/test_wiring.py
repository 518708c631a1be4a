"""The wiring's decisions from the run's layout (megarl/layout.py, loop/wiring.py), without starting a rank."""

import pytest

from megarl.config import load_config
from megarl.loop.schedule import AsyncSchedule, SyncSchedule
from megarl.loop.wiring import collective_timeout_s, schedule

TINY = "configs/tiny_cpu.yaml"


def test_async_torch_engines_are_ranks_of_their_own():
    cfg = load_config(TINY, ["trainer.tp=2", "generator.tp=2", "generator.replicas=2", "rollout.max_lag=3"])
    topo = cfg.layout().topology()
    assert (topo.colocated, topo.drivers_only, topo.world_size) == (False, False, 6)
    assert topo.executors["generator"] == (2, 3, 4, 5) and topo.runs_generator(3)
    assert isinstance(schedule(cfg), AsyncSchedule) and cfg.layout().lag_bound == 3


def test_sync_colocates_tp1_engines_and_trains_on_lag_0():
    cfg = load_config(TINY, ["run.mode=sync", "rollout.max_lag=3"])
    topo = cfg.layout().topology()
    assert topo.colocated and topo.executors["generator"] == topo.executors["trainer"]
    assert (topo.generator.tp, topo.generator.replicas) == (1, topo.trainer.world_size)
    assert isinstance(schedule(cfg), SyncSchedule)
    assert cfg.layout().lag_bound == 0  # generation and training alternate: every token is of the policy trained


def test_sglang_replicas_run_their_generator_on_the_driver_rank_only():
    cfg = load_config(TINY, ["generator.backend=sglang", "generator.tp=2", "generator.sglang_startup_timeout_s=100"])
    topo = cfg.layout().topology()
    first, second = topo.executors["generator"]
    assert topo.drivers_only and topo.runs_generator(first) and not topo.runs_generator(second)
    # the first weight sync waits for the servers: the collectives' timeout covers two start-ups
    assert collective_timeout_s(cfg) == pytest.approx(max(600.0 + 200.0, cfg.run.hang_timeout_s + 120))


def test_sync_with_g_updates_per_batch_has_lag_bound_g_minus_1():
    cfg = load_config(TINY, ["run.mode=sync", "trainer.updates_per_batch=4"])
    sched = schedule(cfg)
    assert (sched.updates_per_batch, sched.samples_per_step) == (4, 4 * 2)
    assert cfg.layout().lag_bound == 3  # the batch's last slice is trained 3 steps after it was generated


class _Maker:
    """Makes batches of groups numbered in order; records what it was asked for."""

    def __init__(self, samples_per_prompt):
        self.n, self.next, self.calls = samples_per_prompt, 0, []

    def make(self, version, n_groups, drain):
        from megarl.loop.batch import Batch
        from megarl.rollout import Sample

        self.calls.append(n_groups)
        samples = []
        for g in range(self.next, self.next + n_groups):
            samples += [Sample([1], [2], [0.0], [version], group_id=g) for _ in range(self.n)]
        self.next += n_groups
        return Batch(samples=samples, time_generate=1.5)


class _Trainer:
    def __init__(self):
        self.version, self.trained = 0, []

    def step(self, samples):
        self.trained.append(sorted({s.group_id for s in samples}))
        self.version += 1
        return {}


def _parts(maker, trainer, groups):
    from megarl.loop.schedule import StepParts

    return StepParts(trainer, maker, None, groups, lambda it, share: share, None, lambda what: None, lambda: 0.0)


def test_sync_schedule_trains_a_g_batch_as_g_disjoint_slices_in_group_order():
    # G = 3, 2 groups of 2 samples per step: one generation of 6 groups per 3 steps, slices
    # {0,1}, {2,3}, {4,5}; the slices still to train are carried (a checkpoint saves them)
    sched = SyncSchedule(updates_per_batch=3, samples_per_step=2 * 2)
    maker, trainer = _Maker(2), _Trainer()
    parts, pending = _parts(maker, trainer, 2), None
    carried, times = [], []
    for it in range(6):
        work = sched.work(parts, it, True, pending)
        times.append(work.batch.time_generate)
        pending, has_pending = sched.carry(work, True, True)
        carried.append(has_pending)
    assert maker.calls == [6, 6]
    assert trainer.trained == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert carried == [True, True, False] * 2
    assert times == [1.5, 0.0, 0.0] * 2  # the generation's time is reported once, with its first slice


def test_sync_schedule_with_one_update_per_batch_generates_every_step():
    sched = SyncSchedule()
    maker, trainer = _Maker(2), _Trainer()
    parts, pending = _parts(maker, trainer, 2), None
    for it in range(3):
        work = sched.work(parts, it, True, pending)
        pending, has_pending = sched.carry(work, True, True)
        assert (pending, has_pending) == (None, False)
    assert maker.calls == [2, 2, 2] and trainer.trained == [[0, 1], [2, 3], [4, 5]]
