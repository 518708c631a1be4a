"""Start a world of worker ranks the way torchrun's workers see it, without torchrun's agent.

torchrun's agent is a process of its own that imports torch and its elastic
machinery (~3 s of CPU on a 2-core machine) before any worker starts; the tests
start ~20 worlds. Here each rank is started directly with the variables torchrun
gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT; rank 0 hosts the TCP store, as it does under torchrun without the
agent's store). As under torchrun, the first rank to fail ends the world. What
torchrun itself does is tested where it matters to users (test_launch_script.py).
Each rank writes to its own file: a rank blocked on a full pipe would hang its peers.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence


class LocalWorld:
    def __init__(self, nproc: int, script: Path, args: Sequence, env: dict, cwd: Path, port: int):
        self.command = f"{script.name} x{nproc}: {' '.join(map(str, args))}"
        self._logs = Path(tempfile.mkdtemp(prefix="megarl_world_"))
        self._procs: List[subprocess.Popen] = []
        for rank in range(nproc):
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                            LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            with open(self._logs / f"rank{rank}.out", "w") as out, open(self._logs / f"rank{rank}.err", "w") as err:
                self._procs.append(subprocess.Popen([sys.executable, str(script), *map(str, args)], cwd=cwd,
                                                    env=rank_env, stdout=out, stderr=err))

    def poll(self) -> Optional[int]:
        """None while running; 0 once every rank exited 0; else the first failure's exit code
        (the other ranks are then killed, as torchrun's agent does)."""
        codes = [p.poll() for p in self._procs]
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
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        for p in self._procs:
            p.wait()

    def output(self) -> tuple:
        """(stdout, stderr): every rank's, in rank order."""
        outs = "".join((self._logs / f"rank{r}.out").read_text() for r in range(len(self._procs)))
        errs = "".join((self._logs / f"rank{r}.err").read_text() for r in range(len(self._procs)))
        return outs, errs

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self._logs, ignore_errors=True)
