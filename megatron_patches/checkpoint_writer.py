"""Make Megatron's checkpoint-writer helper process die with its rank.

Why this exists: megatron-core 0.16.1's ``filesystem_async`` collects write
results through ``mp.get_context("spawn").Manager().Queue()``, created on a
rank's first dist-checkpoint save and kept for the process's life. A
multiprocessing Manager is a server process that only stops when its owner
shuts it down at a clean exit: when a rank is killed (a crashed peer makes the
launcher terminate the job, a scheduler preempts it), the Manager is orphaned
and lives on, holding the job's stdout/stderr pipes open -- so whoever waits
for the job's output (a test, a CI step, a wrapper script) hangs.

``apply()`` creates that queue first, from a Manager started with an
initializer that sets PR_SET_PDEATHSIG (Linux): the kernel kills it when its
rank dies. Megatron uses the queue exactly as before.

When it can be deleted: when Megatron-Core's writer no longer uses a Manager,
or starts it tied to its parent.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import sys
from multiprocessing.managers import SyncManager

import megatron.core
from megatron.core.dist_checkpointing.strategies import filesystem_async

EXPECTED_MEGATRON = "0.16"


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent_pid:  # the rank died while this process started: no signal will come
            os._exit(1)


def apply() -> None:
    if not megatron.core.__version__.startswith(EXPECTED_MEGATRON):
        raise RuntimeError(
            f"megatron_patches.checkpoint_writer was written for megatron-core {EXPECTED_MEGATRON}, "
            f"found {megatron.core.__version__}: check whether it is still needed"
        )
    if not hasattr(filesystem_async, "_results_queue"):
        raise RuntimeError(
            "megatron_patches.checkpoint_writer: megatron-core no longer has "
            "filesystem_async._results_queue; this patch can probably be deleted"
        )
    if filesystem_async._results_queue is None:
        manager = SyncManager(ctx=mp.get_context("spawn"))
        manager.start(initializer=_die_with_parent, initargs=(os.getpid(),))
        filesystem_async._results_queue = manager.Queue()
