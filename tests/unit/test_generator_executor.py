"""The generator executor's lag bound over any GeneratorBackend, on a scripted backend.

The scripted backend finishes each sample a fixed number of steps after it
starts (by group: long and short answers), stamping every token with the
backend's current version, and honours ``abort`` the way both real backends
do. What is checked is the executor's own bookkeeping -- which groups reach
the trainer, in which batch, with which lags, and when it stops admitting
prompts -- the same code for the torch engine and SGLang; and, through the
trainer's own functions (apply_lag_policy, check_lag), what each
``rollout.max_lag_policy`` trains of them.

``run_async`` plays the async schedule (loop/schedule.py): iteration i makes
batch i with the backend at version i - 1 (0 at first), the trainer trains
batch i - 1 meanwhile at version i - 1, and its policy i lands after; batch i
is trained at version i.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional

import pytest

from megarl.config import RolloutConfig, load_config
from megarl.data.datasets import PromptRecord, TokenizedPrompt
from megarl.errors import ConfigError
from megarl.executors.generator import LAG_COUNT_KEYS, GeneratorExecutor
from megarl.executors.reward import ScoredSamples
from megarl.executors.trainer import apply_lag_policy, check_lag
from megarl.generator.interface import ABORTED, Completion, GeneratorBackend
from megarl.loop.batch import Batch, BatchMaker
from megarl.loop.records import step_record

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml")


class ScriptedBackend(GeneratorBackend):
    def __init__(self, tokens_per_sample: int, first_group_tokens: int = 0, tokens_of: Optional[Callable] = None):
        """Samples take ``tokens_per_sample`` steps (the first group ``first_group_tokens``), or
        ``tokens_of(group index)`` (group ids are index * 1000 + replica)."""
        first = first_group_tokens or tokens_per_sample
        self.tokens_of = tokens_of or (lambda k: first if k == 0 else tokens_per_sample)
        self.version = 0
        self.running: Dict[tuple, dict] = {}
        self.aborted: List[Completion] = []
        self.submitted: List[str] = []
        self.abort_calls: List[list] = []
        self.submitted_at: Dict[str, int] = {}
        self.finished: List[Completion] = []  # every sample that came back finished

    def submit(self, requests):
        for r in requests:
            self.submitted.append(r.request_id)
            self.submitted_at[r.request_id] = self.version
            for i in range(r.n):
                self.running[(r.request_id, i)] = {"request": r, "versions": []}

    def step(self):
        out, self.aborted = self.aborted, []
        for key, s in list(self.running.items()):
            s["versions"].append(self.version)
            if len(s["versions"]) == self.tokens_of(s["request"].group_id // 1000):
                out.append(self._completion(key, "length"))
        self.finished += [c for c in out if c.finish_reason != ABORTED]
        return out

    def _completion(self, key, reason):
        s = self.running.pop(key)
        r = s["request"]
        n = len(s["versions"])
        return Completion(
            r.request_id, key[1], r.group_id, r.prompt_ids, [7] * n, [-1.0] * n, s["versions"], reason, dict(r.meta)
        )

    def abort(self, request_ids):
        self.abort_calls.append(list(request_ids))
        for key in [k for k in self.running if k[0] in set(request_ids)]:
            self.aborted.append(self._completion(key, ABORTED))

    def update_weights(self, apply):
        stats = apply()
        self.version = stats.version
        return stats

    def stats(self):
        return {"queue_depth": 0, "running": len(self.running), "version": self.version}


def _executor(backend, max_running=4, n=2, max_lag=1, groups_per_step=2, policy="wait", max_new_tokens=8):
    prompts = [TokenizedPrompt([1, 2, 3], PromptRecord([{"role": "user", "content": "q"}], "a"))]
    rollout = RolloutConfig(
        prompts_per_step=groups_per_step,
        samples_per_prompt=n,
        max_new_tokens=max_new_tokens,
        max_lag=max_lag,
        max_lag_policy=policy,
    )
    return GeneratorExecutor(
        rollout,
        max_running,
        seed=1,
        backend=backend,
        prompts=prompts,
        stop_ids=(0,),
        replica=0,
        groups_per_step=groups_per_step,
    )


def _update(backend, version):
    backend.update_weights(lambda: SimpleNamespace(version=version))


def run_async(ex, backend, batches: int, ahead_steps: int = 0) -> List:
    """The async schedule (the module doc) for ``batches`` iterations: each one's GeneratedGroups, in
    order (batch i trained at version i). ``ahead_steps``: generate_while_waiting's backend steps while
    the trainer steps (0: off, as in the CPU demo)."""
    out = []
    for i in range(batches):
        out.append(ex.generate(train_version=i, n_groups=ex.groups_per_step, drain=False))
        if ahead_steps:
            polls = iter(range(ahead_steps + 1))
            ex.generate_until(lambda: next(polls) >= ahead_steps, next_train_version=i + 1)
        if i >= 1:
            _update(backend, i)  # the trainer's step of iteration i trained batch i - 1: policy i
    return out


def _index(group) -> int:
    return group[0].group_id // 1000


# One long group (index 0, 8 tokens = max_new_tokens) among short ones (1 token), one group of one
# sample per batch, max_running 1 (so two groups decode at once: one running, one queued), max_lag 2.
# By hand: batch 0 takes g1 and batch 1 g2 (g0 still running; both submitted at version 0). In
# iteration 2 (version 1) g3 finishes after g0's 3rd token; g0 (deadline 0 + 2) is due at batch 2:
#   wait       batch 2 waits 5 steps for g0 (tokens 4-8; the admission cap, 2 groups, keeps the free
#              slot empty meanwhile) and takes it at lag 2; g3 follows in batch 3, then g4, g5 ...
#              (g3, of version 1, at lag 2 too)
#   keep/mask  batch 2 takes g3; g0 gets one token per iteration, versions [0, 0, 1, 2, 3, 4, 5, 6],
#              finishes in iteration 7 and, oldest first, is batch 7 -- trained at version 7, its
#              first 6 tokens more than 2 behind: kept whole (largest lag 7), or those 6 masked (the
#              tokens of versions 5 and 6 trained, lag 2)
#   drop       the same, but g0 is dropped at batch 7, which takes g8: the long group is the one lost,
#              and every group trained is short, one version behind (largest lag 1)
HAND = {
    "wait": dict(order=[1, 2, 0, 3, 4, 5, 6, 7], waits={2: (5, 5)}, stale=0, masked=0, dropped=0, lag_max=2),
    "keep": dict(order=[1, 2, 3, 4, 5, 6, 7, 0], waits={}, stale=1, masked=0, dropped=0, lag_max=7),
    "mask": dict(order=[1, 2, 3, 4, 5, 6, 7, 0], waits={}, stale=1, masked=6, dropped=0, lag_max=2),
    "drop": dict(order=[1, 2, 3, 4, 5, 6, 7, 8], waits={}, stale=0, masked=0, dropped=1, lag_max=1),
}


@pytest.mark.parametrize("policy", sorted(HAND))
def test_each_policy_excludes_what_the_hand_count_says(policy):
    want = HAND[policy]
    backend = ScriptedBackend(1, tokens_of=lambda k: 8 if k == 0 else 1)
    ex = _executor(backend, max_running=1, n=1, max_lag=2, groups_per_step=1, policy=policy, max_new_tokens=8)
    batches = run_async(ex, backend, 8)
    assert [_index(g) for b in batches for g in b.groups] == want["order"]
    assert backend.abort_calls == []  # nothing in flight is aborted, whatever the policy
    for i, b in enumerate(batches):
        admission, handover = want["waits"].get(i, (0, 0))
        assert (b.lag_counts["lag_admission_waits"], b.lag_counts["lag_handover_waits"]) == (admission, handover), i
        dropped = want["dropped"] if i == 7 else 0
        assert b.lag_counts["lag_dropped_groups"] == dropped and b.stale_dropped == want["dropped"] * (i == 7)
        assert b.lag_counts["lag_dropped_samples_len_q4"] == dropped  # g0's 8 tokens: the last quarter
        assert sum(b.lag_counts[f"lag_dropped_samples_len_q{q}"] for q in (1, 2, 3)) == 0
    # what the trainer makes of them (TrainerExecutor.step's own checks, before the optimizer step)
    counts, lags = {}, []
    for version, b in enumerate(batches):
        samples = [c.to_sample() for g in b.groups for c in g]
        step = apply_lag_policy(samples, version, 2, policy, max_new_tokens=8)
        counts = {k: counts.get(k, 0) + v for k, v in step.items()}
        lags += check_lag(samples, version, 2, refuse=policy != "keep")
    assert counts["lag_stale_samples_len_q4"] == want["stale"] and counts["lag_masked_tokens_len_q4"] == want["masked"]
    assert counts["trained_samples_len_q4"] == (policy != "drop") and counts["trained_samples_len_q1"] == 7 + (
        policy == "drop"
    )
    assert max(lags) == want["lag_max"]


def test_a_group_in_flight_past_the_bound_finishes_under_updates_and_is_not_aborted():
    """The old rule aborted a group once the trainer was max_lag versions past the version it was
    submitted under; now it finishes under the new weights and is handed over first (max_lag_policy
    keep: the trainer takes it, beyond the bound)."""
    backend = ScriptedBackend(tokens_per_sample=6, first_group_tokens=3)  # staggered: slots free up early
    ex = _executor(backend, max_running=4, n=2, max_lag=1, policy="keep")
    out = ex.generate(train_version=0, n_groups=2, drain=False)
    assert len(out.groups) == 2
    in_flight = set(ex.pending)  # started under version 0, still running
    assert in_flight
    _update(backend, 1)
    _update(backend, 2)  # the trainer moved on twice: submitted at 0, a group is 3 versions old at batch 3
    out = ex.generate(train_version=3, n_groups=2, drain=False)
    assert backend.abort_calls == [] and not ex.pending.keys() & in_flight  # they finished ...
    handed = {g[0].group_id for g in out.groups}
    assert in_flight <= handed  # ... and, of version 0, are among the oldest, handed over first
    for group in out.groups:
        assert all(c.finish_reason == "length" and len(c.output_ids) == 6 for c in group)
        if group[0].group_id in in_flight:
            assert all(c.versions[0] == 0 and c.versions[-1] == 2 for c in group)  # tokens under 0 and 2
    lags = check_lag([c.to_sample() for g in out.groups for c in g], 3, 1, refuse=False)
    assert max(lags) == 3


def test_finished_groups_that_aged_are_dropped_under_drop():
    backend = ScriptedBackend(tokens_per_sample=2)
    ex = _executor(backend, max_running=8, n=2, max_lag=1, policy="drop")
    ex.generate(train_version=0, n_groups=1, drain=False)
    leftover = len(ex.ready)
    assert leftover >= 1  # finished meanwhile, all version 0
    _update(backend, 2)
    out = ex.generate(train_version=2, n_groups=1, drain=False)
    assert out.stale_dropped == leftover and min(out.groups[0][0].versions) == 2
    assert out.lag_counts["lag_dropped_groups"] == leftover
    assert out.lag_counts["lag_dropped_samples_len_q1"] == 2 * leftover  # 2 of max_new_tokens 8: first quarter


def _mixed_run(policy: str, ahead_steps: int, batches: int = 30):
    """Long groups (every third, 16 tokens = max_new_tokens) among short ones (3 tokens), 2 groups of 2
    samples per batch, 3 groups decoding at once, max_lag 2: a long group outlives several batches."""
    backend = ScriptedBackend(1, tokens_of=lambda k: 16 if k % 3 == 0 else 3)
    ex = _executor(backend, max_running=4, n=2, max_lag=2, groups_per_step=2, policy=policy, max_new_tokens=16)
    return backend, ex, run_async(ex, backend, batches, ahead_steps)


@pytest.mark.parametrize("ahead_steps", [0, 2], ids=["generate_while_waiting_off", "generate_while_waiting_on"])
def test_no_sample_is_excluded_for_its_length_under_the_default_policy(ahead_steps):
    assert RolloutConfig().max_lag_policy == "wait"
    backend, ex, batches = _mixed_run("wait", ahead_steps)
    trained = [c for b in batches for g in b.groups for c in g]
    waiting = [c for g in ex.ready for c in g]
    # every sample generated was trained, or waits in a finished group for the next batch: the lengths
    # the trainer got are the generated ones, long answers included
    assert sorted(len(c.output_ids) for c in trained + waiting) == sorted(len(c.output_ids) for c in backend.finished)
    assert sum(len(c.output_ids) == 16 for c in trained) > 0 and len(waiting) <= 2 * 3
    assert backend.abort_calls == [] and sum(b.stale_dropped for b in batches) == 0
    assert set(ex.oldest) == {g[0].group_id for g in ex.ready}  # its cache follows what waits
    for version, b in enumerate(batches):  # each batch within the bound, as the trainer checks it
        assert max(check_lag([c.to_sample() for g in b.groups for c in g], version, 2)) <= 2
    # no group whose deadline passed is missing: a group submitted at version v is in batch v + 2 or before
    trained_ids = {c.group_id for c in trained}
    due = {int(r[1:]) for r, v in backend.submitted_at.items() if v + 2 <= len(batches) - 1}
    assert due and due <= trained_ids
    assert sum(b.lag_counts["lag_handover_waits"] for b in batches) > 0  # it held batches for long groups


def test_drop_selects_by_length_and_the_metrics_show_it():
    """The same run under drop: what goes past the bound is the long groups, and the drop counts by
    length bucket say so -- the bias the default policy removes."""
    backend, ex, batches = _mixed_run("drop", ahead_steps=0)
    trained = [c for b in batches for g in b.groups for c in g]
    assert set(ex.oldest) == {g[0].group_id for g in ex.ready}
    dropped = {q: sum(b.lag_counts[f"lag_dropped_samples_len_q{q}"] for b in batches) for q in (1, 2, 3, 4)}
    assert dropped[4] > 0 and dropped[1] == dropped[2] == dropped[3] == 0
    assert sum(b.lag_counts["lag_dropped_groups"] for b in batches) * 2 == dropped[4] == 2 * batches[-1].stale_dropped
    long_trained = sum(len(c.output_ids) == 16 for c in trained) / len(trained)
    long_generated = sum(len(c.output_ids) == 16 for c in backend.finished) / len(backend.finished)
    assert long_trained < long_generated  # the trained batches hold fewer long answers than were generated


def test_generating_ahead_stops_at_what_the_next_batches_can_use():
    backend = ScriptedBackend(tokens_per_sample=1)  # a generator far faster than the trainer
    ex = _executor(backend, max_running=4, n=2, max_lag=2, groups_per_step=2)
    ex.generate(train_version=1, n_groups=2, drain=False)  # backend at version 0
    polls = iter(range(50))
    ex.generate_until(lambda: next(polls) >= 49, next_train_version=2)
    # a group started now (version 0) can join batches 2 .. 0 + max_lag = 2: one batch, 2 groups
    assert len(ex.ready) + len(ex.pending) == 2
    submitted = len(backend.submitted)
    ex.generate_until(lambda: True, next_train_version=2)
    assert len(backend.submitted) == submitted  # nothing more started


def test_sync_mode_drains_exactly_its_share():
    backend = ScriptedBackend(tokens_per_sample=3)
    ex = _executor(backend, max_running=64, n=2, max_lag=0)
    out = ex.generate(train_version=0, n_groups=3, drain=True)
    assert len(out.groups) == 3 and len(backend.submitted) == 3 and out.in_flight == 0


def test_max_lag_policy_is_used_or_refused():
    assert load_config(TINY, ["rollout.max_lag_policy=mask"]).rollout.max_lag_policy == "mask"
    cases = {
        ("rollout.max_lag_policy=later",): "rollout.max_lag_policy: 'later' is not one of",
        ("run.mode=sync", "rollout.max_lag_policy=keep"): "rollout.max_lag_policy: an async setting",
        ("rollout.max_lag=0",): "rollout.max_lag: async mode trains each batch one version after",
    }
    for overrides, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(TINY, list(overrides))
    load_config(TINY, ["run.mode=sync", "rollout.max_lag=0"])  # sync: max_lag is not read


def test_lag_counts_are_reset_at_every_hand_over():
    backend = ScriptedBackend(tokens_per_sample=1)
    ex = _executor(backend, max_running=4, n=2, max_lag=1, groups_per_step=2)
    assert set(ex.generate(0, 2, drain=False).lag_counts) == set(LAG_COUNT_KEYS)
    assert ex.lag_counts == dict.fromkeys(LAG_COUNT_KEYS, 0)


class EveryFourthUniform:
    """A reward: groups of index 1, 5, 9, ... get one reward for all their samples (filter_groups drops
    them, and the batch takes another round), the others 0 and 1."""

    def score(self, groups):
        samples = [
            c.to_sample(reward=0.0 if _index(g) % 4 == 1 else float(c.sample_index % 2)) for g in groups for c in g
        ]
        return ScoredSamples(samples, 0.0, 0)


def test_a_batch_counts_every_round_of_its_making_and_replicas_add_up():
    backend = ScriptedBackend(1, tokens_of=lambda k: 16 if k % 3 == 0 else 3)
    ex = _executor(backend, max_running=4, n=2, max_lag=2, groups_per_step=2, policy="drop", max_new_tokens=16)
    rounds, generate = [], ex.generate
    ex.generate = lambda *args: rounds.append(generate(*args)) or rounds[-1]
    maker = BatchMaker(ex, EveryFourthUniform(), filter_groups=True, samples_per_prompt=2)
    batches, several = [], 0
    for i in range(16):
        rounds.clear()
        batches.append(maker.make(i, 2, False))
        several += len(rounds) > 1
        assert batches[-1].lag_counts == {k: sum(r.lag_counts[k] for r in rounds) for k in LAG_COUNT_KEYS}
        if i >= 1:
            _update(backend, i)
    assert several and sum(b.lag_counts["lag_dropped_groups"] for b in batches) > 0
    merged = Batch.merge(batches[-2:])  # two replicas' shares
    assert merged.lag_counts == {k: batches[-2].lag_counts[k] + batches[-1].lag_counts[k] for k in LAG_COUNT_KEYS}
    record = step_record(16, "async", 16, {}, merged, None, 1.0, 0.0, None, False)
    assert {k: record[k] for k in LAG_COUNT_KEYS} == merged.lag_counts and "stale_aborted" not in record
