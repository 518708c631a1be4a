"""The Python tool's child process: ``python -I -S sandbox_child.py LIMITS_JSON``, the model's code on
stdin, started by python_sandbox.py in its scratch directory (the working directory).

Standard library only: megarl is not importable here (``-I``). Before the model's code runs it

1. sets resource limits (CPU seconds, address space, file size, no core files, 64 open files);
2. when ``limits["kernel"]``, confines the process with what the kernel holds (each step where the
   machine allows it, each one named in the layer line):
   - new mount and network namespaces (a job run as root: directly; any other user: inside a new
     user namespace that maps the job's uid to itself, which needs unprivileged user namespaces),
     so no socket reaches any interface, not even the host's loopback;
   - every mount made read-only (``mount_setattr(AT_RECURSIVE)``) but a fresh tmpfs of
     ``scratch_mb`` on the scratch directory: writes anywhere else fail with EROFS;
   - every capability dropped, so the mounts cannot be undone (a job run as root keeps root's
     uid, and reads what root reads: switching to ``nobody`` left the interpreter under /root
     unreadable);
   - RLIMIT_NPROC 1 (no process and no thread can be created: fork, clone, posix_spawn, vfork all
     fail with EAGAIN) where it binds, i.e. not for uid 0;
   - no_new_privs, then a seccomp filter (x86_64) refusing process and thread creation, exec,
     sockets, signals to other processes, ptrace and mount calls: what holds uid 0, which
     RLIMIT_NPROC does not;
3. writes the layer line (``\\0megarl-sandbox LAYERS\\n``) to stderr for the parent;
4. installs an audit hook (PEP 578) refusing sockets, process creation, ctypes and limit changes: a
   clear error for ordinary attempts, and the only block left where the kernel steps did not take.
"""

import json
import os
import platform
import resource
import sys

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 1 << 18
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 0x1
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (added to the unified table in 5.12)
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
# process and thread creation, exec, sockets, signals to other processes, ptrace and (un)mounting;
# x86_64 only: an architecture without a table runs without this layer, and says so
_SECCOMP_REFUSED = {
    "x86_64": (
        0xC000003E,  # AUDIT_ARCH_X86_64
        0x40000000,  # from here on, x32 system calls: refused as a block
        (
            56,
            57,
            58,
            59,
            322,
            435,  # clone fork vfork execve execveat clone3
            41,
            53,  # socket socketpair
            62,
            200,
            234,
            129,
            297,
            424,  # kill tkill tgkill rt_sigqueueinfo rt_tgsigqueueinfo pidfd_send_signal
            101,
            310,
            311,  # ptrace process_vm_readv process_vm_writev
            165,
            166,
            272,
            308,
            155,
            442,
            429,
            428,
            430,
            431,
            432,
        ),  # mount umount2 unshare setns pivot_root, new mount API
    ),
}
_LINUX_CAPABILITY_VERSION_3 = 0x20080522

BLOCKED_EVENTS = ("socket.", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
                  "subprocess.", "ctypes.", "resource.setrlimit", "resource.prlimit", "os.kill", "os.killpg",
                  "pty.")  # fmt: skip


def _limit(which, value, hard=None):
    resource.setrlimit(which, (value, value if hard is None else hard))


def _resource_limits(limits):
    _limit(resource.RLIMIT_CPU, limits["cpu_s"], limits["cpu_s"] + 1)  # SIGXCPU, then SIGKILL a second on
    _limit(resource.RLIMIT_AS, limits["memory_bytes"])
    _limit(resource.RLIMIT_FSIZE, limits["file_bytes"])
    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_NOFILE, 64)


