"""The built-in Python tool: a model's code run in a sandboxed subprocess, whatever it does.

Each call starts a fresh ``python -I -S`` (isolated: no site-packages, no PYTHON* variables,
an empty environment but PATH) in a new session and a temporary working directory that is
removed afterwards. Before the model's code runs, a prelude in the child

- sets resource limits: CPU seconds (RLIMIT_CPU: SIGXCPU ends a busy loop), address space
  (RLIMIT_AS: a 2 GB allocation raises MemoryError), written file size (RLIMIT_FSIZE: the
  output files cannot grow without bound), no core files, few open files;
- leaves the network where the OS allows: a new, empty network namespace (``unshare``, which
  needs CAP_SYS_ADMIN; ``network_isolation`` in the result says whether it took);
- installs an audit hook (PEP 578, which code cannot remove) refusing sockets, process creation
  (fork, exec, spawn, subprocess, system: a fork bomb stops at its first fork), ctypes, and
  changing resource limits, whether or not the namespace took.

The parent enforces a wall-clock limit (the whole session killed with SIGKILL), reads at most
``max_output_chars`` of stdout and of stderr from files, and turns every way the program can end
badly (exception, limit, signal, timeout) into a :class:`ToolError` whose message the model sees:
a runaway program becomes an error observation, never a stuck episode.

Not a container: the program can read files the job's user can read. Run the job as a user
without secrets on disk, or put a real sandbox behind a tool of your own (``rollout.tools`` takes
a dotted path).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

from megarl.environments.tool import ToolError

# Runs in the child before the model's code; its one argument is the JSON of the limits.
_PRELUDE = r"""
import json, resource, sys
limits = json.loads(sys.argv[1])
def _limit(which, value, hard=None):
    resource.setrlimit(which, (value, value if hard is None else hard))
_limit(resource.RLIMIT_CPU, limits["cpu_s"], limits["cpu_s"] + 1)  # SIGXCPU, then SIGKILL a second on
_limit(resource.RLIMIT_AS, limits["memory_bytes"])
_limit(resource.RLIMIT_FSIZE, limits["file_bytes"])
_limit(resource.RLIMIT_CORE, 0)
_limit(resource.RLIMIT_NOFILE, 64)
isolation = "audit hook"
try:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x40000000) == 0:  # CLONE_NEWNET: a namespace with no interface up
        isolation = "network namespace + audit hook"
except Exception:
    pass
sys.stderr.write("\x00megarl-sandbox " + isolation + "\n")
sys.stderr.flush()
_BLOCKED = ("socket.", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
            "subprocess.", "ctypes.", "resource.setrlimit", "resource.prlimit", "os.kill", "os.killpg",
            "pty.", "_posixsubprocess")
def _hook(event, args):
    if event.startswith(_BLOCKED):
        raise PermissionError("sandbox: " + event + " is not allowed")
sys.addaudithook(_hook)
_source = sys.stdin.read()
exec(compile(_source, "<tool>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""

_MARK = "\x00megarl-sandbox "


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    returncode: Optional[int]
    ended: str  # "ok" | "error" | "cpu_limit" | "memory_limit" | "output_limit" | "timeout" | "signal"
    seconds: float
    network_isolation: str


class PythonSandbox:
    """``{"name": "python", "arguments": {"code": "print(2 ** 100)"}}`` -> its stdout."""

    name = "python"
    description = (
        "Runs a Python program (standard library only, no network, no subprocesses) and returns "
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
    ):
        self.wall_s, self.cpu_s, self.memory_mb = wall_s, cpu_s, memory_mb
        self.max_output_chars, self.max_code_chars = max_output_chars, max_code_chars

    def run(self, code: str) -> SandboxResult:
        limits = {
            "cpu_s": int(self.cpu_s),
            "memory_bytes": int(self.memory_mb) << 20,
            # a little over what is read back, so a flood of output is cut by the kernel
            "file_bytes": 4 * self.max_output_chars + 4096,
        }
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="megarl_tool_") as work:
            out_path, err_path = os.path.join(work, ".stdout"), os.path.join(work, ".stderr")
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", _PRELUDE, json.dumps(limits)],
                    stdin=subprocess.PIPE,
                    stdout=out,
                    stderr=err,
                    cwd=work,
                    env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
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
        isolation = "unknown"
        if _MARK in stderr:
            head, _, rest = stderr.partition(_MARK)
            isolation, _, stderr = rest.partition("\n")
            stderr = head + stderr
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
            isolation,
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


def _read(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n... (output truncated at {limit} characters)"


def _last_lines(text: str, n: int) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(lines[-n:])
