"""Provenance for result records: git sha, package versions, device, exact command, time."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

PACKAGES = ("torch", "transformers", "triton", "aiohttp", "numpy")


def git_sha(repo: Path | None = None) -> str:
    repo = repo or Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True)
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def device_info() -> dict:
    info = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "processor": platform.processor()}
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["cuda_device"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    if hasattr(os, "getloadavg"):
        info["loadavg_1m"] = os.getloadavg()[0]  # how busy the shared machine was
    return info


def provenance(seed: int | None = None) -> dict:
    return {
        "command": "python -m " + shlex.join([_module_name(), *sys.argv[1:]]),
        "seed": seed,
        "git_sha": git_sha(),
        "versions": versions(),
        "device": device_info(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _module_name() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec.name if spec is not None else Path(sys.argv[0]).stem
