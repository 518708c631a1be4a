"""Free TCP ports for a job on this machine, without importing torch (launchers pick them before any rank starts).

A job listens on three consecutive ports: MASTER_PORT (torchrun's rendezvous; megarl's own launcher leaves it
unused), MASTER_PORT + 1 (megarl's job store, runtime/job.py) and MASTER_PORT + 2 (the SGLang weight-sync
rendezvous, weight_sync/factory.py). ``free_port`` returns a MASTER_PORT whose three ports are all free.

Why not bind port 0: the kernel hands that out from its ephemeral range (net.ipv4.ip_local_port_range,
32768-60999 by default), the range every outgoing connection (gloo's pairs, store clients, HTTP) also takes its
local port from. Rank 0 binds the store seconds after the check (its imports), and in between another
socket took the port: a CI run failed so, EADDRINUSE on MASTER_PORT + 1. Ports below the ephemeral range are
only ever taken by an explicit bind, so a random free one stays free; a port handed out once by this process is
never handed out again (two jobs started in a row get distinct ports)."""

from __future__ import annotations

import random
import socket

PORTS_PER_JOB = 3  # MASTER_PORT, + 1 job store, + 2 SGLang weight-sync rendezvous
_LOWEST = 20000  # above the well-known and registered services a machine is likely to run
_handed_out: set = set()


def ephemeral_range() -> tuple:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _all_free(base: int, count: int) -> bool:
    for port in range(base, base + count):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                return False
    return True


def free_port(count: int = PORTS_PER_JOB) -> int:
    """The first of ``count`` consecutive free ports, below the ephemeral range where it has room."""
    lo, hi = ephemeral_range()
    if lo - count > _LOWEST:
        candidates = random.sample(range(_LOWEST, lo - count), min(400, lo - count - _LOWEST))
    else:  # an ephemeral range that starts low: take free ports above it, less safe but free when checked
        candidates = random.sample(range(max(hi + 1, _LOWEST), 65536 - count), 400)
    for base in candidates:
        block = set(range(base, base + count))
        if block & _handed_out or not _all_free(base, count):
            continue
        _handed_out.update(block)
        return base
    raise RuntimeError(
        f"no {count} consecutive free TCP ports found below the ephemeral range ({lo}-{hi}); "
        "set MASTER_PORT (and generator.sglang_sync_port) explicitly"
    )
