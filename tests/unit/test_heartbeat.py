"""The hang watchers' rule: which rank is named when ranks go quiet (runtime/heartbeat.py)."""

from megarl.runtime.heartbeat import Heartbeat


def watcher(timeout_s=10.0):
    hb = Heartbeat.__new__(Heartbeat)  # the rule only: no store, no thread
    hb.timeout_s = timeout_s
    return hb


def entry(rank, flag, what):  # count|role|host|pid|flag|activity; flag 1: waiting for peers, 2: done
    return f"7|role{rank}|host{rank}|{100 + rank}|{flag}|{what}"


def test_the_quiet_working_rank_is_named_not_the_ranks_waiting_for_it():
    seen = {
        0: (entry(0, 1, "gathering batch 3"), 0.0),
        1: (entry(1, 0, "decoding"), 5.0),
        2: (entry(2, 0, "decoding"), 19.0),
    }
    message, host, pid = watcher()._stuck(seen, now=20.0)
    assert message.startswith("rank 1 (role1, pid 101 on host1) made no progress for 15 s")
    assert "its last activity: decoding" in message and (host, pid) == ("host1", 101)


def test_no_hang_while_the_awaited_ranks_still_move():
    seen = {0: (entry(0, 1, "gathering batch 3"), 0.0), 1: (entry(1, 0, "decoding"), 15.0)}
    assert watcher()._stuck(seen, now=20.0) is None
    # a working rank quiet for exactly the timeout is not yet stuck
    assert watcher()._stuck({0: (entry(0, 0, "training"), 10.0)}, now=20.0) is None


def test_all_ranks_waiting_is_a_deadlock_naming_the_longest_waiting():
    seen = {0: (entry(0, 1, "weight sync"), 2.0), 1: (entry(1, 1, "gathering batch 3"), 1.0)}
    message, _, pid = watcher()._stuck(seen, now=20.0)
    assert message.startswith("rank 1 ") and pid == 101 and "1 other rank(s) quiet too" in message


def test_finished_ranks_are_never_judged():
    seen = {0: (entry(0, 2, "done"), 0.0), 1: (entry(1, 0, "saving"), 15.0)}
    assert watcher()._stuck(seen, now=20.0) is None


def test_a_stopped_process_is_named_before_peers_that_waited_longer():
    """All three wait in a weight sync; rank 2's process stopped (SIGSTOP) after it got there: the
    progress entries alone would name rank 0, waiting longest; rank 2's pulse stopped, so it is named."""
    seen = {
        0: (entry(0, 1, "weight sync"), 1.0),
        1: (entry(1, 1, "weight sync"), 2.0),
        2: (entry(2, 1, "weight sync"), 3.0),
    }
    message, _, pid = watcher()._stuck(seen, now=20.0)
    assert message.startswith("rank 0 ") and "stopped running" not in message
    message, _, pid = watcher()._stuck(seen, now=20.0, frozen={2})
    assert message.startswith("rank 2 ") and pid == 102 and "its process stopped running too" in message
    assert "2 other rank(s) quiet too" in message


def test_a_stopped_waiting_rank_is_a_hang_while_its_peers_still_move():
    seen = {0: (entry(0, 0, "training step 4"), 19.0), 1: (entry(1, 1, "waiting for the trainer's step"), 2.0)}
    assert watcher()._stuck(seen, now=20.0) is None
    message, _, pid = watcher()._stuck(seen, now=20.0, frozen={1})
    assert message.startswith("rank 1 ") and pid == 101
    # a frozen pulse alone is no hang: the rank's progress is recent
    assert watcher()._stuck(seen, now=20.0, frozen={0}) is None


def test_the_watcher_sees_a_stopped_pulse_through_the_store():
    """The threads against a real TCPStore: rank 1's pulse thread ends (its process 'stops'); the
    watcher on rank 0 names rank 1 although rank 0 has waited longer."""
    import time
    from unittest import mock

    import torch.distributed as dist

    from tests.conftest import server_port

    store = dist.TCPStore("127.0.0.1", server_port(), 2, is_master=True, wait_for_workers=False)
    named = []
    with mock.patch("megarl.runtime.failure.fail_rank", side_effect=named.append):
        beats = [Heartbeat(store, rank, 2, f"role{rank}", timeout_s=2.0) for rank in range(2)]
        beats[0].beat("weight sync", force=True, waiting=True)
        time.sleep(0.3)
        beats[1].beat("weight sync", force=True, waiting=True)
        beats[1]._stop.set()  # its pulse thread ends, as if SIGSTOPped (its entry stays "waiting")
        beats[0].watch()
        deadline = time.monotonic() + 30
        while not named and time.monotonic() < deadline:
            time.sleep(0.1)
        beats[0]._stop.set()
    assert named and named[0].startswith("rank 1 (role1") and "stopped running" in named[0], named


def test_activity_log_prints_changes_and_reminds_while_an_activity_lasts():
    """MEGARL_LOG_ACTIVITY's log: a line per change of activity, and one every 30 s of the same
    activity with its beat count (a slow step keeps counting decode steps; a hang stops printing)."""
    import io

    from megarl.runtime.heartbeat import ActivityLog

    now, out = [100.0], io.StringIO()
    log = ActivityLog(3, "generator", stream=out, clock=lambda: now[0])
    for t, what in [(0, "starting"), (1, "decoding"), (2, "decoding"), (20, "decoding"), (31.5, "decoding")]:
        now[0] = 100.0 + t
        log.record(what)
    now[0] = 140.0
    log.record("waiting for the trainer's step")
    assert out.getvalue().splitlines() == [
        "megarl activity: rank 3 (generator) +0.0s: starting",
        "megarl activity: rank 3 (generator) +1.0s: decoding",
        "megarl activity: rank 3 (generator) +31.5s: still decoding (30 s, 4 beats)",
        "megarl activity: rank 3 (generator) +40.0s: waiting for the trainer's step",
    ]
