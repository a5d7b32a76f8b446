"""The first code of every sandboxed process: `python -I -S -B -u -c <this file's text> <settings JSON>`.

The parent (stages/tools/sandbox.py) reads this file as text and passes it with `-c`; importing it runs
nothing. In the child it (1) sets RLIMIT_NPROC, here rather than in the parent's `preexec_fn` because in a
user namespace the kernel counts processes per namespace only for a limit set inside it (set before
`unshare`, the count is the whole uid's, shared by every concurrent sandbox), (2) restricts itself with
Landlock where the kernel has it (`restrict`, below), (3) installs an audit hook (PEP 578), (4) runs `main.py`
from the working directory as `__main__`, so tracebacks show the user's lines.

Landlock (Linux 5.13+, `landlock` in the kernel's LSM list) is the kernel's own barrier, inherited by every
child: no file or directory created, written, truncated, removed, renamed or linked outside the working directory
(and /dev/null), whatever path or descriptor the code uses (a write relative to a directory descriptor, which the
audit hook cannot see, included); from Landlock ABI 4 no TCP bind or connect; from ABI 6 no signal to a process
outside the sandbox (`pidfd_send_signal` included, which raises no audit event) and no abstract unix socket
outside it. Reads stay allowed (the standard library is read from the interpreter's folder).

The audit hook refuses, with a PermissionError that says why:

- network: socket connect/bind/send/name lookups (inside a network namespace they would fail anyway; without
  one this is the only barrier);
- processes (unless allowed): fork, exec, spawn, os.system, subprocess, kill;
- writes outside the working directory (open for writing, remove, rename, mkdir, chmod, ... after resolving
  symlinks), except /dev/null;
- escape hatches: ctypes, resource.setrlimit (raising a limit back), gc's object walkers (the way to reach
  the hook function itself), tracing (which can write a frame's locals).

An audit hook is not a security boundary (PEP 578 says so): it stops accidents and casual attempts by model
code. The boundaries the kernel enforces are the rlimits, the network namespace, Landlock and the new session.
"""

import builtins
import json
import os
import resource
import sys
import types

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
ALLOWED_WRITES = frozenset({"/dev/null"})
NETWORK_EVENTS = frozenset({
    "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
    "socket.gethostbyname", "socket.gethostbyname_ex", "socket.gethostbyaddr", "socket.getnameinfo",
    "socket.sethostname",
})
PROCESS_EVENTS = frozenset({
    "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.forkpty", "subprocess.Popen",
    "os.kill", "os.killpg", "signal.pthread_kill",
})
ALWAYS_EVENTS = frozenset({
    "ctypes.dlopen", "ctypes.dlsym", "ctypes.call_function", "resource.setrlimit", "resource.prlimit",
    "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys.settrace", "sys.setprofile",
})
# event -> ((path index, dir_fd index or None), ...): the paths an event writes to
PATH_EVENTS = {
    "os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),), "os.chmod": ((0, 2),),
    "os.chown": ((0, 3),), "os.utime": ((0, 3),), "os.truncate": ((0, None),), "os.symlink": ((1, 2),),
    "os.rename": ((0, 2), (1, 3)), "shutil.rmtree": ((0, None),),
    "os.link": ((0, 2), (1, 3)),  # the source too: a link to a file outside would make it writable from inside
    "os.chflags": ((0, None),), "os.lchflags": ((0, None),), "os.lchmod": ((0, None),),
}

# Landlock: syscall numbers (the same on every architecture but alpha) and access rights (linux/landlock.h)
LANDLOCK_CREATE_RULESET, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_RULESET_VERSION, LANDLOCK_RULE_PATH_BENEATH, PR_SET_NO_NEW_PRIVS = 1, 1, 38
FS_WRITE_FILE, FS_REFER, FS_TRUNCATE = 1 << 1, 1 << 13, 1 << 14  # REFER: ABI 2, TRUNCATE: ABI 3
FS_TREE_CHANGES = sum(1 << bit for bit in range(4, 13))  # remove dir/file, make char/dir/reg/sock/fifo/block/sym
NET_TCP = 1 << 0 | 1 << 1  # bind, connect (ABI 4)
SCOPES = 1 << 0 | 1 << 1  # abstract unix sockets, signals (ABI 6)


def landlock_abi():
    """The kernel's Landlock ABI version; 0 where there is none (other systems, older kernels, disabled)."""
    if not sys.platform.startswith("linux"):
        return 0
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    abi = libc.syscall(ctypes.c_long(LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0),
                       ctypes.c_uint32(LANDLOCK_RULESET_VERSION))
    return max(abi, 0)


