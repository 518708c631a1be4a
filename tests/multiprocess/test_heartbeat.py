"""The hang watchers' rule: which rank is named when ranks go quiet (runtime/heartbeat.py)."""

from megarl.runtime.heartbeat import KEY, Heartbeat


def _host_store(port, ready):
    import time

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)  # noqa: F841
    ready.set()
    time.sleep(600)


def test_a_stopped_store_host_is_named_by_the_store_watch():
    """The job's store lives in rank 0's process. Host it in a child process, let rank 0 beat through
    it, then SIGSTOP the child: the watcher's read never returns, and rank 1's store watch names
    rank 0 by its last entry after the timeout -- and not before it -- and kills the stopped process
    (on the same host), which would ignore the launcher's SIGTERM."""
    import multiprocessing
    import os
    import signal
    import socket
    import time
    from datetime import timedelta
    from unittest import mock

    import torch.distributed as dist

    from tests.conftest import server_port

    port = server_port()
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    host = ctx.Process(target=_host_store, args=(port, ready), daemon=True)
    host.start()
    named = []
    try:
        assert ready.wait(60)
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=60))
        with mock.patch("megarl.runtime.failure.fail_rank", side_effect=named.append):
            beats = [Heartbeat(store, rank, 2, f"role{rank}", timeout_s=2.0) for rank in range(2)]
            beats[0]._stop.set()  # rank 0's own threads: they would stop with its process
            # rank 0's entry names the store's process, as in a job (the store lives in rank 0)
            store.set(KEY.format(0), f"5|role0|{socket.gethostname()}|{host.pid}|0|training step 3")
            beats[1].watch()
            time.sleep(3 * beats[1].interval_s)  # the watcher has read rank 0's entry
            assert not named
            os.kill(host.pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            deadline = stopped_at + 30
            while not named and time.monotonic() < deadline:
                time.sleep(0.1)
            beats[1]._stop.set()
        waited = time.monotonic() - stopped_at
        host.join(10)
        assert host.exitcode == -signal.SIGKILL, host.exitcode
    finally:
        host.kill()  # SIGKILL ends a stopped process too
        host.join(10)
    assert named, "the store watch named nobody"
    assert (
        named[0].startswith(f"rank 0 (role0, pid {host.pid} on {socket.gethostname()})")
        and "it hosts the job's store" in named[0]
    )
    assert "its last activity: training step 3" in named[0], named[0]
    assert 2.0 < waited < 2.0 + 4 * beats[1].interval_s + 1, waited
