"""The launcher's reading of its ranks' failure reports (megarl/runtime/launch.py): the first
failure is named, and a report caught half-written never crashes the launcher. Seen in the suite
(test_sync_failure, 2026-12-07): the launcher read a .crash file between its writer's truncate and
write, and ended on "ValueError: could not convert string to float: ''" instead of naming the rank."""

from megarl.runtime.failure import write_report
from megarl.runtime.launch import _failure_message


def test_the_first_report_is_named_and_an_unparsable_one_is_passed_over(tmp_path):
    (tmp_path / "rank0.crash").write_text("")  # a rank caught between truncate and write
    write_report(tmp_path / "rank2.crash", "20.0\nTraceback: the later one")
    write_report(tmp_path / "rank1.crash", "10.0\nTraceback: the first one")
    assert _failure_message(tmp_path, "fallback") == "rank 1 failed first:\nTraceback: the first one"
    # a user error outranks any crash, and the earliest of them is named
    write_report(tmp_path / "rank3.user", "30.0\ntrainer.lr: must be > 0")
    (tmp_path / "rank4.user").write_text("not a time\nhalf")
    assert _failure_message(tmp_path, "fallback") == "rank 3: trainer.lr: must be > 0"


def test_nothing_readable_gives_the_fallback(tmp_path):
    (tmp_path / "rank0.crash").write_text("")
    assert _failure_message(tmp_path, "rank 0 exited with code -9") == "rank 0 exited with code -9"


def test_a_report_is_written_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "rank5.user"
    write_report(path, "1.5\nfirst")
    write_report(path, "2.5\nsecond")  # replaced whole, never appended or half-truncated
    assert path.read_text() == "2.5\nsecond"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank5.user"]
