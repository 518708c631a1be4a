"""The Python tool's sandbox: a program that loops forever, forks without end, allocates 2 GB, calls
the network, sleeps or floods its output ends as an error observation within the limits, and the
next call works (the job goes on)."""

import socket
import time

import pytest

from megarl.environments.python_sandbox import PythonSandbox
from megarl.environments.tool import ToolCall, call_tool

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
    assert PythonSandbox().run("print(1)").network_isolation.endswith("audit hook")


def test_calls_after_failures_still_work(tools):
    for code in ("while True:\n    pass", "x = bytearray(2 * 1024 ** 3)"):
        assert not run(tools, code)[1]
    text, ok, _ = run(tools, "print(sum(range(101)))")
    assert ok and text == "5050\n"
    long = PythonSandbox(max_output_chars=50)({"code": "print('y' * 60)"})
    assert long.startswith("y" * 50) and "truncated at 50 characters" in long
