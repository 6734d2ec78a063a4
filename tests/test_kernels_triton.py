"""Triton kernels vs the reference path, under TRITON_INTERPRET=1 in a subprocess.

The interpreter must be switched on before triton is imported, so the kernels run in a child process
(``python -m quantize.kernels.selfcheck``) and this module only reads its per-case JSON: other tests in
this process never see the interpreter setting.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_selfcheck(tmp_path: Path, subset: str, dtypes: str) -> dict:
    out = tmp_path / f"selfcheck-{subset}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "quantize.kernels.selfcheck", "--device", "cpu", "--subset", subset]
    proc = subprocess.run(
        cmd + ["--dtypes", dtypes, "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.is_file(), f"selfcheck crashed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    return run_selfcheck(tmp_path_factory.mktemp("triton"), "smoke", "float32,float16")


def test_every_bit_width_grouping_and_kernel_is_covered(smoke):
    seen = {(r["bits"], r["group_size"], r["act_order"], r["kernel"]) for r in smoke["results"]}
    for bits in (2, 3, 4, 8):
        for grouping in ((32, False), (32, True), (-1, False)):
            for kernel in ("gemv", "gemm"):
                assert (bits, *grouping, kernel) in seen
    assert any(r.get("w8a8") for r in smoke["results"])


def test_interpreted_kernels_match_reference(smoke):
    bad = [r for r in smoke["results"] if not r["ok"]]
    assert not bad, bad
    worst = smoke["summary"]["max_rel_err"]
    assert worst["float32"] < 1e-5 and worst["float16"] < 2e-3


def test_selfcheck_rejects_unknown_dtype():
    proc = subprocess.run(
        [sys.executable, "-m", "quantize.kernels.selfcheck", "--dtypes", "float8"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 2 and "unknown dtype(s) ['float8']" in proc.stderr


@pytest.mark.slow
def test_full_grid_under_interpreter(tmp_path):
    report = run_selfcheck(tmp_path, "full", "float32,float16")
    bad = [r for r in report["results"] if not r["ok"]]
    assert not bad, bad
