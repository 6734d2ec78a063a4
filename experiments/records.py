"""Result records as JSONL (provenance itself comes from runtime.provenance)."""

from __future__ import annotations

import json
from pathlib import Path

from runtime.paths import write_atomic


def append_jsonl(path: str | Path, record: dict) -> None:
    """Add one record atomically: the file is rewritten beside itself and renamed over the old one, so a run
    killed while writing leaves every earlier record whole and never half a line."""
    path = Path(path)
    old = path.read_bytes() if path.is_file() else b""
    line = (json.dumps(record, default=str) + "\n").encode()
    write_atomic(path, lambda tmp: tmp.write_bytes(old + line))


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
