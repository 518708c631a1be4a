"""Score responses in persistent spawned worker processes, each sample under a time limit.

A reward can stall: sympy on a pathological answer (``9^{9^{9^{9}}}``), or a user
reward stuck on I/O. math-verify's own limits use ``signal.alarm``, which works only
in a main thread and cannot interrupt long C calls (big-integer arithmetic). So each
sample is scored in a worker process -- in its main thread, where math-verify's
limits do work -- and the parent kills and respawns a worker that passes the
wall-clock limit, scoring that sample 0.0 with reason ``"timeout"``.

Workers use the spawn context (no fork of a parent holding CUDA or threads), stay
up between batches, and take one sample at a time, so the limit is per sample and
a slow sample delays only its own worker.
"""

from __future__ import annotations

import atexit
import math
import multiprocessing as mp
import signal
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Dict, List, Optional, Sequence, Tuple

from megarl.errors import ConfigError
from megarl.rewards.registry import resolve_reward, reward_spec

OK = "ok"
TIMEOUT = "timeout"

# Spawning a worker imports megarl.rewards, math-verify and sympy: seconds on a busy machine.
STARTUP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RewardResult:
    score: float
    # "ok", "timeout", "worker died (exit code N)", or "error: <exception>" (score 0.0).
    reason: str = OK


def _worker_main(conn, spec: str) -> None:
    """Child process: resolve the reward, then score (index, response, answer, meta) forever."""
    # Ctrl-C reaches the whole process group; the parent decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        fn = resolve_reward(spec)
    except Exception as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            task = conn.recv()
        except EOFError:  # the parent is gone
            return
        if task is None:
            return
        index, response, answer, meta = task
        try:
            score = float(fn(response, answer, **meta))
            result = (score, OK) if math.isfinite(score) else (0.0, f"non-finite score {score}")
        except Exception as exc:
            result = (0.0, f"error: {type(exc).__name__}: {exc}"[:500])
        conn.send((index, *result))


class _Worker:
    def __init__(self, ctx, spec: str):
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=_worker_main, args=(child_conn, spec), daemon=True, name=f"megarl-reward[{spec}]"
        )
        self.process.start()
        child_conn.close()
        self.ready = False
        self.deadline = time.monotonic() + STARTUP_TIMEOUT_S
        self.task: Optional[int] = None  # index of the sample in flight

    def send(self, index: int, task: tuple, timeout_s: float) -> None:
        self.conn.send(task)
        self.task = index
        self.deadline = time.monotonic() + timeout_s

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.conn.close()


