"""Hang detection: every rank heartbeats through the job's store; watchers end a job that stopped moving.

A rank that dies ends the job at once (runtime/launch.py, torchrun). A rank that
stops *making progress* -- a stuck kernel, a deadlocked collective, a process
stopped by a debugger or the OOM killer's SIGSTOP cousins -- leaves its peers
waiting in a collective until the collective's timeout, hours later with NCCL's
defaults. So every rank records what it is doing in the store
(``megarl/heartbeat/<rank>``: a counter, its executor and the activity) as it goes
(``beat``, at most once a second), and two watcher threads -- on the first and the
last rank, so that one stuck watcher does not hide a hang -- read every rank's
entry every few seconds. A rank whose entry has not changed for
``run.hang_timeout_s`` by the watcher's own clock (no cross-node clock skew) ends
the job, with a message naming the rank, its executor and what it was last doing.
Ranks about to wait for others in a collective say so (``beat(..., waiting=True)``):
a waiting rank is quiet by design, so only a rank that is *not* waiting is judged
stuck -- the one quiet longest if several -- unless every quiet rank is waiting
(a deadlock), when the one waiting longest is named.

Progress alone cannot tell a rank that waits for its peers from a rank whose
*process* stopped while it waited (SIGSTOP, a debugger, a node swapping hard):
both are quiet and flagged waiting, and the longest waiting may be a healthy peer.
So every rank also pulses (``megarl/pulse/<rank>``) from a thread of its own every
watch interval, whatever its main thread does; a quiet rank whose pulse stopped too
(for three intervals: a live one misses at most one read) is named before any other.

The store itself lives in rank 0's process (runtime/job.py). If that process stops, the
watchers' reads of the store never return, so they cannot judge by entries: a third thread
times each read instead, and a read unanswered for ``run.hang_timeout_s`` names rank 0 by
the entry it last had. The store's server answers from a thread of its own, without
Python's lock, so a busy rank 0 still answers within milliseconds: only a stopped process
or an unreachable host leaves a read waiting that long.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from typing import Dict, Optional, Set, Tuple

from megarl.runtime import failure

KEY = "megarl/heartbeat/{}"
PULSE_KEY = "megarl/pulse/{}"
# MEGARL_LOG_ACTIVITY=1: every rank also prints its activity to stderr when it changes, and a
# reminder while it stays the same, so a slow first step can be told from a hang by reading the log
# (scripts/gpu_check.sh sets it: its first MoE try printed nothing for 190 s)
LOG_ACTIVITY_ENV = "MEGARL_LOG_ACTIVITY"
ACTIVITY_REMINDER_S = 30.0


class ActivityLog:
    """Prints a rank's activity when it changes, and every ACTIVITY_REMINDER_S while it does not
    (with how many beats it saw meanwhile: a decoding generator beats once per decode step)."""

    def __init__(self, rank: int, role: str, stream=None, clock=time.monotonic):
        self.rank, self.role, self.clock = rank, role, clock
        self.stream = stream if stream is not None else sys.stderr
        self.start = self.clock()
        self.what, self.since, self.printed, self.beats = None, self.start, self.start, 0

    def record(self, what: str) -> None:
        now = self.clock()
        if what != self.what:
            self.what, self.since, self.printed, self.beats = what, now, now, 1
            self._print(now, what)
            return
        self.beats += 1
        if now - self.printed >= ACTIVITY_REMINDER_S:
            self.printed = now
            self._print(now, f"still {what} ({now - self.since:.0f} s, {self.beats} beats)")

    def _print(self, now: float, text: str) -> None:
        print(
            f"megarl activity: rank {self.rank} ({self.role}) +{now - self.start:.1f}s: {text}",
            file=self.stream,
            flush=True,
        )


class Heartbeat:
    def __init__(self, store, rank: int, world_size: int, role: str, timeout_s: float, min_interval_s: float = 1.0):
        self.store, self.rank, self.world_size, self.role = store, rank, world_size, role
        self.timeout_s, self.min_interval_s = timeout_s, min_interval_s
        self.count, self.last = 0, 0.0
        self.host = socket.gethostname()
        self.activity = ActivityLog(rank, role) if os.environ.get(LOG_ACTIVITY_ENV) == "1" else None
        self.beat("starting", force=True)
        failure.announce_role(role)  # the local launcher names a rank killed outright by this
        self._stop = threading.Event()
        self._read_since: Optional[float] = None  # when the watcher's pending store read began
        self._store_host_entry = ""  # rank 0's entry as last read: it hosts the store
        self.interval_s = max(0.5, min(10.0, timeout_s / 4))
        self.store.set(PULSE_KEY.format(rank), "0")
        threading.Thread(target=self._pulse, name="megarl-pulse", daemon=True).start()

    def watch(self) -> None:
        """Start this rank's watcher thread. Called once the job's start-up is over: loading a
        405B checkpoint or starting SGLang servers has its own timeouts and may take longer."""
        threading.Thread(target=self._watch, name="megarl-hang-watch", daemon=True).start()
        if self.rank != 0:  # rank 0's own threads stop with its process
            # who rank 0 is (its pid, to end it), read now: it may stop before the watcher's first read
            raw = self.store.get(KEY.format(0))
            self._store_host_entry = raw.decode() if isinstance(raw, bytes) else str(raw)
            threading.Thread(target=self._watch_store_host, name="megarl-store-watch", daemon=True).start()

    def _pulse(self) -> None:
        """This process still runs (not: still makes progress); see the module's docstring."""
        count = 0
        while not self._stop.wait(self.interval_s):
            count += 1
            try:
                self.store.set(PULSE_KEY.format(self.rank), str(count))
            except Exception:  # the store's host went away: the launcher reports that failure
                return

    def beat(self, what: str, force: bool = False, waiting: bool = False) -> None:
        """Record progress; ``waiting``: about to wait for other ranks (quiet until they come)."""
        if self.activity is not None:  # every beat, before the store's rate limit
            self.activity.record(what)
        now = time.monotonic()
        if not force and now - self.last < self.min_interval_s:
            return
        self.last, self.count = now, self.count + 1
        self.store.set(
            KEY.format(self.rank), f"{self.count}|{self.role}|{self.host}|{os.getpid()}|{int(waiting)}|{what}"
        )

    def close(self) -> None:
        """This rank's loop is over: never judged again (peers may still be saving)."""
        self._stop.set()
        try:
            self.store.set(KEY.format(self.rank), f"{self.count + 1}|{self.role}|{self.host}|{os.getpid()}|2|done")
        except Exception:  # the store's host may already be gone at the very end
            pass

    # -- the watcher ----------------------------------------------------------------------------

    def _watch(self) -> None:
        n = self.world_size
        keys = [KEY.format(r) for r in range(n)] + [PULSE_KEY.format(r) for r in range(n)]
        # key index -> (its value, when it last changed, by our clock)
        seen: Dict[int, Tuple[str, float]] = {}
        while not self._stop.wait(self.interval_s):
            self._read_since = time.monotonic()  # timed by _watch_store_host
            try:
                values = self.store.multi_get(keys)  # both exist from each rank's start (__init__)
            except Exception:  # the store's host went away: the launcher reports that failure
                return
            finally:
                self._read_since = None
            now = time.monotonic()
            for index, raw in enumerate(values):
                value = raw.decode() if isinstance(raw, bytes) else str(raw)
                if index not in seen or seen[index][0] != value:
                    seen[index] = (value, now)
            self._store_host_entry = seen[0][0]
            frozen = {rank for rank in range(n) if now - seen[n + rank][1] > 3 * self.interval_s}
            stuck = self._stuck({rank: seen[rank] for rank in range(n)}, now, frozen)
            if stuck is not None and not self._stop.is_set():
                self._end_job(*stuck)

    def _watch_store_host(self) -> None:
        while not self._stop.wait(self.interval_s):
            store_host_failure = self._store_host_stopped(time.monotonic())
            if store_host_failure is not None and not self._stop.is_set():
                self._end_job(*store_host_failure)

    def _end_job(self, message: str, host: str, pid: int) -> None:
        """End the job naming the hung rank; kill it first if it runs on this host (another process):
        a stopped process ignores the launcher's SIGTERM, so the job would not end now."""
        if host == self.host and pid > 0 and pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        failure.fail_rank(message)

    def _store_host_stopped(self, now: float) -> Optional[Tuple[str, str, int]]:
        """The message naming rank 0, if the watcher's store read has waited longer than the timeout."""
        since = self._read_since
        if since is None or now - since <= self.timeout_s:
            return None
        parts = self._store_host_entry.split("|", 5)
        role, host, pid, what = (parts[1], parts[2], parts[3], parts[5]) if len(parts) == 6 else ("?", "?", "0", "?")
        message = (
            f"rank 0 ({role}, pid {pid} on {host}) made no progress for {now - since:.0f} s "
            f"(run.hang_timeout_s={self.timeout_s:g}): it hosts the job's store, and the store has not "
            f"answered since; its process stopped running (e.g. SIGSTOP or a debugger) or its host is "
            f"unreachable; its last activity: {what}"
        )
        return message, host, int(pid)

    def _stuck(
        self, seen: Dict[int, Tuple[str, float]], now: float, frozen: Set[int] = frozenset()
    ) -> Optional[Tuple[str, str, int]]:
        """The rank to name, if the job hangs: ``seen`` maps rank -> (its progress entry, when it last
        changed); ``frozen``: ranks whose process stopped pulsing."""
        live = {rank: entry for rank, entry in seen.items() if entry[0].split("|", 5)[4] != "2"}  # 2: done
        quiet = [
            (value.split("|", 5)[4] == "1", changed, rank, value)
            for rank, (value, changed) in live.items()
            if now - changed > self.timeout_s
        ]
        working = [q for q in quiet if not q[0]]
        stopped = [q for q in quiet if q[2] in frozen]
        if not stopped and not working and len(quiet) < len(live):
            return None  # only waiting ranks are quiet: the ones they wait for are still moving
        _, changed, rank, value = min(stopped or working or quiet)
        _, role, host, pid, _, what = value.split("|", 5)
        others = len(quiet) - 1
        message = (
            f"rank {rank} ({role}, pid {pid} on {host}) made no progress for {now - changed:.0f} s "
            f"(run.hang_timeout_s={self.timeout_s:g}); its last activity: {what}"
            + (
                "; its process stopped running too (no pulse: stopped, e.g. SIGSTOP or a debugger, or starved)"
                if stopped
                else ""
            )
            + (f"; {others} other rank(s) quiet too, waiting" if others else "")
        )
        return message, host, int(pid)
