"""Run untrusted Python (generated code) in a separate, limited process, never in the caller's.

Each run gets a fresh temporary directory as its working directory (removed afterwards), `python -I -S -B` with an
empty environment and no stdin, its own session (a timeout kills the whole process group), and its output in
files whose size RLIMIT_FSIZE caps (a completion that prints gigabytes is killed, the caller reads a tail). The
child's bootstrap (`BOOTSTRAP`), before the untrusted code runs: resource limits (address space, CPU, file size,
no core, no new processes), an audit hook that refuses process creation, signals, sockets, ctypes and file-system
changes other than writing files inside its directory, then, if it started as root, a drop to nobody, because root
ignores RLIMIT_NPROC and could not be stopped from fork-bombing the machine.

"Passed" means the program ran to its end: the bootstrap prints a random per-run sentinel after the code returns,
so `sys.exit(0)` or `os._exit(0)` before the tests is a failure, not a pass.

Threat model: careless or broken code (endless loops, huge allocations, `os.system`, stray writes, fork bombs), not
code written to defeat this harness. Audit hooks run inside the same interpreter and introspection can get around
them (CPython's docs say they are no sandbox); the OS-level limits (uid, rlimits, process group) protect the machine.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

STDERR_TAIL = 2000  # characters of the child's stderr kept in an Outcome
FILE_LIMIT_MB = 10  # RLIMIT_FSIZE: any file it writes, its stdout and stderr included
FAILED_EXIT = 3  # the bootstrap's exit status when the program raised AssertionError (a test failed)

# argv: working directory, sentinel, CPU seconds, memory MiB, file MiB. It runs as the interpreter's own user until
# the drop, so it imports the stdlib modules the program names first: after the drop the interpreter's files may be
# unreadable (an interpreter under /root, as here); `LAZY` are modules the stdlib imports later, inside calls.
BOOTSTRAP = r'''
import os, resource, sys

root, sentinel, cpu_s, memory_mb, file_mb = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
del sys.argv[1:]
with open("program.py", encoding="utf-8") as f:
    source = f.read()
for which, value in ((resource.RLIMIT_AS, memory_mb << 20), (resource.RLIMIT_FSIZE, file_mb << 20),
                     (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NOFILE, 64)):
    resource.setrlimit(which, (value, value))
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))  # SIGXCPU, then SIGKILL a second later
NOBODY = 65534
if os.geteuid() == 0:
    os.chown(root, NOBODY, NOBODY)  # before the hook, which refuses chown

REFUSED = frozenset({
    # new processes
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "subprocess.Popen", "pty.spawn",
    "webbrowser.open",
    # other processes
    "os.kill", "os.killpg", "signal.pthread_kill", "signal.pidfd_send_signal", "resource.prlimit", "fcntl.ioctl",
    # file-system changes other than writing a file (links would also fool the path check below)
    "os.chmod", "os.chown", "os.chflags", "os.lchflags", "os.link", "os.symlink", "os.remove", "os.rename",
    "os.rmdir", "os.mkdir", "os.truncate", "os.utime", "os.setxattr", "os.removexattr", "shutil.rmtree"})
REFUSED_PREFIXES = ("socket.", "ctypes.", "sqlite3.", "syslog.")
REFUSED_IMPORTS = frozenset({"_posixsubprocess", "_ctypes"})  # process creation and raw calls without audit events
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def make_hook(root, isinstance=isinstance, fspath=os.fspath, getcwd=os.getcwd, refuse=PermissionError):
    # Builtins and os functions are bound now: the program may rebind them later.
    def inside(path):
        if isinstance(path, int):
            return True  # a descriptor it already holds
        path = fspath(path)
        path = path.decode("utf-8", "surrogateescape") if isinstance(path, bytes) else path
        parts = []
        for part in (path if path.startswith("/") else getcwd() + "/" + path).split("/"):
            if part == "..":
                del parts[-1:]
            elif part and part != ".":
                parts.append(part)
        # lexical resolution is exact here: the program cannot create links (os.symlink, os.link are refused)
        return ("/" + "/".join(parts) + "/").startswith(root + "/")

    def hook(event, args):
        if (event in REFUSED or event.startswith(REFUSED_PREFIXES)
                or (event == "import" and args[0] in REFUSED_IMPORTS)):
            raise refuse(f"sandbox: {event} {args[0] if event == 'import' else ''}is not allowed")
        if event == "open":
            path, mode, flags = args
            if (flags or 0) & WRITE_FLAGS or (isinstance(mode, str) and mode.strip("rbtU")):
                # os.open (mode None) may write relative to a dir_fd this event does not show
                if mode is None or not inside(path):
                    raise refuse(f"sandbox: writing {path!r} is not allowed")
    return hook


def preimport(source):
    import ast

    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.update([node.module] + [f"{node.module}.{alias.name}" for alias in node.names])
    LAZY = {"collections": ["heapq"], "datetime": ["_strptime"], "time": ["_strptime"]}
    for name in sorted(names) + [m for n in sorted(names) for m in LAZY.get(n, [])]:
        if name.partition(".")[0] in sys.stdlib_module_names:
            try:
                __import__(name)
            except BaseException:
                pass  # not a module (from math import sqrt) or refused: the program meets the error itself


def finish(line=f"\n{sentinel}\n".encode(), write=os.write):
    write(1, line)


del sentinel  # out of the program's sight in __main__ (which it can still inspect: see the threat model)
sys.addaudithook(make_hook(root))
preimport(source)
if os.geteuid() == 0:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
# No new processes or threads; after the drop, as root ignores it. (setrlimit stays allowed: with soft = hard
# limits, nobody can only lower them.)
resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
namespace = {"__name__": "__sandbox__", "__builtins__": __builtins__}  # not __main__: its demo blocks stay idle
try:
    exec(compile(source, "program.py", "exec"), namespace)
except AssertionError:
    sys.excepthook(*sys.exc_info())
    sys.stderr.flush()
    os._exit(3)  # FAILED_EXIT
sys.stdout.flush()
finish()
'''


@dataclass(frozen=True)
class Outcome:
    passed: bool
    reason: str  # "passed", "failed" (a test failed or it exited early), "timeout", "crashed" (an exception), "killed"
    stderr: str  # the last STDERR_TAIL characters of its stderr


def run_untrusted(source: str, timeout_s: float = 10.0, memory_mb: int = 1024) -> Outcome:
    """Run `source` as a program in a limited child process; it passes when it runs to its end with status 0."""
    sentinel = secrets.token_hex(16)
    cpu_s = int(timeout_s) + 1  # the CPU limit backs up the wall-clock timeout below
    with tempfile.TemporaryDirectory(prefix="batchspec-sandbox-", ignore_cleanup_errors=True) as tmp, \
            tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        tmp = os.path.realpath(tmp)  # the hook compares resolved paths
        Path(tmp, "program.py").write_text(source, encoding="utf-8", errors="replace")
        argv = [sys.executable, "-I", "-S", "-B", "-c", BOOTSTRAP, tmp, sentinel, str(cpu_s), str(memory_mb),
                str(FILE_LIMIT_MB)]
        child = subprocess.Popen(argv, cwd=tmp, env={}, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                 start_new_session=True)
        timed_out = False
        try:
            child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            # The leader is not reaped yet, so its process group id still names this group only.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        finished = sentinel.encode() in _tail(out, 256)
        reason = outcome_reason(child.returncode, timed_out, finished)
        return Outcome(reason == "passed", reason, _tail(err, STDERR_TAIL).decode("utf-8", "replace"))


def outcome_reason(returncode: int, timed_out: bool, finished: bool) -> str:
    """Why a run ended: "passed" only if it printed the sentinel and exited with status 0."""
    if timed_out or returncode == -signal.SIGXCPU:
        return "timeout"
    if returncode < 0:
        return "killed"  # a signal: the file-size limit, a segfault, the CPU hard limit
    if returncode == 0 and finished:
        return "passed"
    return "failed" if returncode in (0, FAILED_EXIT) else "crashed"


def _tail(f, size: int) -> bytes:
    f.seek(0, os.SEEK_END)
    f.seek(max(0, f.tell() - size))
    return f.read()
