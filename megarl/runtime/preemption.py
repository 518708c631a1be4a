"""Preemption: SIGTERM or SIGUSR1 asks the job to checkpoint at the next step boundary and exit 0.

SLURM sends a signal some minutes before it kills a job (``--signal``, see
scripts/slurm.sbatch); an operator may send one by hand. Whichever process gets
it -- the local launcher (``megarl train`` spawning its ranks), scripts/launch.sh,
or a rank -- the ranks end up with a flag set:

- a rank's handler only sets the flag (a signal handler must not touch sockets
  or collectives); the controller agrees on it over all ranks at each step
  boundary (``any_rank_requested``), so every rank saves the same step and stops;
- a launcher forwards the signal to its ranks as SIGUSR1. A rank started by a
  launcher handles SIGUSR1 only: SIGTERM stays the launchers' way to end a rank
  at once (the local launcher and torchrun send it to the survivors when a rank fails);
- a second signal to the same process ends it at once (exit 128 + signal number);
- Ctrl-C (SIGINT) is a request like SIGTERM. The terminal sends it to the launcher and to every rank
  of its process group at once, so a rank gets it twice over (its own SIGINT and the launcher's
  SIGUSR1, in either order): that pair counts as one request, and a second Ctrl-C ends the job at once.

The same agreement carries ``run.time_budget_min``: the trainer's first rank (rank 0)
owns the budget's clock and says at each step boundary whether it is spent; the
ranks then save the same step and stop exactly as for a signal (``agree_stop``).
So does ``health.action: stop``: the trainer's first rank, which writes the metrics,
says whether its health watch calls for a stop (megarl/health.py).

Under torchrun, signal the ranks (or scripts/launch.sh, which forwards): torchrun
answers SIGTERM itself by killing its workers after 30 s, before a long step ends.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Callable, Optional

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# what a rank started by a launcher handles: the launcher's SIGUSR1, and Ctrl-C's SIGINT that reaches
# the rank directly (SIGTERM stays the launchers' way to end a rank at once)
RANK_SIGNALS = (signal.SIGUSR1, signal.SIGINT)
_ONE_CTRL_C = {"SIGINT", "SIGUSR1"}

_requested: Optional[str] = None  # the name of the first signal received
_paired = False  # a Ctrl-C's SIGINT and its forwarded SIGUSR1 both arrived: still one request


def requested() -> Optional[str]:
    return _requested


def install(forward: Optional[Callable[[int], None]] = None, signals=SIGNALS) -> None:
    """Handle ``signals`` in this process (main thread only). ``forward(signum)``: a launcher's
    way to pass the request to its ranks."""

    def handler(signum, frame):
        global _requested, _paired
        name = signal.Signals(signum).name
        who = f"megarl: rank {os.environ['RANK']}" if "RANK" in os.environ else "megarl"
        if _requested is not None and not _paired and {_requested, name} == _ONE_CTRL_C and forward is None:
            _paired = True  # the other half of one Ctrl-C in a rank
            return
        if _requested is not None:
            print(f"{who}: second signal ({name}) after {_requested}: exiting now", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        _requested = name
        print(
            f"{who}: {name} received: the job saves a checkpoint at the next step boundary and exits "
            f"(a second signal exits at once)",
            file=sys.stderr,
            flush=True,
        )
        if forward is not None:
            forward(signum)

    for sig in signals:
        signal.signal(sig, handler)


def agree_stop(group, budget_reached: bool = False, unhealthy: bool = False) -> Optional[str]:
    """Why the job stops at this step boundary, the same on every rank of ``group`` (a collective:
    all ranks call it): "preempted" if any rank got a signal, else "health" if any rank's health
    watch says stop (``unhealthy``: health.action=stop, megarl/health.py), else "time_budget" if
    any rank says the time budget is spent (``budget_reached``), else None."""
    # torch here, not at the top: the `megarl train` launcher installs these handlers (runtime/launch.py)
    # and must not import torch (tests/multiprocess/test_launch.py: ~4 s of CPU per launch on 2 cores)
    import torch
    import torch.distributed as dist

    flags = torch.tensor([1 if _requested is not None else 0, 1 if budget_reached else 0, 1 if unhealthy else 0])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    if flags[0].item():
        return "preempted"
    if flags[2].item():
        return "health"
    return "time_budget" if flags[1].item() else None
