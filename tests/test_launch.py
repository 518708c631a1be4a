"""A failed rank ends a local world promptly, with a message naming it."""

import sys
import time

import pytest

from megarl.errors import MegarlError
from megarl.runtime.launch import run_world
from tests.conftest import WORKERS

sys.path.insert(0, str(WORKERS))
import failing_rank  # noqa: E402


def test_crashed_rank_is_named_and_nobody_hangs():
    start = time.monotonic()
    with pytest.raises(MegarlError, match=r"rank 1 failed first:(.|\n)*boom on rank one"):
        run_world(failing_rank.crash_on_rank_one, 2)
    assert time.monotonic() - start < 60


def test_user_error_in_a_rank_is_one_line():
    start = time.monotonic()
    with pytest.raises(MegarlError) as err:
        run_world(failing_rank.user_error_on_rank_two, 3)
    assert str(err.value) == "rank 2: field 'x' is bad"
    assert time.monotonic() - start < 45


def test_killed_rank_is_named_with_the_role_it_announced():
    """A rank killed outright writes no report: the launcher names it by what it announced at start-up."""
    start = time.monotonic()
    with pytest.raises(MegarlError) as err:
        run_world(failing_rank.killed_after_announcing, 2)
    pid = int(str(err.value).split("pid ", 1)[1].split(")", 1)[0])
    assert str(err.value) == f"rank 1 (generator replica 0, TP rank 0, pid {pid}) was killed by SIGKILL; the job stopped"
    assert time.monotonic() - start < 45
