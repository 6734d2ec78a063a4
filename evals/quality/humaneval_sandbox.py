"""HumanEval's sandboxed runner: each program in a separate ``python -I`` with time, memory and output limits and
without network (evals.quality.humaneval's docstring: Execution).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import platform
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from functools import cache, partial
from pathlib import Path

STATUSES = ("passed", "failed", "timed_out", "crashed", "memory")
MAX_WORKERS = 2  # programs run at once: the machines this runs on have 2 cores
RUNNER_VERSION = 1  # bump when the sandbox changes what status a program gets: cached results are then redone
# the child's exit statuses (it reports through them; 0 alone is not a pass, see _child_main)
EXIT_FAILED = 3
EXIT_MEMORY = 4
EXIT_EXITED = 5


def short_digest(obj) -> str:
    """12 hex digits of the sha256 of obj as canonical JSON: the cache keys' form."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0  # wall clock per program
    memory_mb: int = 1024  # RLIMIT_AS
    output_mb: int = 16  # RLIMIT_FSIZE: a program printing forever is stopped, not left to fill the disk

    def key(self) -> str:
        return short_digest({**asdict(self), "runner": RUNNER_VERSION, "python": platform.python_version()})


@dataclass
class Outcome:
    status: str  # one of STATUSES
    detail: str = ""  # the last stderr line of a failure or crash, or why it was stopped
    seconds: float = 0.0


@cache
def unshare_path() -> str | None:
    """`unshare` where it can start a process in a new network namespace (root, or user namespaces allowed)."""
    exe = shutil.which("unshare")
    try:
        ok = exe is not None and subprocess.run([exe, "-n", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        print("[humaneval] no network namespace here (unshare -n): only the in-process guard blocks the network",
              file=sys.stderr)  # fmt: skip
    return exe if ok else None


def sandbox_prefix() -> list[str]:
    """What the child's command line starts with: ``unshare -n --`` (no network devices but a downed loopback)."""
    exe = unshare_path()
    return [exe, "-n", "--"] if exe else []


def _set_limits(limits: Limits) -> None:
    """preexec_fn (in the forked child, before exec): only setrlimit, nothing that could take a lock."""
    memory, output = limits.memory_mb << 20, limits.output_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (output, output))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _refuse(what: str):
    """(Child side, like every _guard_* function: their sources are written into the sandbox with inspect.)"""

    def refused(*args, **kwargs):
        raise PermissionError(f"{what} is disabled in the HumanEval sandbox")

    return refused


def _guard_network() -> None:
    """Socket creation, connecting and name lookups raise (the namespace, where there is one, has no route
    either; this guard holds where there is none)."""
    import _socket
    import socket

    no_net = _refuse("the network")
    for mod in (socket, _socket):  # subclasses, not functions: `class X(socket.socket)` (ssl) must still import
        mod.socket = type("socket", (mod.socket,), {"__init__": no_net})
        for name in ("socketpair", "fromfd", "create_connection", "create_server", "getaddrinfo", "gethostbyname"):
            if hasattr(mod, name):
                setattr(mod, name, no_net)


def _guard_processes() -> None:
    """No new processes, no signals to others, no leaving the directory; no modules that would undo the guard
    (ctypes) or raise the limits (resource: the child runs as root, which may raise a hard limit)."""
    import os
    import subprocess
    import sys

    for name in ("kill", "killpg", "system", "popen", "fork", "forkpty", "_exit", "chdir", "fchdir", "chroot",
                 "posix_spawn", "posix_spawnp", "execv", "execve", "execl", "execle", "execlp", "execlpe", "execvp",
                 "execvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe",
                 "setuid", "setgid", "setsid", "setpgid", "nice", "register_at_fork"):  # fmt: skip
        if hasattr(os, name):
            setattr(os, name, _refuse(f"os.{name}"))
    for name in ("Popen", "run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"):
        setattr(subprocess, name, _refuse(f"subprocess.{name}"))
    for name in ("ctypes", "_ctypes", "resource", "_posixsubprocess", "multiprocessing", "psutil"):
        sys.modules[name] = None  # importing them raises ImportError


def _guard_files(root: str) -> None:
    """Removing, renaming, creating or writing files outside `root` raises; reading anywhere is allowed."""
    import builtins
    import io
    import os
    import shutil

    def inside(path) -> bool:
        if isinstance(path, int):  # a descriptor: opened through the checks below
            return True
        real = os.path.realpath(os.fsdecode(path))
        return real == root or real.startswith(root + os.sep)

    def confined(fn, what):
        def checked(*args, **kwargs):
            if not all(inside(a) for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))):
                raise PermissionError(f"{what} outside the sandbox directory is disabled")
            return fn(*args, **kwargs)

        return checked

    for name in ("remove", "unlink", "rmdir", "removedirs", "rename", "renames", "replace", "truncate", "chmod",
                 "chown", "lchown", "link", "symlink", "utime", "mkdir", "makedirs", "mkfifo", "mknod"):  # fmt: skip
        if hasattr(os, name):
            setattr(os, name, confined(getattr(os, name), f"os.{name}"))
    for name in ("rmtree", "move", "chown", "copytree"):
        setattr(shutil, name, confined(getattr(shutil, name), f"shutil.{name}"))
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    os_open, real_open = os.open, builtins.open

    def guarded_os_open(path, flags, *args, **kwargs):
        if flags & writes and not inside(path):
            raise PermissionError("writing outside the sandbox directory is disabled")
        return os_open(path, flags, *args, **kwargs)

    def guarded_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and not inside(file):
            raise PermissionError("writing outside the sandbox directory is disabled")
        return real_open(file, mode, *args, **kwargs)

    os.open, builtins.open, io.open = guarded_os_open, guarded_open, guarded_open


