"""A failed rank ends a local world promptly, with a message naming it."""

import sys
import time

import pytest

from megarl.errors import MegarlError
from megarl.runtime.launch import run_world
from tests.conftest import ROOT, WORKERS
from tests.unit.test_launcher_vocabulary import SUITE_CACHE

sys.path.insert(0, str(WORKERS))  # the ranks' bodies: importable by the spawned children too
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
    assert (
        str(err.value) == f"rank 1 (generator replica 0, TP rank 0, pid {pid}) was killed by SIGKILL; the job stopped"
    )
    assert time.monotonic() - start < 45


def test_a_rank_function_given_by_path_runs_and_its_failure_is_named():
    """run_world("module:function", ...): the launcher need not import what its ranks run."""
    with pytest.raises(MegarlError, match=r"rank 1 failed first:(.|\n)*boom on rank one"):
        run_world("failing_rank:crash_on_rank_one", 2)


def test_megarl_trains_launcher_imports_neither_torch_nor_the_controller(tmp_path):
    """`megarl train` on one machine: its launching process only reads the config and starts the ranks,
    which import torch themselves; importing it there too cost ~4 s of CPU per launch on 2 cores."""
    import json
    import subprocess

    probe = (
        "import json, sys\n"
        "import megarl.runtime.launch as launch\n"
        "def record(fn, n, *args):\n"
        "    print(json.dumps({'fn': fn, 'n': n, 'loaded': sorted(m for m in ('torch', 'transformers', "
        "'megatron.core', 'megarl.loop.controller') if m in sys.modules)}))\n"
        "    raise SystemExit(0)\n"
        "launch.run_world = record\n"
        "from megarl.cli import main\n"  # the `megarl` command's own entry point, its parser included
        f"main(['train', '--config', 'configs/tiny_cpu.yaml', 'run.output_dir={tmp_path / 'run'}'])\n"
    )
    from megarl.model_source import _smollm2_tokenizer
    from tests.conftest import _env

    _smollm2_tokenizer(SUITE_CACHE)  # written once per cache (by transformers, which imports torch)
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "fn": "megarl.loop.controller:run_rank",
        "n": 3,
        "loaded": [],
    }


def test_a_stopped_rank_is_killed_at_once_not_after_the_grace():
    """Ending a job: a SIGSTOPped rank would hold the launcher's SIGTERM until the grace ran out
    (30 s); it is killed at once, and a running one still gets SIGTERM first."""
    import multiprocessing
    import os
    import signal

    from megarl.runtime import launch

    ctx = multiprocessing.get_context("spawn")
    stopped, running = ctx.Process(target=time.sleep, args=(600,)), ctx.Process(target=time.sleep, args=(600,))
    stopped.start(), running.start()
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not launch._stopped(stopped.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert launch._stopped(stopped.pid) and not launch._stopped(running.pid)
        start = time.monotonic()
        launch._end_all([stopped, running])
        assert time.monotonic() - start < launch.TERMINATE_GRACE_S / 3
        assert stopped.exitcode == -signal.SIGKILL and running.exitcode == -signal.SIGTERM
    finally:
        for p in (stopped, running):
            p.kill()
            p.join(5)
