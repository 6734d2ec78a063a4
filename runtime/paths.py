"""Where qspec keeps what it builds: converted models, quantized checkpoints, trained heads, compiled
extensions. Everything under it can be rebuilt by a command."""

from __future__ import annotations

import os
from pathlib import Path


def qspec_home() -> Path:
    """``$QSPEC_HOME``, default ``~/.cache/qspec``."""
    return Path(os.environ.get("QSPEC_HOME", Path.home() / ".cache" / "qspec"))