def _child_main() -> None:
    """(Runs in the child.) Read the pass token, guard, run program.py; report through the exit status and, on a
    pass, by printing the token after check() returned."""
    import os
    import sys
    import traceback

    token = sys.stdin.readline().strip()
    sys.stdin.close()
    with open("program.py", encoding="utf-8") as f:
        source = f.read()
    _guard_network()
    _guard_processes()
    _guard_files(os.getcwd())
    try:
        exec(compile(source, "program.py", "exec"), {"__name__": "__main__"})
    except AssertionError:
        traceback.print_exc()
        sys.exit(EXIT_FAILED)
    except MemoryError:
        traceback.print_exc()
        sys.exit(EXIT_MEMORY)
    except SystemExit as err:
        print(f"SystemExit: the program exited ({err.code!r}) before its tests finished", file=sys.stderr)
        sys.exit(EXIT_EXITED)
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
    print(f"\n{token}", flush=True)


def child_source() -> str:
    """run.py: the exit statuses, the guard and _child_main, from this module's own (linted, tested) source."""
    constants = f"EXIT_FAILED = {EXIT_FAILED}\nEXIT_MEMORY = {EXIT_MEMORY}\nEXIT_EXITED = {EXIT_EXITED}\n"
    functions = (_refuse, _guard_network, _guard_processes, _guard_files, _child_main)
    return "\n\n".join([constants, *(inspect.getsource(f) for f in functions), "_child_main()\n"])


def run_program(source: str, limits: Limits | None = None) -> Outcome:
    """Run one program in the sandbox (module docstring) and classify how it ended."""
    limits = limits or Limits()
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="qspec-humaneval-", ignore_cleanup_errors=True) as tmp:
        root = Path(tmp).resolve()
        (root / "program.py").write_text(source, encoding="utf-8")
        (root / "run.py").write_text(child_source(), encoding="utf-8")
        env = {"PATH": "/usr/bin:/bin", "HOME": str(root), "TMPDIR": str(root), "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1"}  # fmt: skip
        start = time.perf_counter()
        with open(root / "stdout", "wb") as out, open(root / "stderr", "wb") as err:
            proc = subprocess.Popen(
                [*sandbox_prefix(), sys.executable, "-I", "run.py"],
                cwd=root,
                env=env,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                start_new_session=True,  # its own process group: killed whole
                preexec_fn=partial(_set_limits, limits),
            )
            timed_out = _wait(proc, token, limits.timeout_s)
        seconds = time.perf_counter() - start
        outcome = _classify(proc.returncode, timed_out, _tail(root / "stdout"), _tail(root / "stderr"), token)
    outcome.seconds = round(seconds, 3)
    if outcome.status == "timed_out":
        outcome.detail = f"no result within {limits.timeout_s:g} s"
    return outcome


def _wait(proc: subprocess.Popen, token: str, timeout_s: float) -> bool:
    """Hand the child its token, wait for it up to timeout_s, then kill its whole process group (a timed-out
    program, and anything it left running). Returns whether it timed out. The group is killed while the child is
    still an unreaped zombie, so its process group id cannot have been reused by then."""
    try:
        proc.stdin.write(f"{token}\n".encode())
        proc.stdin.close()
    except BrokenPipeError:  # it died before reading (e.g. it could not start under the limits)
        pass
    deadline = time.monotonic() + timeout_s
    timed_out = True
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            timed_out = False
            break
        time.sleep(0.01)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    return timed_out


def _tail(path: Path, n: int = 4096) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - n))
        return f.read().decode("utf-8", errors="replace")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _classify(rc: int, timed_out: bool, stdout: str, stderr: str, token: str) -> Outcome:
    if timed_out:
        return Outcome("timed_out")
    if rc == 0 and _last_line(stdout) == token:
        return Outcome("passed")
    if rc == EXIT_FAILED:
        return Outcome("failed", _last_line(stderr))
    if rc == EXIT_MEMORY:
        return Outcome("memory", _last_line(stderr))
    if rc < 0:
        name = signal.Signals(-rc).name
        why = " (output limit)" if -rc == signal.SIGXFSZ else ""
        return Outcome("crashed", f"killed by {name}{why}; {_last_line(stderr)}".rstrip("; "))
    return Outcome("crashed", _last_line(stderr) or f"exit status {rc} before its tests finished")


def run_programs(
    sources: list[str], limits: Limits | None = None, workers: int = MAX_WORKERS, on_done=None
) -> list[Outcome]:
    """run_program over many programs, at most MAX_WORKERS at once; on_done(index, outcome) as each ends."""
    outcomes: list[Outcome | None] = [None] * len(sources)
    with ThreadPoolExecutor(max_workers=max(1, min(workers, MAX_WORKERS))) as pool:
        futures = {pool.submit(run_program, s, limits): i for i, s in enumerate(sources)}
        for future in as_completed(futures):
            i = futures[future]
            outcomes[i] = future.result()
            if on_done is not None:
                on_done(i, outcomes[i])
    return outcomes
