"""Rank bodies for tests/multiprocess/test_launch.py (importable by spawned children)."""

import os
import time

from megarl.errors import ConfigError


def crash_on_rank_one():
    from megarl.runtime.distributed import init_distributed

    init_distributed()
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("boom on rank one")
    dist.barrier()  # rank 0 would wait here forever without the launcher's teardown


def user_error_on_rank_two():
    if os.environ["RANK"] == "2":
        raise ConfigError("field 'x' is bad")
    time.sleep(60)


def killed_after_announcing():
    """Rank 1 says what it is (as the controller's heartbeat does), then dies without a word."""
    import signal

    from megarl.runtime.failure import announce_role

    announce_role("generator replica 0, TP rank 0" if os.environ["RANK"] == "1" else "trainer")
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
