"""Result records: provenance (git sha, package versions, device, command, seed) and JSONL append/read."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

PACKAGES = ("torch", "transformers", "lm_eval", "numpy", "safetensors", "triton")


def git_sha() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True
        ).stdout
        return sha + ("-dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            continue
    return out


def device_info() -> dict:
    import torch

    info = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
    }
    if info["cuda"]:
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        info["loadavg_1m"] = os.getloadavg()[0]  # how busy the shared machine was
    except OSError:
        pass
    return info


def provenance(seed: int | None) -> dict:
    return {
        "seed": seed,
        "git_sha": git_sha(),
        "versions": versions(),
        "device": device_info(),
        "command": " ".join(shlex.quote(a) for a in getattr(sys, "orig_argv", [sys.executable, *sys.argv])),
        "cwd": os.getcwd(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def append_jsonl(path: str | Path, record: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record, default=str) + "\n")


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
