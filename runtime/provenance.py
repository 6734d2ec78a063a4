"""Provenance for every result record: seed, git sha, package versions, device, exact command, time."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

PACKAGES = ("torch", "triton", "transformers", "safetensors", "gguf", "lm-eval", "numpy", "aiohttp", "matplotlib")


def git_sha(repo: Path | None = None) -> str:
    """HEAD's sha, with "-dirty" when tracked files differ from it."""
    repo = repo or Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo, capture_output=True, text=True
        )
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name.replace("-", "_")] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def device_info() -> dict:
    info = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "processor": platform.processor()}
    info["cpu_model"] = cpu_model()
    step = sys.modules.get("runtime.kernels.cpu_step")
    module = step._STATE.get("module") if step is not None else None
    if module is not None:  # the CPU step's kernel family and AMX row policy, where this run loaded it
        info["cpu_step"] = {"isa": module.isa(), "amx_policy": module.amx_mode()}
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


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo; platform.processor() is often empty on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def module_command(module: str, argv: list[str] | None = None) -> str:
    """The ``python -m module ...`` line that reproduces a run (argv=None: this process's arguments)."""
    return shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)])


def provenance(seed: int | None = None, command: str | None = None, sha: str | None = None) -> dict:
    """command: the exact reproducing line; by default this process's ``python -m`` module and arguments
    (callers running in-process, e.g. from tests, pass their own so the record names the tool, not pytest).
    sha: the tree a long run started from (taken once as it starts; its own output may be tracked files), else
    HEAD now."""
    return {
        "command": command or module_command(_main_module()),
        "seed": seed,
        "git_sha": sha or git_sha(),
        "versions": versions(),
        "device": device_info(),
        "cwd": os.getcwd(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _main_module() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec.name if spec is not None else Path(sys.argv[0]).stem
