"""A job's ports: three consecutive free ones, below the ephemeral range outgoing connections take theirs from."""

import socket

from megarl.runtime import ports


def test_a_job_gets_three_free_ports_below_the_ephemeral_range_and_never_the_same_twice():
    lo, hi = ports.ephemeral_range()
    bases = [ports.free_port() for _ in range(20)]
    for base in bases:
        if lo > 20000 + ports.PORTS_PER_JOB:  # Linux's default range starts at 32768
            assert base + ports.PORTS_PER_JOB <= lo
        else:  # a range that starts low leaves room only above it
            assert base > hi
        for port in range(base, base + ports.PORTS_PER_JOB):
            with socket.socket() as s:
                s.bind(("", port))  # raises if taken
    blocks = [set(range(b, b + ports.PORTS_PER_JOB)) for b in bases]
    assert all(not (a & b) for i, a in enumerate(blocks) for b in blocks[i + 1 :])


def test_a_block_with_its_store_port_taken_is_passed_over(monkeypatch):
    with socket.socket() as probe:
        probe.bind(("", 0))
        taken = probe.getsockname()[1]
    with socket.socket() as holder:  # what failed in CI: MASTER_PORT free, MASTER_PORT + 1 held by another socket
        holder.bind(("", taken))
        holder.listen()
        candidates = [taken - 1, taken + 5]
        monkeypatch.setattr(ports.random, "sample", lambda population, k: list(candidates))
        monkeypatch.setattr(ports, "_handed_out", set())
        assert ports.free_port() == taken + 5
