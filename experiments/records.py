"""Result records: provenance (from evals.record: git sha, versions, device) plus the exact command, JSONL I/O."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path

from evals.record import device_info, git_sha, versions

EXTRA_PACKAGES = ("lm_eval", "lm-eval", "matplotlib", "pyyaml")


def provenance(seed: int | None, command: str | None = None) -> dict:
    """seed, git sha, package versions, device and the command that reproduces the record.

    command: the exact ``python -m ...`` line (callers that run in-process pass their own argv, so the record
    names the experiment, not the test runner that imported it)."""
    from importlib import metadata

    vers = versions()
    for name in EXTRA_PACKAGES:
        try:
            vers[name.replace("-", "_")] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return {
        "seed": seed,
        "git_sha": git_sha(),
        "versions": vers,
        "device": device_info(),
        "command": command or shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv])),
        "cwd": os.getcwd(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def module_command(module: str, argv: list[str] | None) -> str:
    return shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)])


def append_jsonl(path: str | Path, record: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record, default=str) + "\n")


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
