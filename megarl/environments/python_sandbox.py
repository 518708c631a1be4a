"""The built-in Python tool: a model's code run in a sandboxed subprocess, whatever it does.

Each call starts a fresh ``python -I -S sandbox_child.py`` (isolated: no site-packages, no PYTHON*
variables, an environment of PATH and TMPDIR only) in a new session and a temporary scratch
directory removed afterwards. What confines it, and what holds each limit:

- the kernel, always: CPU seconds (RLIMIT_CPU: SIGXCPU ends a busy loop), address space (RLIMIT_AS:
  a 2 GB allocation raises MemoryError), written file size (RLIMIT_FSIZE), no core files, 64 open
  files; the parent's wall-clock limit (the whole session SIGKILLed);
- the kernel, where the machine allows it (``kernel_layers``; sandbox_child.py does each step and
  names those that took): new mount and network namespaces (user namespaces for a job not run as
  root), every mount read-only but a fresh tmpfs on the scratch directory, uid ``nobody`` for a
  job run as root, RLIMIT_NPROC 1 (no process, no thread), no_new_privs;
- an audit hook (PEP 578) refusing sockets, process creation, ctypes and limit changes: a clear
  message for ordinary attempts, and where the kernel steps did not take the only block -- one that
  code in the same interpreter can take apart (tests/multiprocess/test_python_sandbox.py does).

The layers active are in every result (``SandboxResult.layers``) and logged once per process (a
warning when a kernel layer is missing). The parent reads at most ``max_output_chars`` of stdout and
of stderr from files, and turns every way the program can end badly (exception, limit, signal,
timeout) into a :class:`ToolError` whose message the model sees: a runaway program becomes an
error observation, never a stuck episode.

Not a container: with the kernel layers the program reads what its uid may read (``nobody``'s share
of the file system when the job runs as root, the job user's otherwise) and can connect to Unix
sockets on the file system that uid may write. Run the job as a user without secrets on disk, or
put a container behind a tool of your own (``rollout.tools`` takes a dotted path).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megarl.environments.tool import ToolError

logger = logging.getLogger(__name__)

_CHILD = str(Path(__file__).with_name("sandbox_child.py"))
_MARK = "\x00megarl-sandbox "
_logged_layers: set = set()  # each distinct layer line once per process


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    returncode: Optional[int]
    ended: str  # "ok" | "error" | "cpu_limit" | "memory_limit" | "output_limit" | "timeout" | "signal"
    seconds: float
    layers: str  # the confinement layers that were active, as sandbox_child.py named them


class PythonSandbox:
    """``{"name": "python", "arguments": {"code": "print(2 ** 100)"}}`` -> its stdout."""

    name = "python"
    description = (
        "Runs a Python program (standard library only, no network, no subprocesses or threads) and returns "
        "what it prints. Use print() to see results."
    )
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "a complete Python program"}},
        "required": ["code"],
    }

    def __init__(
        self,
        wall_s: float = 10.0,
        cpu_s: int = 5,
        memory_mb: int = 512,
        max_output_chars: int = 4096,
        max_code_chars: int = 20000,
        kernel_layers: bool = True,
        scratch_mb: int = 64,
    ):
        """``kernel_layers=False``: resource limits and the audit hook alone, what a machine with no
        namespaces gives a job run as root (the tests use it to show what the hook alone stops)."""
        self.wall_s, self.cpu_s, self.memory_mb = wall_s, cpu_s, memory_mb
        self.kernel_layers, self.scratch_mb = kernel_layers, scratch_mb
        self.max_output_chars, self.max_code_chars = max_output_chars, max_code_chars

    def run(self, code: str) -> SandboxResult:
        limits = {
            "cpu_s": int(self.cpu_s),
            "memory_bytes": int(self.memory_mb) << 20,
            # a little over what is read back, so a flood of output is cut by the kernel
            "file_bytes": 4 * self.max_output_chars + 4096,
            "kernel": bool(self.kernel_layers),
            "scratch_mb": int(self.scratch_mb),
        }
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="megarl_tool_") as work:
            out_path, err_path = os.path.join(work, ".stdout"), os.path.join(work, ".stderr")
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", _CHILD, json.dumps(limits)],
                    stdin=subprocess.PIPE,
                    stdout=out,
                    stderr=err,
                    cwd=work,
                    env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TMPDIR": work},
                    start_new_session=True,  # its own process group: the timeout kills all of it
                )
                timed_out = False
                try:
                    proc.communicate(code.encode(), timeout=self.wall_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                finally:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the session
                    except ProcessLookupError:
                        pass
                    proc.wait()
            stdout, stderr = _read(out_path, self.max_output_chars + 1), _read(err_path, 1 << 16)
        layers = "unknown (the child ended before naming them)"
        if _MARK in stderr:
            head, _, rest = stderr.partition(_MARK)
            layers, _, stderr = rest.partition("\n")
            stderr = head + stderr
            _log_layers(layers, self.kernel_layers)
        rc = proc.returncode
        if timed_out:
            ended = "timeout"
        elif rc == 0:
            ended = "ok"
        elif rc in (-signal.SIGXCPU, -signal.SIGKILL):  # the soft, then the hard CPU limit
            ended = "cpu_limit"
        elif rc == -signal.SIGXFSZ or "File too large" in stderr:  # Python ignores SIGXFSZ: EFBIG
            ended = "output_limit"
        elif "MemoryError" in stderr:
            ended = "memory_limit"
        elif rc is not None and rc < 0:
            ended = "signal"
        else:
            ended = "error"
        return SandboxResult(
            stdout,  # one character past the limit, so the caller can say it was cut
            stderr,
            rc,
            ended,
            time.perf_counter() - start,
            layers,
        )

    def __call__(self, arguments: dict) -> str:
        if set(arguments) != {"code"}:
            raise ToolError(f"python takes one argument, 'code'; got {sorted(arguments)}")
        code = arguments["code"]
        if not isinstance(code, str):
            raise ToolError(f"code must be a string, got {type(code).__name__}")
        if len(code) > self.max_code_chars:
            raise ToolError(f"code longer than {self.max_code_chars} characters")
        r = self.run(code)
        shown = _truncate(r.stdout, self.max_output_chars)
        if r.ended == "ok":
            return shown
        reason = {
            "timeout": f"the program ran past the {self.wall_s:g} s time limit and was stopped",
            "cpu_limit": f"the program used more than {self.cpu_s} s of CPU and was stopped",
            "memory_limit": f"the program ran out of memory ({self.memory_mb} MB limit)",
            "output_limit": "the program printed too much and was stopped",
            "signal": f"the program was killed by signal {-r.returncode}",
            "error": "the program raised an error",
        }[r.ended]
        tail = _last_lines(r.stderr, 6)
        parts = [reason] + ([f"stdout:\n{shown}"] if shown else []) + ([tail] if tail else [])
        raise ToolError("\n".join(parts))


def _log_layers(layers: str, kernel_wanted: bool) -> None:
    if layers in _logged_layers:
        return
    _logged_layers.add(layers)
    if kernel_wanted and "not active" in layers:
        logger.warning("python tool sandbox, layers active: %s", layers)
    else:
        logger.info("python tool sandbox, layers active: %s", layers)


def _read(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n... (output truncated at {limit} characters)"


def _last_lines(text: str, n: int) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(lines[-n:])
