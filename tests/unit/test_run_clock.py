"""The loop's clock and evaluation plan (loop/run_clock.py), which Controller.run asks each iteration."""

from types import SimpleNamespace

from megarl.loop.run_clock import EvalPlan, RunClock


def _cfg(steps=5, budget_min=1.0, eval_every=2, eval_sets=("arithmetic:8:5",)):
    return SimpleNamespace(
        run=SimpleNamespace(steps=steps, time_budget_min=budget_min),
        data=SimpleNamespace(eval=list(eval_sets), eval_every=eval_every),
    )


def _clock(rank=0, spent_before=120.0, **cfg):
    return RunClock(_cfg(**cfg), SimpleNamespace(train_seconds=spent_before), SimpleNamespace(rank=rank, control=None))


def test_a_budget_spent_by_earlier_launches_stops_before_the_last_step_only():
    assert _clock().already_spent(steps_done=3)  # 120 s of a 60 s budget
    assert not _clock().already_spent(steps_done=5)  # the run is done: nothing to refuse
    assert not _clock(budget_min=0).already_spent(steps_done=3)  # no budget
    assert not _clock(spent_before=59.0, budget_min=2.0).already_spent(steps_done=3)


def test_rank_0_alone_judges_the_budget_after_a_trained_step_before_the_last():
    assert _clock().over_budget(trains_now=True, step_done=3)
    assert not _clock(rank=1).over_budget(trains_now=True, step_done=3)
    assert not _clock().over_budget(trains_now=False, step_done=3)  # async iteration 0 only generates
    assert not _clock().over_budget(trains_now=True, step_done=5)  # the last step ends the run anyway
    assert not _clock(spent_before=0.0, budget_min=10.0).over_budget(trains_now=True, step_done=3)


def test_the_plan_evaluates_step_0_every_k_and_the_last_one_after_the_loop():
    schedule = SimpleNamespace(eval_iteration=lambda k: k + 1)  # async: step k's policy lands after iteration k
    plan = EvalPlan(_cfg(), schedule, steps_done=0)
    assert (plan.steps, plan.at, plan.after_loop) == ([0, 2, 4, 5], {1: 0, 3: 2, 5: 4}, True)
    resumed = EvalPlan(_cfg(), schedule, steps_done=2)  # step 2 was evaluated before the checkpoint
    assert (resumed.steps, resumed.at) == ([4, 5], {5: 4})
    assert EvalPlan(_cfg(eval_sets=()), schedule, steps_done=0).steps == []
