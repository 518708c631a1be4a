"""Start a world of worker ranks the way torchrun's workers see it, without torchrun's agent.

torchrun's agent is a process of its own that imports torch and its elastic
machinery (~3 s of CPU on a 2-core machine) before any worker starts; the tests
start ~20 worlds. Here each rank is started directly with the variables torchrun
gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT; rank 0 hosts the TCP store, as it does under torchrun without the
agent's store). As under torchrun, the first rank to fail ends the world. What
torchrun itself does is tested where it matters to users (test_launch_script.py).
Each rank writes to its own file: a rank blocked on a full pipe would hang its peers.

Ranks are forked from one server process per test session that has imported
torch, Megatron-Core and the megarl modules the workers use (PRELOAD): each
`python worker.py` spent 4-6 s of CPU importing them, ~100 ranks in all, up to 12
at once on 2 cores. A forked rank then runs its script as `python script.py`
would (runpy, sys.argv, the script's directory first on sys.path, the world's
environment). What the preloaded modules read from the environment when they
were imported (thread counts, warning filters, the module path) is the server's:
a world whose environment differs there starts its ranks as plain processes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence

# What tests/workers/*.py import. With one OpenMP thread (the tests' OMP_NUM_THREADS=1) none of
# it starts a thread, so the forked ranks inherit no thread pool a fork would leave half-made.
PRELOAD = [
    "torch",
    "torch.distributed",
    "safetensors.torch",
    "megatron.core.models.gpt",
    "megatron.core.pipeline_parallel",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "megatron.core.dist_checkpointing",
    "megarl.runtime.distributed",
    "megarl.checkpointing.model_loading",
    "megarl.models.megatron_model",
    "megarl.checkpointing.megatron_checkpoint",
    "megarl.checkpointing.training_checkpoint",
    "megarl.trainer.setup",
    "megarl.trainer.policy_trainer",
    "megarl.executors.trainer",
    "megarl.weight_sync.endpoints",
    "megarl.weight_sync.transport",
    "megarl.generator.torch_engine.engine",
]


def _read_at_import(env: dict) -> dict:
    """The variables torch, OpenMP/MKL and Python itself read when the server imports PRELOAD."""
    return {
        k: v
        for k, v in env.items()
        if k.startswith(("OMP_", "MKL_", "KMP_", "GOMP_", "TORCH", "PYTORCH", "PYTHON", "NVTE_", "CUDA_"))
    }


class _ForkServer:
    """multiprocessing's forkserver, started once with a given environment and PRELOAD."""

    def __init__(self):
        self._ctx = None
        self._env = None

    def context(self, env: dict):
        """The forkserver context, or None if this environment differs from the server's at import
        time or asks for more than one OpenMP thread (torch would start its pool before the fork)."""
        if env.get("OMP_NUM_THREADS") != "1":
            return None
        if self._ctx is None:
            import multiprocessing
            from multiprocessing import forkserver

            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            saved = dict(os.environ)
            os.environ.clear()
            os.environ.update(env)
            try:
                forkserver.ensure_running()
            finally:
                os.environ.clear()
                os.environ.update(saved)
            self._ctx, self._env = ctx, _read_at_import(env)
        return self._ctx if _read_at_import(env) == self._env else None


_SERVER = _ForkServer()


def _run_script(script: str, args: list, env: dict, cwd: str, out: str, err: str) -> None:
    """In a forked rank: run ``script`` as ``python script args`` would."""
    import atexit
    import runpy

    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # multiprocessing ends its children with os._exit


class _Rank:
    """One rank: a forked process or a plain one, behind Popen's poll / kill / wait."""

    def __init__(self, ctx, script: Path, args: list, env: dict, cwd: Path, out: Path, err: Path):
        if ctx is not None:
            self._process = ctx.Process(target=_run_script, args=(str(script), args, env, str(cwd), str(out), str(err)))
            self._process.start()
            self._popen = None
        else:
            with open(out, "w") as o, open(err, "w") as e:
                self._popen = subprocess.Popen(
                    [sys.executable, str(script), *args], cwd=cwd, env=env, stdout=o, stderr=e
                )

    def poll(self) -> Optional[int]:
        return self._popen.poll() if self._popen else self._process.exitcode

    def kill(self) -> None:
        if self.poll() is None:
            (self._popen or self._process).kill()

    def wait(self) -> None:
        if self._popen:
            self._popen.wait()
        else:
            self._process.join()


class LocalWorld:
    def __init__(self, nproc: int, script: Path, args: Sequence, env: dict, cwd: Path, port: int):
        self.command = f"{script.name} x{nproc}: {' '.join(map(str, args))}"
        self._logs = Path(tempfile.mkdtemp(prefix="megarl_world_"))
        ctx = _SERVER.context(env)
        self._ranks: List[_Rank] = []
        for rank in range(nproc):
            rank_env = dict(
                env,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            self._ranks.append(
                _Rank(
                    ctx,
                    script,
                    [str(a) for a in args],
                    rank_env,
                    cwd,
                    self._logs / f"rank{rank}.out",
                    self._logs / f"rank{rank}.err",
                )
            )

    def poll(self) -> Optional[int]:
        """None while running; 0 once every rank exited 0; else the first failure's exit code
        (the other ranks are then killed, as torchrun's agent does)."""
        codes = [r.poll() for r in self._ranks]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            self.kill()
            return failed[0]
        return 0 if all(c == 0 for c in codes) else None

    def wait(self, timeout: float) -> int:
        import time

        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None:
            if time.monotonic() > deadline:
                self.kill()
                raise subprocess.TimeoutExpired(self.command, timeout)
            time.sleep(0.1)
        return code

    def kill(self) -> None:
        for r in self._ranks:
            r.kill()
        for r in self._ranks:
            r.wait()

    def output(self) -> tuple:
        """(stdout, stderr): every rank's, in rank order."""
        outs = "".join((self._logs / f"rank{r}.out").read_text() for r in range(len(self._ranks)))
        errs = "".join((self._logs / f"rank{r}.err").read_text() for r in range(len(self._ranks)))
        return outs, errs

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self._logs, ignore_errors=True)
