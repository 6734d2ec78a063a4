"""configs/formats.yaml loads and names only known row kinds; the FP8/FP4 rows (kind float_quant) run end to end
through the runner on the tiny random model, with weight bytes and perplexity deltas that follow the formats."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from experiments.config import load_config
from experiments.records import read_jsonl
from experiments.rows import ROWS, quantized_artifact
from experiments.run import main

ROOT = Path(__file__).resolve().parent.parent


def test_formats_config_loads():
    cfg = load_config(ROOT / "configs" / "formats.yaml")
    assert all(r.kind in ROWS for r in cfg.rows)
    kinds = {(r.kind, r.params.get("format") or r.params.get("method") or r.params.get("dtype")) for r in cfg.rows}
    for want in [("dtype", "bf16"), ("float_quant", "e4m3"), ("float_quant", "mxfp4"), ("float_quant", "nvfp4")]:
        assert want in kinds
    for method in ("int8", "rtn", "gptq", "awq", "fp8"):
        assert ("quantized", method) in kinds
    assert all(r.lossless_class == "approximate" for r in cfg.rows[1:])


@pytest.fixture
def one_thread():
    """Small ops: one thread (two collapse on a busy 2-core machine), restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow  # ~10 s on a quiet machine, over 30 s on a busy one
def test_float_quant_rows_run_on_the_tiny_model(tmp_path, one_thread):
    data = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    data["name"] = "tiny_formats"
    data["evals"]["threads"] = 1
    data["rows"] = [
        {"name": "fp32 reference", "kind": "reference", "lossless_class": "exact", "run_bench": False},
        {"name": "fp8", "kind": "float_quant", "params": {"format": "e4m3"}},
        {"name": "nvfp4", "kind": "float_quant", "params": {"format": "nvfp4"}},
    ]
    path = tmp_path / "tiny_formats.yaml"
    path.write_text(yaml.safe_dump(data))
    main([str(path), "--results-dir", str(tmp_path / "out")])
    records = {r["row"]["name"]: r for r in read_jsonl(tmp_path / "out" / "tiny_formats" / "records.jsonl")}
    assert all(r["status"] == "ok" for r in records.values()), {k: r["status"] for k, r in records.items()}
    ref = records["fp32 reference"]["results"]["weight_bytes"]
    fp8, fp4 = records["fp8"]["results"], records["nvfp4"]["results"]
    assert fp4["weight_bytes"] < fp8["weight_bytes"] < ref
    assert 0 < fp8["fidelity"]["max_abs_dlogprob"] < fp4["fidelity"]["max_abs_dlogprob"]
    assert fp8["speed"]["speedup"] > 0


def test_calibrated_fp8_row_builds_its_checkpoint_with_the_fp8_cli():
    cfg = load_config(ROOT / "configs" / "formats.yaml")
    row = next(r for r in cfg.rows if r.kind == "quantized" and r.params["method"] == "fp8")
    artifact = quantized_artifact(cfg.model.spec, row.params)
    out = artifact.path(Path("/store"))
    command = artifact.command(out)
    assert command[1:3] == ["-m", "quantize.fp8"] and command[-2:] == ["--out", str(out)]
    assert out.parent == Path("/store/quantized")
    assert "--gptq" in command and "--bits" not in command and "--group-size" not in command  # no int grid
    rtn = next(r for r in cfg.rows if r.kind == "quantized" and r.params["method"] == "rtn")
    rtn_command = quantized_artifact(cfg.model.spec, rtn.params).command(out)
    assert rtn_command[rtn_command.index("--group-size") + 1] == "64"  # 128 would be refused at save time
