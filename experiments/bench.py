"""Timed sections: the machine-wide benchmark lock and thread settings, shared by the runner and sweeps."""

from __future__ import annotations

import contextlib
import fcntl
import sys

import torch

BENCH_LOCK = "/tmp/qspec-bench.lock"
DEFAULT_THREADS = torch.get_num_threads()


def log(msg: str) -> None:
    print(f"[qspec] {msg}", file=sys.stderr, flush=True)


LOCKING = {"enabled": True}
EVAL_THREADS = {"n": 1}  # threads outside timed sections (the runner sets it from evals.threads)
TIMED_THREADS = {"n": DEFAULT_THREADS}  # threads inside them (a Ray worker: the CPUs of the node it holds)


@contextlib.contextmanager
def bench_section():
    """Exclusive benchmark lock (shared with every qspec benchmark on this machine) and default threads."""
    with open(BENCH_LOCK, "a") as lock:
        if LOCKING["enabled"]:
            log("waiting for the benchmark lock" if not try_lock(lock) else "benchmark lock taken")
            fcntl.flock(lock, fcntl.LOCK_EX)
        torch.set_num_threads(TIMED_THREADS["n"])
        try:
            yield
        finally:
            torch.set_num_threads(EVAL_THREADS["n"])
            fcntl.flock(lock, fcntl.LOCK_UN)


def try_lock(lock) -> bool:
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
