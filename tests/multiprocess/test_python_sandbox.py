"""The Python tool's sandbox: a program that loops forever, forks without end, allocates 2 GB, calls
the network, sleeps or floods its output ends as an error observation within the limits, and the
next call works (the job goes on). Programs that get past the audit hook (tests/sandbox_escapes.py)
end as error observations where the kernel layers are active, and get out with the hook alone."""

import json
import logging
import os
import shutil
import socket
import subprocess
import time

import pytest

from megarl.environments.python_sandbox import PythonSandbox
from megarl.environments.tool import ToolCall, call_tool
from tests.conftest import ROOT
from tests.sandbox_escapes import KERNEL_ERRORS, UNDO_MOUNTS, escapes

WALL_S, CPU_S = 6.0, 2


@pytest.fixture(scope="module")
def tools():
    return {"python": PythonSandbox(wall_s=WALL_S, cpu_s=CPU_S, memory_mb=256, max_output_chars=200)}


def run(tools, code):
    start = time.perf_counter()
    text, ok = call_tool(tools, ToolCall("python", {"code": code}))
    return text, ok, time.perf_counter() - start


def test_a_program_prints_its_result(tools):
    text, ok, _ = run(tools, "import math\nprint(math.factorial(25))")
    assert ok and text == "15511210043330985984000000\n"


@pytest.mark.parametrize(
    "code,reason,limit_s",
    [
        ("while True:\n    pass", f"more than {CPU_S} s of CPU", WALL_S),  # the CPU limit, before the wall one
        ("import os\nwhile True:\n    os.fork()", "sandbox: os.fork is not allowed", 2),
        ("import multiprocessing as m\nm.Process(target=print).start()", "is not allowed", 2),
        ("import subprocess\nsubprocess.run(['sh', '-c', 'echo hi'])", "sandbox: subprocess.Popen is not allowed", 2),
        ("x = bytearray(2 * 1024 ** 3)", "ran out of memory (256 MB limit)", 2),
        ("import time\ntime.sleep(600)", f"past the {WALL_S:g} s time limit", WALL_S + 2),
        ("while True:\n    print('x' * 1000)", "printed too much", 5),
        ("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))", "resource.setrlimit is not", 2),
        ("import ctypes\nctypes.CDLL(None)", "ctypes", 2),
        ("raise ValueError('boom')", "ValueError: boom", 2),
    ],
)
def test_runaway_programs_become_error_observations(tools, code, reason, limit_s):
    text, ok, seconds = run(tools, code)
    assert not ok and text.startswith("error: ") and reason in text, text
    assert seconds < limit_s, seconds
    assert len(text) < 2000  # output truncated


def test_the_network_is_out_of_reach(tools):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
    text, ok, _ = run(tools, code)
    assert not ok and "connected" not in text.split("error:")[-1].split("\n")[0]
    with pytest.raises(BlockingIOError):  # nothing reached the listening socket
        server.accept()
    server.close()
    assert "sandbox: socket" in text or "unreachable" in text.lower(), text
    assert PythonSandbox().run("print(1)").layers.endswith("audit hook")


def test_calls_after_failures_still_work(tools):
    for code in ("while True:\n    pass", "x = bytearray(2 * 1024 ** 3)"):
        assert not run(tools, code)[1]
    text, ok, _ = run(tools, "print(sum(range(101)))")
    assert ok and text == "5050\n"
    long = PythonSandbox(max_output_chars=50)({"code": "print('y' * 60)"})
    assert long.startswith("y" * 50) and "truncated at 50 characters" in long


KERNEL_LAYERS = ("namespaces", "read-only file system", "no capabilities", "no_new_privs", "seccomp")


@pytest.fixture(scope="module")
def kernel_layers_here():
    layers = PythonSandbox().run("pass").layers
    if not all(layer in layers for layer in KERNEL_LAYERS):
        pytest.skip(f"this machine does not give the sandbox its kernel layers: {layers}")
    return layers


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.setblocking(False)
    yield server
    server.close()


def _reached(server) -> bool:
    try:
        server.accept()[0].close()
        return True
    except BlockingIOError:
        return False


