"""Where qspec keeps what it builds: converted models, quantized checkpoints, trained heads, compiled
extensions. Everything under it can be rebuilt by a command."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path


def qspec_home() -> Path:
    """``$QSPEC_HOME``, default ``~/.cache/qspec``."""
    return Path(os.environ.get("QSPEC_HOME", Path.home() / ".cache" / "qspec"))


def write_atomic(path: Path, write: Callable[[Path], None]) -> Path:
    """``write(tmp)`` to a sibling temporary file, then rename it to ``path``: a cache file is complete or absent,
    never half written by an interrupted run. The temporary name is this process's own (pid and a random tag), so
    processes filling the same cache at once (Ray workers) each rename a whole file and the last one wins. Creates
    the parent directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    write(tmp)
    tmp.replace(path)
    return path
