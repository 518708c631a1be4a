"""Rewards: math-verify verdicts, per-sample timeouts in the scoring workers, user rewards by path."""

from __future__ import annotations

import time

import pytest

from megarl.rewards import (
    TIMEOUT,
    RewardPool,
    score_batch,
)
from tests.unit.test_rewards import (
    MATH_CASES,
    user_reward_module,  # noqa: F401 (fixtures: pytest finds them by name)
)


def test_math_reward_in_scoring_workers_matches_in_process():
    golds = [g for g, _, _ in MATH_CASES]
    responses = [r for _, r, _ in MATH_CASES]
    results = score_batch(responses, golds, "math", timeout_s=30.0)
    assert [r.score for r in results] == [e for _, _, e in MATH_CASES]
    assert {r.reason for r in results} == {"ok"}


@pytest.fixture(scope="module")
def user_pool(user_reward_module):
    with RewardPool(user_reward_module, num_workers=2) as pool:
        yield pool


def test_user_reward_scores_with_meta_as_kwargs(user_pool):
    results = user_pool.score(["7", "8", "7"], ["7", "7", "7"], timeout_s=10.0, metas=[{}, {}, {"bonus": 0.5}])
    assert [r.score for r in results] == [1.0, 0.0, 1.5]


def test_sample_over_the_timeout_scores_zero_in_bounded_time(user_pool):
    restarts = user_pool.restarts
    start = time.monotonic()
    results = user_pool.score(["7", "hang", "7", "7"], ["7"] * 4, timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert [r.score for r in results] == [1.0, 0.0, 1.0, 1.0]
    assert results[1].reason == TIMEOUT
    assert elapsed < 15, f"a hung sample held the batch for {elapsed:.1f} s"
    assert user_pool.restarts == restarts + 1
    # The respawned worker keeps scoring.
    assert [r.score for r in user_pool.score(["7"] * 3, ["7"] * 3, timeout_s=10.0)] == [1.0] * 3


def test_raising_or_crashing_reward_scores_zero_with_reason(user_pool):
    results = user_pool.score(["raise", "crash", "7"], ["7"] * 3, timeout_s=10.0)
    assert [r.score for r in results] == [0.0, 0.0, 1.0]
    assert results[0].reason == "error: KeyError: 'boom'"
    assert results[1].reason == "worker died (exit code 3)"


def test_worker_killed_between_batches_is_respawned(user_pool):
    for worker in user_pool._workers:
        worker.process.kill()
        worker.process.join()
    assert [r.score for r in user_pool.score(["7", "8"], ["7", "7"], timeout_s=10.0)] == [1.0, 0.0]


def test_score_batch_timeout_with_user_path(user_reward_module):
    results = score_batch(["hang", "7"], ["7", "7"], user_reward_module, timeout_s=1.0)
    assert [(r.score, r.reason) for r in results] == [(0.0, TIMEOUT), (1.0, "ok")]
