"""The generator executor's admission control over any GeneratorBackend, on a scripted backend.

The scripted backend finishes each sample a fixed number of steps after it
starts, stamping every token with the backend's current version, and honours
``abort`` the way both real backends do (the sample comes back with
finish_reason "abort"). What is checked is the executor's own bookkeeping:
which groups reach the trainer, which are aborted, and when it stops
admitting prompts -- the same code for the torch engine and SGLang.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, List

from megarl.config import RolloutConfig
from megarl.data.datasets import PromptRecord, TokenizedPrompt
from megarl.executors.generator import GeneratorExecutor
from megarl.generator.interface import ABORTED, Completion, GeneratorBackend


class ScriptedBackend(GeneratorBackend):
    def __init__(self, tokens_per_sample: int, first_group_tokens: int = 0):
        """Samples take ``tokens_per_sample`` steps (the first group ``first_group_tokens``)."""
        self.tokens, self.first = tokens_per_sample, first_group_tokens or tokens_per_sample
        self.version = 0
        self.running: Dict[tuple, dict] = {}
        self.aborted: List[Completion] = []
        self.submitted: List[str] = []

    def submit(self, requests):
        for r in requests:
            self.submitted.append(r.request_id)
            for i in range(r.n):
                self.running[(r.request_id, i)] = {"request": r, "versions": []}

    def step(self):
        out, self.aborted = self.aborted, []
        for key, s in list(self.running.items()):
            s["versions"].append(self.version)
            if len(s["versions"]) == (self.first if s["request"].group_id < 1000 else self.tokens):
                out.append(self._completion(key, "length"))
        return out

    def _completion(self, key, reason):
        s = self.running.pop(key)
        r = s["request"]
        n = len(s["versions"])
        return Completion(
            r.request_id, key[1], r.group_id, r.prompt_ids, [7] * n, [-1.0] * n, s["versions"], reason, dict(r.meta)
        )

    def abort(self, request_ids):
        for key in [k for k in self.running if k[0] in set(request_ids)]:
            self.aborted.append(self._completion(key, ABORTED))

    def update_weights(self, apply):
        stats = apply()
        self.version = stats.version
        return stats

    def stats(self):
        return {"queue_depth": 0, "running": len(self.running), "version": self.version}


def _executor(backend, max_running=4, n=2, max_lag=1, groups_per_step=2):
    prompts = [TokenizedPrompt([1, 2, 3], PromptRecord([{"role": "user", "content": "q"}], "a"))]
    rollout = RolloutConfig(prompts_per_step=groups_per_step, samples_per_prompt=n, max_new_tokens=8, max_lag=max_lag)
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


def test_groups_that_cannot_be_trained_in_time_are_aborted_not_finished():
    backend = ScriptedBackend(tokens_per_sample=6, first_group_tokens=3)  # staggered: slots free up early
    ex = _executor(backend, max_running=4, n=2, max_lag=1)
    out = ex.generate(train_version=0, n_groups=2, drain=False)
    assert len(out.groups) == 2 and out.stale_aborted == 0
    in_flight = set(ex.pending)  # started under version 0, still running
    assert in_flight
    _update(backend, 1)
    _update(backend, 2)  # the trainer moved on twice: a version-0 group would have lag 3 > max_lag at batch 3
    out = ex.generate(train_version=3, n_groups=2, drain=False)
    assert ex.stale_aborted == len(in_flight) and out.stale_aborted == len(in_flight)
    assert ex.aborted_samples == 2 * len(in_flight)  # both samples of each doomed group came back aborted
    for group in out.groups:
        assert group[0].group_id not in in_flight
        assert all(3 - min(c.versions) <= 1 for c in group)  # only trainable groups are handed over
        assert all(c.finish_reason != ABORTED for c in group)


def test_finished_groups_that_aged_are_dropped():
    backend = ScriptedBackend(tokens_per_sample=2)
    ex = _executor(backend, max_running=8, n=2, max_lag=1)
    ex.generate(train_version=0, n_groups=1, drain=False)
    leftover = len(ex.ready)
    assert leftover >= 1  # finished meanwhile, all version 0
    _update(backend, 2)
    out = ex.generate(train_version=2, n_groups=1, drain=False)
    assert out.stale_dropped == leftover and min(out.groups[0][0].versions) == 2


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
