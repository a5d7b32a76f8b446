"""The first code of every sandboxed process: `python -I -S -B -u -c <this file's text> <settings JSON>`.

The parent (stages/tools/sandbox.py) reads this file as text and passes it with `-c`; importing it runs
nothing. In the child it (1) sets RLIMIT_NPROC, here rather than in the parent's `preexec_fn` because in a
user namespace the kernel counts processes per namespace only for a limit set inside it (set before
`unshare`, the count is the whole uid's, shared by every concurrent sandbox), (2) installs an audit hook
(PEP 578), (3) runs `main.py` from the working directory as `__main__`, so tracebacks show the user's lines.

The audit hook refuses, with a PermissionError that says why:

- network: socket connect/bind/send/name lookups (inside a network namespace they would fail anyway; without
  one this is the only barrier);
- processes (unless allowed): fork, exec, spawn, os.system, subprocess, kill;
- writes outside the working directory (open for writing, remove, rename, mkdir, chmod, ... after resolving
  symlinks), except /dev/null;
- escape hatches: ctypes, resource.setrlimit (raising a limit back), gc's object walkers (the way to reach
  the hook function itself), tracing (which can write a frame's locals).

An audit hook is not a security boundary (PEP 578 says so): it stops accidents and casual attempts by model
code. The boundaries the kernel enforces are the rlimits, the network namespace and the new session.
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
    "os.rename": ((0, 2), (1, 3)), "os.link": ((1, 3),), "shutil.rmtree": ((0, None),),
    "os.chflags": ((0, None),), "os.lchflags": ((0, None),), "os.lchmod": ((0, None),),
}


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