def restrict(workdir, abi):
    """Landlock this process and its future children (see the module docstring): writes only under `workdir`
    and to /dev/null; TCP (ABI 4+), signals and abstract unix sockets (ABI 6+) only within the sandbox."""
    import ctypes

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = (("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32))

    libc = ctypes.CDLL(None, use_errno=True)

    def call(what, *args):
        result = libc.syscall(*(ctypes.c_long(arg) if isinstance(arg, int) else arg for arg in args))
        if result < 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"Landlock {what}: {os.strerror(errno)}")
        return result

    file_rights = FS_WRITE_FILE | (FS_TRUNCATE if abi >= 3 else 0)
    tree_rights = file_rights | FS_TREE_CHANGES | (FS_REFER if abi >= 2 else 0)
    fields = [tree_rights] + [NET_TCP] * (abi >= 4) + [SCOPES] * (abi >= 6)
    attr = (ctypes.c_uint64 * len(fields))(*fields)
    ruleset = call("create_ruleset", LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.sizeof(attr), 0)
    try:
        for path, rights in ((workdir, tree_rights), ("/dev/null", file_rights)):
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = PathBeneath(rights, fd)
                call("add_rule", LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0)
            finally:
                os.close(fd)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        call("restrict_self", LANDLOCK_RESTRICT_SELF, ruleset, 0)
    finally:
        os.close(ruleset)


def make_guard(workdir, allow_subprocess):
    """The audit hook. It reads only its own closure: module globals and builtins are reachable (and
    replaceable) from user code, so every name it uses is bound here, and its tables are read-only."""
    reasons = types.MappingProxyType({
        **{event: "network access is not allowed in the sandbox" for event in NETWORK_EVENTS},
        **{event: "this is not allowed in the sandbox" for event in ALWAYS_EVENTS},
        **({} if allow_subprocess else
           {event: "starting or signalling processes is not allowed in the sandbox" for event in PROCESS_EVENTS}),
    })
    path_events = types.MappingProxyType(dict(PATH_EVENTS))
    allowed, write_flags, inside = ALLOWED_WRITES, WRITE_FLAGS, workdir + "/"
    realpath, join, fsdecode, readlink = os.path.realpath, os.path.join, os.fsdecode, os.readlink
    denied, is_instance = PermissionError, isinstance

    def check_write(event, path, dir_fd):
        if path is None or is_instance(path, int):  # an open file descriptor: its open was checked
            return
        name = fsdecode(path)
        if dir_fd is not None and dir_fd >= 0 and not name.startswith("/"):
            name = join(readlink(f"/proc/self/fd/{dir_fd}"), name)
        resolved = realpath(name)
        if resolved != workdir and not resolved.startswith(inside) and resolved not in allowed:
            raise denied(f"{event}: writing outside the working directory is not allowed in the sandbox "
                         f"({fsdecode(path)!r})")

    def guard(event, args):
        if event in reasons:
            raise denied(f"{event}: {reasons[event]}")
        if event == "open" and args[2] & write_flags:
            check_write(event, args[0], None)
        elif event in path_events:
            for path_index, fd_index in path_events[event]:
                check_write(event, args[path_index], None if fd_index is None else args[fd_index])
        elif event == "import" and args[0] == "_posixsubprocess" and not allow_subprocess:
            raise denied("import: _posixsubprocess is not allowed in the sandbox")

    return guard


def refuse_fork_exec(*args):
    raise PermissionError("subprocess: starting processes is not allowed in the sandbox")


def main():
    settings = json.loads(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_NPROC, (settings["max_processes"], settings["max_processes"]))
    workdir = os.path.realpath(os.getcwd())
    if settings["landlock"]:
        restrict(workdir, settings["landlock"])
        for name in [name for name in sys.modules if name.partition(".")[0] == "ctypes"]:
            del sys.modules[name]  # so that the code's `import ctypes` loads it again, under the audit hook
    if not settings["allow_subprocess"]:
        import _posixsubprocess  # the one process starter that raises no audit event: replace it

        _posixsubprocess.fork_exec = refuse_fork_exec  # before `subprocess` imports it; re-import is refused
    builtins.exit = builtins.quit = sys.exit  # normally added by `site`, which -S skips
    with open("main.py", encoding="utf-8") as file:
        source = file.read()
    sys.argv = ["main.py"]
    sys.addaudithook(make_guard(workdir, settings["allow_subprocess"]))
    namespace = {"__name__": "__main__", "__file__": "main.py", "__builtins__": builtins}
    try:
        exec(compile(source, "main.py", "exec"), namespace)  # noqa: S102 - running it is the point
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - print the user's traceback without this file's frame
        exc.__traceback__ = exc.__traceback__.tb_next
        sys.excepthook(type(exc), exc, exc.__traceback__)
        sys.exit(1)


if __name__ == "__main__":
    main()