class RewardPool:
    """Persistent workers scoring with one reward function (a name, dotted path or function)."""

    def __init__(self, fn, num_workers: int = 1):
        if num_workers < 1:
            raise ConfigError(f"reward.num_workers: must be at least 1, got {num_workers}")
        self.spec = reward_spec(fn)  # resolves here first, so a bad name fails in the caller
        self._ctx = mp.get_context("spawn")
        self._workers: List[Optional[_Worker]] = [None] * num_workers
        self.restarts = 0

    def score(
        self, responses: Sequence[str], answers: Sequence[str], timeout_s: float, metas: Optional[Sequence[dict]] = None
    ) -> List[RewardResult]:
        if len(responses) != len(answers):
            raise ConfigError(f"score_batch: {len(responses)} responses but {len(answers)} answers")
        if metas is not None and len(metas) != len(responses):
            raise ConfigError(f"score_batch: {len(metas)} metas for {len(responses)} responses")
        if not timeout_s or timeout_s <= 0:
            raise ConfigError(f"reward.timeout_s: must be positive, got {timeout_s}")
        results: List[Optional[RewardResult]] = [None] * len(responses)
        try:
            self._score(responses, answers, timeout_s, metas, results)
        except BaseException:
            # A sample still in flight would answer into the next batch: stop every worker.
            self._kill_all()
            raise
        return results  # type: ignore[return-value]

    def _score(self, responses, answers, timeout_s, metas, results) -> None:
        pending = deque(range(len(responses)))
        for slot, worker in enumerate(self._workers):
            if worker is None or not worker.process.is_alive():
                self._replace(slot, count=worker is not None)

        while pending or any(w.task is not None for w in self._workers):
            for slot, worker in enumerate(self._workers):
                if worker.ready and worker.task is None and pending:
                    i = pending.popleft()
                    meta = dict(metas[i]) if metas is not None else {}
                    try:
                        worker.send(i, (i, responses[i], answers[i], meta), timeout_s)
                    except OSError:  # the worker died while idle: respawn, retry the sample
                        pending.appendleft(i)
                        self._replace(slot)
            waiting = {w.conn: w for w in self._workers if w.task is not None or not w.ready}
            next_deadline = min(w.deadline for w in waiting.values())
            for conn in wait(list(waiting), timeout=max(0.0, next_deadline - time.monotonic())):
                self._receive(waiting[conn], results)
            now = time.monotonic()
            for slot, worker in enumerate(self._workers):
                if worker.conn.closed or worker.deadline > now:
                    continue
                if worker.task is not None:
                    results[worker.task] = RewardResult(0.0, TIMEOUT)
                    self._replace(slot)
                elif not worker.ready:
                    worker.kill()
                    raise RuntimeError(
                        f"reward worker for {self.spec!r} did not start within {STARTUP_TIMEOUT_S:.0f} s"
                    )
            for slot, worker in enumerate(self._workers):
                if worker.conn.closed:  # died while scoring: _receive recorded the sample
                    self._replace(slot)

    def _receive(self, worker: _Worker, results: List[Optional[RewardResult]]) -> None:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            worker.kill()
            if worker.task is None:
                raise RuntimeError(
                    f"reward worker for {self.spec!r} exited at startup (exit code {worker.process.exitcode})"
                ) from None
            results[worker.task] = RewardResult(0.0, f"worker died (exit code {worker.process.exitcode})")
            worker.task = None
            return
        if message[0] == "ready":
            worker.ready = True
        elif message[0] == "failed":
            worker.kill()
            raise ConfigError(f"reward.function: the scoring worker cannot load {self.spec!r}: {message[1]}")
        else:
            index, score, reason = message
            results[index] = RewardResult(score, reason)
            worker.task = None

    def _replace(self, slot: int, count: bool = True) -> None:
        old = self._workers[slot]
        if old is not None:
            old.kill()
            self.restarts += int(count)
        self._workers[slot] = _Worker(self._ctx, self.spec)

    def _kill_all(self) -> None:
        for worker in self._workers:
            if worker is not None:
                worker.kill()
        self._workers = [None] * len(self._workers)

    def close(self) -> None:
        for worker in self._workers:
            if worker is None:
                continue
            if not worker.conn.closed:
                try:
                    worker.conn.send(None)
                except OSError:
                    pass
            worker.process.join(timeout=2)
            worker.kill()
        self._workers = [None] * len(self._workers)

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# One pool per (reward, worker count), kept between batches: respawning costs seconds.
_POOLS: Dict[Tuple[str, int], RewardPool] = {}


def score_batch(
    responses: Sequence[str],
    answers: Sequence[str],
    fn,
    timeout_s: float,
    *,
    metas: Optional[Sequence[dict]] = None,
    num_workers: int = 1,
) -> List[RewardResult]:
    """Score each response against its answer with ``fn`` (name, dotted path or function).

    Every sample gets a result: a sample over ``timeout_s`` seconds, or whose reward
    raised, scores 0.0 with the reason recorded. ``metas[i]`` become keyword arguments.
    """
    key = (reward_spec(fn), num_workers)
    if key not in _POOLS:
        _POOLS[key] = RewardPool(key[0], num_workers=num_workers)
    return _POOLS[key].score(responses, answers, timeout_s, metas=metas)


@atexit.register
def close_pools() -> None:
    """Stop the workers score_batch started (also run at interpreter exit)."""
    while _POOLS:
        _POOLS.popitem()[1].close()
