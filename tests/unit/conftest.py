"""Unit tests start no processes: no ranks, servers, worker pools or subprocesses (tests/multiprocess/
holds those). A unit test that starts one fails here, naming what it started, so the quick suite
(`make test-quick`, these tests alone) stays fast on 2 cores.

One exception: the C compiler that builds megarl's CPU kernels on first use
(megarl/generator/torch_engine/native.py: about a second, cached on disk) is a build step the kernels'
tests need, not a process they run against."""

import multiprocessing.process
import os
import subprocess
from pathlib import Path

import pytest

_popen_init = subprocess.Popen.__init__
COMPILERS = {c for c in (os.environ.get("CC"), "cc", "gcc") if c}


class ProcessStarted(AssertionError):
    pass


def _refuse(what):
    def refuse(*args, **kwargs):
        raise ProcessStarted(f"a unit test started {what}: move it to tests/multiprocess/")

    return refuse


def _popen_compiler_only(self, args, *rest, **kwargs):
    argv = [args] if isinstance(args, (str, os.PathLike)) else list(args)
    if argv and Path(str(argv[0])).name in COMPILERS:
        return _popen_init(self, args, *rest, **kwargs)
    raise ProcessStarted(
        f"a unit test started a subprocess ({' '.join(map(str, argv))[:120]}): move it to tests/multiprocess/"
    )


@pytest.fixture(autouse=True)
def no_processes(monkeypatch):
    monkeypatch.setattr(subprocess.Popen, "__init__", _popen_compiler_only)
    monkeypatch.setattr(os, "fork", _refuse("a fork"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse("a multiprocessing process"))
