"""Start a local world of N ranks for tools run without torchrun.

``run_world(fn, n, *args)`` spawns n processes (spawn, not fork: each child
imports cleanly), gives each the RANK/WORLD_SIZE/MASTER_* variables torchrun
would, and runs ``fn(*args)`` in it. ``fn`` is a function or its path,
``"package.module:function"``: by path, the launching process never imports
what the ranks run -- ``megarl train``'s launcher then never imports torch
(~4 s of CPU before any rank could start, on a 2-core machine; the ranks import
it anyway), and it spawns through the standard library's multiprocessing for
the same reason. If any rank fails, the others are terminated and a MegarlError
names the rank at fault: for a user error (MegarlError) its one-line message,
otherwise the traceback of the rank that failed first -- not a peer that merely
saw its connection drop. A crashed rank ends the job with a message, never a hang.

Because children are spawned, the calling script is re-imported in each of
them: guard its entry point with ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable, List, Tuple, Union

from megarl.errors import MegarlError
from megarl.runtime import preemption
from megarl.runtime.failure import REPORT_ENV, ROLE_SUFFIX, USER_ERROR_EXIT_CODE, write_report
from megarl.runtime.ports import free_port


def running_under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


_forking_pid = 0  # set just before this process forks (os.register_at_fork), read in the child


def _die_with_parent(parent_pid: int) -> None:
    """Linux: this rank gets SIGKILL when the launching process dies (killed, Ctrl-C'd), so no rank
    outlives the job holding cores, ports and the job's stdout/stderr -- and so does every process the
    rank forks: a fork does not inherit the setting, and Megatron's checkpoint writer forks its
    write workers (one left behind by a rank killed mid-save held a test's pipes open)."""
    if not sys.platform.startswith("linux"):
        return
    prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl

    def arm(expected_parent: int) -> None:
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != expected_parent:  # it died before the line above: no signal will come
            os._exit(1)

    def before_fork() -> None:
        global _forking_pid
        _forking_pid = os.getpid()

    arm(parent_pid)
    os.register_at_fork(before=before_fork, after_in_child=lambda: arm(_forking_pid))


RankFunction = Union[Callable[..., Any], str]  # a function, or "package.module:function"

# Ranks still running when one has failed get SIGTERM (which ends a rank we spawned: it handles
# only SIGUSR1, runtime/preemption.py), then SIGKILL after this long, as torch.multiprocessing's spawn does.
TERMINATE_GRACE_S = 30.0


def _resolve(fn: RankFunction) -> Callable[..., Any]:
    if callable(fn):
        return fn
    module, _, name = fn.partition(":")
    return getattr(importlib.import_module(module), name)


def _child(index: int, worlds: list, error_dir: str, launcher_pid: int) -> None:
    _die_with_parent(launcher_pid)
    # worlds: [(fn, size, port, args)]; process ``index`` is rank index - offset of its world.
    offset = 0
    for fn, world_size, port, args in worlds:  # noqa: B007 (the matching world is used below)
        if index < offset + world_size:
            break
        offset += world_size
    local_rank = index - offset
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    report = Path(error_dir) / f"rank{index}"
    os.environ[REPORT_ENV] = str(report.with_suffix(".user"))  # runtime.failure.fail_rank writes it
    try:
        _resolve(fn)(*args)
    except MegarlError as err:
        write_report(report.with_suffix(".user"), f"{time.time()}\n{err}")
        sys.exit(USER_ERROR_EXIT_CODE)
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group; the launcher reports it
        sys.exit(130)
    except SystemExit:
        raise
    except BaseException:
        # the launcher prints this traceback in its error; exiting rather than re-raising keeps
        # multiprocessing from printing it a second time
        write_report(report.with_suffix(".crash"), f"{time.time()}\n{traceback.format_exc()}")
        sys.exit(1)


def _named(error_dir: Path, index: int) -> str:
    """'rank N (its executor, pid P)' once the rank announced itself (runtime.failure.announce_role)."""
    try:
        return f"rank {index} ({(error_dir / f'rank{index}{ROLE_SUFFIX}').read_text()})"
    except OSError:
        return f"rank {index}"


def _reports(error_dir: Path, suffix: str) -> List[Tuple[float, str, str]]:
    """(time, rank file stem, text) of each complete report; one that does not parse (a rank killed
    inside an older megarl's non-atomic write) is passed over, never a crash of the launcher."""
    found = []
    for path in error_dir.glob(f"*{suffix}"):
        try:
            stamp, _, text = path.read_text().partition("\n")
            found.append((float(stamp), path.stem, text))
        except (OSError, ValueError):
            continue
    return found


def _failure_message(error_dir: Path, fallback: str) -> str:
    """The first failure: a peer that failed because another rank vanished reports later."""
    users = _reports(error_dir, ".user")
    if users:
        _, rank, text = min(users)
        return f"rank {rank[4:]}: {text}"
    crashes = _reports(error_dir, ".crash")
    if crashes:
        _, rank, text = min(crashes)
        return f"rank {rank[4:]} failed first:\n{text}"
    return fallback


@contextlib.contextmanager
def _forwarding_preemption(pids: List[int]):
    """SIGTERM / SIGUSR1 to this launcher reach its ranks as SIGUSR1 (runtime/preemption.py)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass

    saved = {sig: signal.getsignal(sig) for sig in preemption.SIGNALS}
    preemption.install(forward)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def run_world(fn: RankFunction, world_size: int, *args: Any) -> None:
    """Run ``fn(*args)`` on ``world_size`` local ranks; raise if any rank fails."""
    if world_size == 1 and not running_under_torchrun():
        _resolve(fn)(*args)
        return
    run_worlds([(fn, world_size, args)])


def run_worlds(worlds: List[Tuple[RankFunction, int, tuple]]) -> None:
    """Run several independent worlds at once, e.g. trainer ranks and generator workers
    that meet through their own sync group. Process numbers (as named in errors) run
    through all worlds in order; each process sees only its own world's RANK/WORLD_SIZE."""
    total = sum(size for _, size, _ in worlds)
    # Ranks share this machine's cores: split them rather than oversubscribe
    # (children read this when torch starts, before any of our code runs).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // total)))
    spec = [(fn, size, free_port(), args) for fn, size, args in worlds]
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="megarl_ranks_") as error_dir:
        processes = [
            ctx.Process(target=_child, args=(index, spec, error_dir, os.getpid()), name=f"megarl-rank{index}")
            for index in range(total)
        ]
        try:
            for process in processes:
                process.start()
            with _forwarding_preemption([p.pid for p in processes]):
                failed = _wait_for_first_failure(processes)
        finally:
            _end_all(processes)
        if failed is None:
            return
        exit_code = processes[failed].exitcode
        if exit_code < 0:  # killed (OOM killer, scheduler, a user): it wrote no report, and its
            # peers' reports only say that it vanished -- name it first
            try:
                signal_name = signal.Signals(-exit_code).name
            except ValueError:
                signal_name = f"signal {-exit_code}"
            others = _failure_message(Path(error_dir), "")
            raise MegarlError(
                f"{_named(Path(error_dir), failed)} was killed by {signal_name}; the job stopped"
                + (f" (then {others.splitlines()[0]})" if others else "")
            )
        fallback = f"{_named(Path(error_dir), failed)} exited with code {exit_code}"
        raise MegarlError(_failure_message(Path(error_dir), fallback))


def _wait_for_first_failure(processes: list):
    """Block until every process has exited 0 (-> None) or one has not (-> its index)."""
    pending = {p.sentinel: i for i, p in enumerate(processes)}
    while pending:
        for sentinel in wait(list(pending)):
            index = pending.pop(sentinel)
            processes[index].join()
            if processes[index].exitcode != 0:
                return index
    return None


def _end_all(processes: list) -> None:
    """SIGTERM to every rank still running (SIGKILL to a stopped one), SIGKILL to any left after
    TERMINATE_GRACE_S."""
    alive = [p for p in processes if p.pid is not None and p.is_alive()]
    for p in alive:
        # a stopped process (SIGSTOP, a debugger) holds SIGTERM until it continues: end it now
        p.kill() if _stopped(p.pid) else p.terminate()
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join()


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (state T or t in /proc; False where there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False
