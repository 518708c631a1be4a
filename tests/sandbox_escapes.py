"""Programs that try to leave the Python tool's sandbox by ways an audit hook does not see, for
tests/multiprocess/test_python_sandbox.py (standard library only: it also runs under a system Python
as another user). Each prints ``ESCAPED`` when it got out; stopped, it ends with the error it met.

``DISARM`` takes the sandbox's audit hook apart from inside the interpreter -- PEP 578's hooks cannot
be removed, but the objects they read can be changed (here the hook's closure cell, found by
``gc``) -- which is why the kernel layers exist.
"""

DISARM = """
import gc
for _f in gc.get_objects():
    if getattr(_f, "__name__", None) == "hook" and getattr(_f, "__closure__", None):
        _f.__closure__[0].cell_contents = ("no event is this",)
"""

_LIBC = """
import ctypes, os, struct
libc = ctypes.CDLL(None, use_errno=True)
def check(ret):
    if ret == -1 or ret is None:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return ret
"""

_CONNECT = """
fd = check(libc.socket(2, 1, 0))  # AF_INET, SOCK_STREAM
addr = struct.pack("=H", 2) + struct.pack(">H", {port}) + bytes([127, 0, 0, 1]) + bytes(8)
check(libc.connect(fd, addr, len(addr)))
print("ESCAPED")
"""


def escapes(port: int, outside: str) -> dict:
    """name -> (program, the hook alone stops it); ``port``: a listening loopback port nothing in the
    sandbox should reach; ``outside``: a path in a world-writable directory outside the scratch."""
    return {
        # disarm the hook, then the same call through libc: the network is gone, not refused
        "ctypes socket+connect": (DISARM + _LIBC + _CONNECT.format(port=port), False),
        "ctypes fork": (
            DISARM + _LIBC + "pid = check(libc.fork())\nif pid == 0:\n    libc._exit(0)\nprint('ESCAPED')\n",
            False,
        ),  # fmt: skip
        "os.posix_spawn": (DISARM + "import os\nos.posix_spawn('/bin/true', ['true'], {})\nprint('ESCAPED')\n", False),
        # no audit event at all: the hook never sees it
        "_posixsubprocess.fork_exec": (
            "import _posixsubprocess, os\n"
            "r, w = os.pipe()\n"
            "_posixsubprocess.fork_exec([b'/bin/sh', b'-c', b'echo ESCAPED'], (b'/bin/sh',), True, (w,), None, None,"
            " -1, -1, -1, -1, -1, -1, r, w, True, False, -1, None, None, None, -1, None, False)\n"
            "os.close(w)\n"
            "import time\n"
            "time.sleep(0.5)\n",
            False,
        ),
        # the socket module by another name: the hook sees the socket's creation whatever its name
        "importlib _socket": (
            f"import importlib\ns = importlib.import_module('_socket').socket()\ns.connect(('127.0.0.1', {port}))\n"
            "print('ESCAPED')\n",
            True,
        ),
        "importlib _socket, hook disarmed": (
            DISARM + f"import importlib\ns = importlib.import_module('_socket').socket()\n"
            f"s.connect(('127.0.0.1', {port}))\nprint('ESCAPED')\n",
            False,
        ),
        # files: the hook does not refuse open()
        "open() outside the scratch": (f"open({outside + '.open'!r}, 'w').write('x')\nprint('ESCAPED')\n", False),
        "os.open outside the scratch": (
            f"import os\nos.close(os.open({outside + '.osopen'!r}, os.O_WRONLY | os.O_CREAT))\nprint('ESCAPED')\n",
            False,
        ),
        "ctypes open outside the scratch": (
            DISARM + _LIBC + f"check(libc.open({(outside + '.ctypes').encode()!r}, 0o101, 0o644))\nprint('ESCAPED')\n",
            False,
        ),
    }


# where the kernel layers are active, the error each escape meets
KERNEL_ERRORS = {
    "ctypes socket+connect": "Operation not permitted",
    "ctypes fork": "Operation not permitted",
    "os.posix_spawn": "Operation not permitted",
    "_posixsubprocess.fork_exec": "Operation not permitted",
    "importlib _socket": "sandbox: socket.__new__ is not allowed",
    "importlib _socket, hook disarmed": "Operation not permitted",
    "open() outside the scratch": "Read-only file system",
    "os.open outside the scratch": "Read-only file system",
    "ctypes open outside the scratch": "Read-only file system",
}

UNDO_MOUNTS = (
    DISARM
    + _LIBC
    + "attr = (ctypes.c_uint64 * 4)(0, 1, 0, 0)\n"  # clear MOUNT_ATTR_RDONLY, recursively, on /
    + "check(libc.syscall(ctypes.c_long(442), ctypes.c_long(-100), b'/', ctypes.c_long(0x8000), ctypes.byref(attr),"
    " ctypes.c_long(32)))\nprint('ESCAPED')\n"
)
