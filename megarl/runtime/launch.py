"""Start a local world of N ranks for tools run without torchrun.

``run_world(fn, n, *args)`` spawns n processes (spawn, not fork: each child
imports cleanly), gives each the RANK/WORLD_SIZE/MASTER_* variables torchrun
would, and runs ``fn(*args)`` in it. If any rank fails, the others are
terminated and a MegarlError names the rank at fault: for a user error
(MegarlError) its one-line message, otherwise the traceback of the rank that
failed first -- not a peer that merely saw its connection drop. A crashed rank
ends the job with a message, never a hang.

Because children are spawned, the calling script is re-imported in each of
them: guard its entry point with ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch.multiprocessing as mp

from megarl.errors import MegarlError
from megarl.runtime.distributed import free_port

USER_ERROR_EXIT_CODE = 2


def running_under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _child(local_rank: int, world_size: int, port: int, fn: Callable, args: tuple, error_dir: str) -> None:
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    report = Path(error_dir) / f"rank{local_rank}"
    try:
        fn(*args)
    except MegarlError as err:
        report.with_suffix(".user").write_text(str(err))
        sys.exit(USER_ERROR_EXIT_CODE)
    except BaseException:
        report.with_suffix(".crash").write_text(f"{time.time()}\n{traceback.format_exc()}")
        raise


def _failure_message(error_dir: Path, fallback: str) -> str:
    user = sorted(error_dir.glob("*.user"))
    if user:
        return f"rank {user[0].stem[4:]}: {user[0].read_text()}"
    crashes = []
    for path in error_dir.glob("*.crash"):
        stamp, _, text = path.read_text().partition("\n")
        crashes.append((float(stamp), path.stem, text))
    if crashes:
        _, rank, text = min(crashes)
        return f"rank {rank[4:]} failed first:\n{text}"
    return fallback


def run_world(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Run ``fn(*args)`` on ``world_size`` local ranks; raise if any rank fails."""
    if world_size == 1 and not running_under_torchrun():
        fn(*args)
        return
    # Ranks share this machine's cores: split them rather than oversubscribe
    # (children read this when torch starts, before any of our code runs).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    with tempfile.TemporaryDirectory(prefix="megarl_ranks_") as error_dir:
        try:
            mp.start_processes(
                _child,
                args=(world_size, free_port(), fn, args, error_dir),
                nprocs=world_size,
                join=True,
                start_method="spawn",
            )
        except mp.ProcessRaisedException as err:
            raise MegarlError(_failure_message(Path(error_dir), f"rank {err.error_index} failed:\n{err}")) from None
        except mp.ProcessExitedException as err:
            fallback = f"rank {err.error_index} exited with code {err.exit_code} (signal {err.signal_name})"
            raise MegarlError(_failure_message(Path(error_dir), fallback)) from None
