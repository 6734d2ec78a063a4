"""Result records name the machine and the CPU step's kernels they were measured on (runtime.provenance)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.kernels import cpu_step
from runtime.provenance import cpu_model, provenance


def test_cpu_model_is_the_cpuinfo_name():
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo here")
    lines = cpuinfo.read_text().splitlines()
    names = {line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")}
    assert cpu_model() in names


def test_records_carry_the_cpu_step_policy():
    ext = cpu_step.extension()
    if ext is None:
        pytest.skip("the CPU step cannot be built here")
    previous = ext.amx_mode()
    with cpu_step.amx_policy("approximate"):
        device = provenance(seed=0, command="x")["device"]
    assert device["cpu_step"] == {"isa": ext.isa(), "amx_policy": "approximate"}
    assert ext.amx_mode() == previous  # the block's policy is undone
