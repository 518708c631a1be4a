"""Ending a rank at once from any thread, with a message that names the fault.

A watchdog thread (e.g. the SGLang backend's server check) cannot raise into
the main thread while that thread waits inside a collective -- gloo or NCCL
would hold it until their timeout. ``fail_rank`` instead reports the message
the way a MegarlError from the main thread would be reported (the local
launcher's error file, else stderr, which torchrun shows) and exits the
process, so the launcher ends the whole job within seconds.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from pathlib import Path

REPORT_ENV = "MEGARL_ERROR_REPORT"  # set by runtime.launch for the ranks it spawns
USER_ERROR_EXIT_CODE = 2
ROLE_SUFFIX = ".role"  # beside the error report: what the rank is, read by runtime.launch


def write_report(path, text: str) -> None:
    """Write a rank's report whole or not at all: the launcher reads the error directory while other
    ranks may still be writing theirs, and a file it opened between their truncate and write read
    as empty (a launcher crashed on it: "could not convert string to float: ''")."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def announce_role(role: str) -> None:
    """Tell the local launcher what this rank is (its executor) and its pid, ahead of any failure:
    a rank killed without a word (SIGKILL, the OOM killer) writes no report, and the launcher
    would otherwise name it by number only. A no-op where no launcher of ours asked (torchrun)."""
    path = os.environ.get(REPORT_ENV)
    if path:
        try:
            Path(path).with_suffix(ROLE_SUFFIX).write_text(f"{role}, pid {os.getpid()}")
        except OSError:
            pass


def fail_rank(message: str) -> None:
    rank = os.environ.get("RANK", "?")
    path = os.environ.get(REPORT_ENV)
    if path:
        try:
            write_report(path, f"{time.time()}\n{message}")
        except OSError:
            pass
    print(f"megarl: rank {rank}: {message}", file=sys.stderr, flush=True)
    for child in multiprocessing.active_children():  # e.g. reward workers: they must not outlive the job
        child.kill()
    os._exit(USER_ERROR_EXIT_CODE)
