"""Artifacts computed once: a quantized checkpoint or a trained draft head, built by its own CLI into a store that
every worker reads (``--store``, default ``$QSPEC_HOME``; a shared path on a cluster), keyed by the hash of its
recipe and of its input model's files, and reused by every row and every later run that needs it.

A build holds a file lock next to its directory, so two processes (rows, workers, runs) that need the same
artifact build it once: the second waits and then finds it. It is written to ``NAME.building`` and renamed into
place with a marker file inside, so a directory in the store is complete or absent. Every finished build appends
a line to ``STORE/builds.jsonl``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from quantize.calibration import kept_layer_count, layer_store_dir
from runtime.loader import resolve
from runtime.paths import write_atomic
from runtime.provenance import provenance

MARKER = "qspec_artifact.json"  # written last: its presence means the build finished
BUILD_LOG = "builds.jsonl"


class BuildError(RuntimeError):
    """The artifact's CLI failed; the message names the command and its exit status (negative: a signal)."""

    def __init__(self, message: str, returncode: int):
        super().__init__(message)
        self.returncode = returncode


_FINGERPRINTS: dict[tuple, str] = {}


def model_files_hash(spec: str) -> str:
    """sha256 of the files of the model a spec resolves to (weights, config, tokenizer): the same model under
    another path or name has the same fingerprint, a re-converted one with other weights does not. Hashed once
    per process and file state (~0.7 s for SmolLM2-135M)."""
    path = resolve(spec)
    files = sorted(f for f in path.rglob("*") if f.is_file())
    state = (str(path), tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))
    if state not in _FINGERPRINTS:
        digest = hashlib.sha256()
        for f in files:
            digest.update(f"{f.relative_to(path)}\0".encode())
            with f.open("rb") as fh:
                while chunk := fh.read(1 << 20):
                    digest.update(chunk)
        _FINGERPRINTS[state] = digest.hexdigest()
    return _FINGERPRINTS[state]


@dataclass(frozen=True)
class Artifact:
    """``python -m MODULE --model MODEL *ARGS --out DIR`` builds it; ARGS is the recipe."""

    kind: str  # the store's subdirectory: quantized, medusa, eagle
    module: str
    args: tuple[str, ...]
    model: str  # input model spec (a registry name, a checkpoint directory, a .gguf)
    label: str  # the readable part of the directory name

    def key(self) -> str:
        recipe = {"module": self.module, "args": list(self.args), "model": model_files_hash(self.model)}
        return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]

    def path(self, store: Path) -> Path:
        return Path(store) / self.kind / f"{self.label}-{self.key()}"

    def command(self, out: Path) -> list[str]:
        return [sys.executable, "-m", self.module, "--model", self.model, *self.args, "--out", str(out)]


def is_built(path: Path) -> bool:
    return (path / MARKER).is_file()


def ensure_built(artifact: Artifact, store: Path, log=None) -> tuple[Path, bool]:
    """(the artifact's directory, whether this call built it). Builds under the artifact's lock unless it is in
    the store already; a failed build raises BuildError and leaves nothing in place."""
    log = log or (lambda msg: print(f"[qspec] {msg}", file=sys.stderr, flush=True))
    path = artifact.path(store)
    if is_built(path):
        return path, False
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another process building {path.name}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if is_built(path):  # the other process built it while this one waited
            return path, False
        partial = path.with_name(path.name + ".building")
        for leftover in (partial, path):  # an interrupted build's; nobody else writes here while the lock is held
            shutil.rmtree(leftover, ignore_errors=True)
        command = artifact.command(partial)
        kept = kept_layer_count(layer_store_dir(partial))  # only quantizers that take --resume keep layers
        if kept:  # a calibration quantizer (GPTQ, AWQ) was stopped: its finished layers resume, same result
            command.append("--resume")
            log(f"{path.name}: an interrupted build kept {kept} finished layers; resuming from them")
        log(f"building {path.name}: {' '.join(command[1:])}")
        started = time.time()
        done = subprocess.run(command, stdout=sys.stderr)
        if done.returncode != 0 or not partial.is_dir():
            shutil.rmtree(partial, ignore_errors=True)
            why = f"{artifact.module} failed (exit {done.returncode}): {' '.join(command[1:])}"
            raise BuildError(why, done.returncode)
        built = {
            "kind": artifact.kind,
            "key": artifact.key(),
            "path": str(path),
            "module": artifact.module,
            "args": list(artifact.args),
            "model": artifact.model,
            "model_files_hash": model_files_hash(artifact.model),
            "build_seconds": round(time.time() - started, 1),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            **provenance(command=" ".join(["python", *command[1:-2], "--out", str(path)])),
        }
        write_atomic(partial / MARKER, lambda tmp: tmp.write_text(json.dumps(built, indent=1)))
        partial.rename(path)
        with open(Path(store) / BUILD_LOG, "a") as f:  # one short O_APPEND write: whole lines across processes
            f.write(json.dumps(built) + "\n")
    return path, True


def builds(store: Path) -> list[dict]:
    """Every finished build in the store, oldest first."""
    log = Path(store) / BUILD_LOG
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.is_file() else []