def _kernel_confinement(scratch_mb):
    """The layers that took, and why the others did not."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    layers, missing = [], []

    def failed(what):
        err = ctypes.get_errno()
        missing.append(f"{what}: {os.strerror(err)}")

    def syscall_ok(*args):
        return libc.syscall(*[ctypes.c_long(a) if isinstance(a, int) else a for a in args]) == 0

    uid, gid, scratch = os.getuid(), os.getgid(), os.getcwd()
    as_root = uid == 0  # root keeps uid 0 (the interpreter may live where only root reads)
    if libc.unshare(CLONE_NEWNS | CLONE_NEWNET | (0 if as_root else CLONE_NEWUSER)) != 0:
        failed("namespaces (unshare)")
    else:
        if not as_root:  # the job's uid and gid map to themselves; setgroups must be denied first
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        layers.append("user+mount+network namespaces" if not as_root else "mount+network namespaces")
        read_only = ctypes.c_uint64 * 4  # struct mount_attr: attr_set, attr_clr, propagation, userns_fd
        if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:  # nothing propagates out
            failed("private mounts")
        elif not syscall_ok(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(read_only(MOUNT_ATTR_RDONLY, 0, 0, 0)), 32):  # fmt: skip
            failed("read-only mounts (mount_setattr)")
        elif libc.mount(b"tmpfs", scratch.encode(), b"tmpfs", 0, f"size={scratch_mb}m,mode=700".encode()) != 0:
            failed("scratch tmpfs")
        else:
            os.chdir(scratch)  # the working directory was the directory under the new mount
            layers.append(f"read-only file system but a {scratch_mb} MB scratch tmpfs")
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    if libc.capset(ctypes.byref(header), ctypes.byref((ctypes.c_uint32 * 6)())) != 0:
        failed("dropping capabilities")  # with them the mounts could be undone
    else:
        layers.append("no capabilities")
    if not as_root:  # RLIMIT_NPROC does not bind uid 0
        _limit(resource.RLIMIT_NPROC, 1)
        layers.append("process limit 1")
    refused = _SECCOMP_REFUSED.get(platform.machine())
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:  # also what an unprivileged seccomp filter needs
        failed("no_new_privs")
    elif refused is None:
        missing.append(f"seccomp: no syscall table for {platform.machine()}")
    elif libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(_seccomp_program(ctypes, *refused)), 0, 0) != 0:
        failed("seccomp")
    else:
        layers.append("no_new_privs")
        layers.append("seccomp (no process, thread, exec, socket, signal or mount)")
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]  # the model's code imports it afresh, through the audit hook
    return layers, missing


def _seccomp_program(ctypes, arch, abi_split, refused):
    """A classic-BPF filter: another ABI (int 0x80, x32) refused whole, the listed calls EPERM."""

    class Instruction(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(Instruction))]

    load, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    allow, deny = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM
    n = len(refused)
    code = [(load, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, deny), (load, 0, 0, 0), (jge, n + 1, 0, abi_split)]
    code += [(jeq, n - i, 0, nr) for i, nr in enumerate(refused)]  # to the deny after the allow
    code += [(ret, 0, 0, allow), (ret, 0, 0, deny)]
    instructions = (Instruction * len(code))(*[Instruction(*c) for c in code])
    program = Program(len(code), instructions)
    program._keep = instructions
    return program


def _install_hook():
    blocked = BLOCKED_EVENTS

    def hook(event, args):
        if event.startswith(blocked):
            raise PermissionError("sandbox: " + event + " is not allowed")

    sys.addaudithook(hook)


def main():
    limits = json.loads(sys.argv[1])
    _resource_limits(limits)
    layers, missing = ["resource limits"], []
    if limits["kernel"]:
        kernel, missing = _kernel_confinement(limits["scratch_mb"])
        layers += kernel
    layers.append("audit hook")
    line = ", ".join(layers) + ("" if not missing else " (not active: " + "; ".join(missing) + ")")
    sys.stderr.write("\x00megarl-sandbox " + line + "\n")
    sys.stderr.flush()
    _install_hook()
    source = sys.stdin.read()
    exec(compile(source, "<tool>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})


if __name__ == "__main__":
    main()
