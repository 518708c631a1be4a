"""The hang watchers' rule: which rank is named when ranks go quiet (runtime/heartbeat.py)."""

from megarl.runtime.heartbeat import Heartbeat


def watcher(timeout_s=10.0):
    hb = Heartbeat.__new__(Heartbeat)  # the rule only: no store, no thread
    hb.timeout_s = timeout_s
    return hb


def entry(rank, flag, what):  # count|role|host|pid|flag|activity; flag 1: waiting for peers, 2: done
    return f"7|role{rank}|host{rank}|{100 + rank}|{flag}|{what}"


def test_the_quiet_working_rank_is_named_not_the_ranks_waiting_for_it():
    seen = {0: (entry(0, 1, "gathering batch 3"), 0.0), 1: (entry(1, 0, "decoding"), 5.0),
            2: (entry(2, 0, "decoding"), 19.0)}
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
