"""An SGLang server process started by the job (``generator.backend: sglang`` without URLs).

Each generator replica's first rank starts ``python -m sglang.launch_server``
for its replica (or the executable in ``generator.sglang_launcher``), with
its output in ``RUN_DIR/sglang/replica<r>.log``, waits until ``/health``
answers, and stops it with the job: on a normal exit, on an error (``stop``
from ``close``/atexit), and when the rank itself is killed (the server is
started with PR_SET_PDEATHSIG, so the kernel kills it with its parent).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from megarl.errors import MegarlError
from megarl.generator.sglang.http_backend import get_ok


class SglangLaunchError(MegarlError):
    """A launched SGLang server did not come up; names the server and its log."""


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    os.setsid()  # its own process group: stop() reaches SGLang's scheduler/detokenizer children too


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_for_attached(url: str, name: str, timeout_s: float) -> None:
    """An attached server may still be loading when the job starts: wait for /health."""
    deadline = time.monotonic() + timeout_s
    while not get_ok(url, "/health", timeout_s=5):
        if time.monotonic() > deadline:
            raise SglangLaunchError(
                f"{name} did not answer /health within {timeout_s:.0f} s "
                f"(generator.sglang_startup_timeout_s); is it started, and is the URL right?"
            )
        time.sleep(1.0)


class SglangServer:
    def __init__(self, cmd: List[str], env: Dict[str, str], log_path: Path, url: str, name: str):
        self.cmd, self.url, self.name, self.log_path = cmd, url, name, Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self._log.write(("$ " + " ".join(cmd) + "\n").encode())
        self._log.flush()
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
        atexit.register(self.stop)

    def exited(self, wait_s: float = 0.0) -> Optional[int]:
        """Its exit code, or None while it runs (waiting up to ``wait_s`` for it to be reaped)."""
        if wait_s:
            try:
                return self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                return None
        return self.proc.poll()

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SglangLaunchError(
                    f"{self.name} exited with code {self.proc.returncode} while starting; "
                    f"its log ({self.log_path}) ends with:\n{_log_tail(self.log_path)}"
                )
            if get_ok(self.url, "/health", timeout_s=5):
                return
            time.sleep(0.5)
        self.stop()
        raise SglangLaunchError(
            f"{self.name} did not answer /health within {timeout_s:.0f} s "
            f"(generator.sglang_startup_timeout_s); see its log {self.log_path}:\n"
            f"{_log_tail(self.log_path)}"
        )

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=grace_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        if not self._log.closed:
            self._log.close()