@pytest.mark.parametrize("name", list(KERNEL_ERRORS))
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel layers", "hook only"])
def test_escapes_past_the_audit_hook(name, kernel, listener, tmp_path, request):
    """With the kernel layers every escape is an error observation with the kernel's error; with the
    hook alone (forced: kernel_layers=False) only the one it sees is stopped, the others get out."""
    if kernel:
        request.getfixturevalue("kernel_layers_here")
    outside = f"/tmp/megarl-escape-{os.getpid()}-{tmp_path.name}"  # /tmp: writable by any uid
    code, hook_stops = escapes(listener.getsockname()[1], outside)[name]
    tools = {"python": PythonSandbox(wall_s=WALL_S, cpu_s=CPU_S, memory_mb=256, kernel_layers=kernel)}
    try:
        text, ok, _ = run(tools, code)
        written = [p for p in (outside + ".open", outside + ".osopen", outside + ".ctypes") if os.path.exists(p)]
    finally:
        for suffix in (".open", ".osopen", ".ctypes"):
            if os.path.exists(outside + suffix):
                os.remove(outside + suffix)
    reached = _reached(listener)
    if kernel or hook_stops:
        assert not ok and "ESCAPED" not in text and KERNEL_ERRORS[name] in text, text
        assert not reached and not written
    else:  # the hook alone: out, with the effect seen from outside where there is one
        assert ok and "ESCAPED" in text, text
        assert reached == ("connect" in name or "_socket" in name) and bool(written) == ("outside" in name)


def test_the_kernel_layers_cannot_be_undone_from_inside(kernel_layers_here):
    """The hook disarmed, the program asks the kernel to make every mount writable again: refused
    (no capabilities, and seccomp refuses mount_setattr); with the hook alone nothing was read-only."""
    text, ok, _ = run({"python": PythonSandbox()}, UNDO_MOUNTS)
    assert not ok and "Operation not permitted" in text, text
    text, ok, _ = run({"python": PythonSandbox(kernel_layers=False)}, UNDO_MOUNTS)
    assert ok and "ESCAPED" in text, text


def test_the_active_layers_are_logged_once(caplog, kernel_layers_here):
    from megarl.environments import python_sandbox

    python_sandbox._logged_layers.clear()
    with caplog.at_level(logging.INFO, logger="megarl.environments.python_sandbox"):
        PythonSandbox().run("pass")
        PythonSandbox().run("pass")
        PythonSandbox(kernel_layers=False).run("pass")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        f"python tool sandbox, layers active: {kernel_layers_here}",
        "python tool sandbox, layers active: resource limits, audit hook",
    ]


SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.mark.skipif(
    os.getuid() != 0 or shutil.which("setpriv") is None or not os.path.exists(SYSTEM_PYTHON),
    reason="needs root, setpriv and a system Python to run the sandbox as another user",
)
def test_a_job_not_run_as_root_gets_a_user_namespace_and_a_process_limit(listener):
    """The same escapes from a job run as nobody (65534): the sandbox builds its namespaces inside a
    new user namespace and RLIMIT_NPROC binds. Runs under the system Python: nobody cannot read the
    project's interpreter where it lives under /root."""
    outside = f"/tmp/megarl-escape-nobody-{os.getpid()}"
    script = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "sys.executable = " + repr(SYSTEM_PYTHON) + "\n"
        "from megarl.environments.python_sandbox import PythonSandbox\n"
        "from tests.sandbox_escapes import escapes\n"
        "box = PythonSandbox(wall_s=6, cpu_s=2, memory_mb=256)\n"
        f"results = {{n: (r.ended, r.stdout, r.stderr[-300:]) for n, (c, _) in escapes({listener.getsockname()[1]}, "
        f"{outside!r}).items() for r in [box.run(c)]}}\n"
        "print(json.dumps({'layers': box.run('pass').layers, 'results': results}))\n"
    )
    proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", SYSTEM_PYTHON, "-"],
                          input=script, cwd="/tmp", capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["layers"].startswith("resource limits, user+mount+network namespaces, read-only file system")
    assert "process limit 1" in report["layers"] and "not active" not in report["layers"]
    for name, (ended, stdout, stderr) in report["results"].items():
        assert ended == "error" and "ESCAPED" not in stdout and KERNEL_ERRORS[name] in stderr, (name, stderr)
    assert not _reached(listener) and not any(os.path.exists(outside + s) for s in (".open", ".osopen", ".ctypes"))
