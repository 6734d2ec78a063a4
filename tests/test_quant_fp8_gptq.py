"""GPTQ onto the e4m3 grid (quantize.fp8.FP8Grid on quantize.gptq's one solver) against an oracle written from
the paper's pseudocode with its own e4m3 rounding (nearest value of the enumerated format, float64, no lazy
blocks); with H = I the OBS update vanishes and GPTQ must equal round-to-nearest exactly."""

from __future__ import annotations

import json

import pytest
import torch

from quantize import fp8
from quantize.fp8 import FP8Grid, search_fp8_scales
from quantize.fplinear import E4M3_MAX, expand_blocks, fp8_scales, quantize_fp8
from quantize.gptq import GPTQConfig, accumulate_hessian, gptq_on_grid, layer_error
from tests.test_quant_cli import run_error, tiny_checkpoint  # noqa: F401 (fixture)
from tests.test_quant_fp8 import E4M3_TABLE
from tests.test_quant_gptq import recon_error, sample_layer

E4M3_VALUES = torch.tensor(sorted({v for v, _ in E4M3_TABLE}), dtype=torch.float64)


def oracle_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Nearest enumerated e4m3 value (saturating), float64."""
    x = x.clamp(-E4M3_MAX, E4M3_MAX)
    return E4M3_VALUES[(x[:, None] - E4M3_VALUES[None, :]).abs().argmin(1)]


def oracle_gptq_fp8(W, X, scales, act_order=False, damp=0.01):
    """Algorithm 1 of the paper with e4m3 rounding at fixed per-element scales [out, in]: Ŵ [out, in] float64."""
    W, S = W.double().clone(), scales.double()
    H = 2 * X.double().T @ X.double() / X.shape[0]
    n = W.shape[1]
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(n)
    W, H, S = W[:, perm], H[perm][:, perm], S[:, perm]
    H = H + damp * torch.diag(H).mean() * torch.eye(n, dtype=H.dtype)
    Hinv = torch.linalg.cholesky(torch.linalg.inv(H), upper=True)
    Q = torch.zeros_like(W)
    for j in range(n):
        Q[:, j] = oracle_e4m3(W[:, j] / S[:, j]) * S[:, j]
        err = (W[:, j] - Q[:, j]) / Hinv[j, j]
        W[:, j:] -= err[:, None] * Hinv[j, j:][None, :]
    return Q[:, torch.argsort(perm)]


def scale_matrix(W, block):
    s = fp8_scales(W, block)
    return s.expand_as(W) if block == 0 else expand_blocks(s, *W.shape, block, block)


@pytest.mark.parametrize("block,act_order,lazy", [(0, False, 128), (0, True, 32), (32, False, 16), (32, True, 128)])
def test_gptq_fp8_matches_oracle_and_beats_rounding(block, act_order, lazy):
    W, X = sample_layer(seed=7 + block, dead=2)
    W[:, -2:] = 0  # dead inputs are zeroed by GPTQ: keep them out of the scales so the grids agree
    H = accumulate_hessian([X[None]])
    res = gptq_on_grid(W, H, FP8Grid(block), GPTQConfig(act_order=act_order, block_size=lazy))
    fw = res.qweight
    # every code is an exact e4m3 value, times the channel's (block's) scale amax / 448
    assert fw.codes.dtype == torch.float8_e4m3fn
    assert set(fw.codes.float().unique().tolist()) <= set(E4M3_VALUES.tolist())
    torch.testing.assert_close(fw.scales, fp8_scales(W, block), rtol=0, atol=0)
    torch.testing.assert_close(fw.dequantize(), fw.codes.float() * scale_matrix(W, block), rtol=0, atol=0)
    ours = recon_error(W, fw.dequantize(), X)
    oracle = recon_error(W, oracle_gptq_fp8(W, X, scale_matrix(W, block), act_order), X)
    assert abs(ours - oracle) <= 0.02 * oracle, (ours, oracle)
    rtn = quantize_fp8(W, block)
    assert ours < 0.8 * recon_error(W, rtn.dequantize(), X)
    assert layer_error(W, fw, H) < 0.8 * layer_error(W, rtn, H)


@pytest.mark.parametrize("block,act_order", [(0, False), (0, True), (32, False), (24, True)])
def test_identity_hessian_is_round_to_nearest(block, act_order):
    """No correlation between inputs: the inverse-Hessian factor is diagonal, every OBS update to other columns is
    zero, and GPTQ's codes are round-to-nearest's bit for bit."""
    W, _ = sample_layer(seed=11, dead=0)
    H = torch.eye(W.shape[1]) * 3.0
    res = gptq_on_grid(W, H, FP8Grid(block), GPTQConfig(act_order=act_order, block_size=16))
    rtn = quantize_fp8(W, block)
    assert torch.equal(res.qweight.codes.view(torch.uint8), rtn.codes.view(torch.uint8))
    assert torch.equal(res.qweight.scales, rtn.scales)


def test_scale_search_never_worse_per_channel():
    W, X = sample_layer(seed=5, dead=0)
    H = accumulate_hessian([X[None]])
    torch.testing.assert_close(search_fp8_scales(W, 1), fp8_scales(W), rtol=0, atol=0)  # k = 0 only
    for h in (None, H):
        base = quantize_fp8(W).dequantize()
        s = search_fp8_scales(W, 16, h)
        ratio = s / fp8_scales(W)
        assert torch.all((ratio <= 1) & (ratio > 0.5))
        searched = quantize_fp8(W, scales=s).dequantize()
        assert torch.all(fp8.row_errors(W, searched, h) <= fp8.row_errors(W, base, h))


def test_cli_gptq_errors_and_record(tiny_checkpoint, tmp_path, capsys, monkeypatch):  # noqa: F811
    monkeypatch.setenv("QSPEC_CPU_STEP", "0")
    ckpt = str(tiny_checkpoint)
    base = ["--model", ckpt, "--eval", "wiki:2"]
    assert run_error(fp8.main, base + ["--format", "mxfp4", "--gptq"], capsys) == (
        "python -m quantize.fp8: error: --gptq rounds onto the e4m3 grid only; mxfp4 is round-to-nearest (see --help)"
    )
    assert "--act-order / --layer-by-layer apply with --gptq" in run_error(fp8.main, base + ["--act-order"], capsys)
    assert "FP8 scales are fixed" in run_error(fp8.main, base + ["--gptq", "--static-groups"], capsys)
    assert "--scale-search searches per-channel e4m3" in run_error(
        fp8.main, base + ["--scale-search", "8", "--block-size", "32"], capsys
    )
    record = tmp_path / "r.jsonl"
    calib = ["--nsamples", "4", "--seqlen", "32", "--batch-size", "2"]
    fp8.main(base + ["--gptq", "--act-order", *calib, "--record", str(record)])
    rec = json.loads(record.read_text())
    qc = rec["quant_config"]
    assert qc["weight_rounding"] == "gptq" and qc["gptq"]["act_order"] and qc["nsamples"] == 4
    layers = rec["stats"]["layers"]
    assert len(layers) == 4 * 2 and all(s["rtn_hessian_error"] is not None for s in layers)  # tiny: 2 layers
    assert sum(s["hessian_error"] for s in layers) < sum(s["rtn_hessian_error"] for s in layers)
    assert rec["perplexity"]["wiki"] > 1
    assert "--scale-objective needs --scale-search" in run_error(
        fp8.main, base + ["--scale-objective", "hessian"], capsys
    )
    # the scale-search lever alone: round to nearest at scales searched on the calibration Hessian
    record.unlink()
    fp8.main(base + ["--scale-search", "8", "--scale-objective", "hessian", *calib, "--record", str(record)])
    rec = json.loads(record.read_text())
    qc = rec["quant_config"]
    assert qc["weight_rounding"] == "nearest" and qc["scale_objective"] == "hessian" and "gptq" not in qc
    layers = rec["stats"]["layers"]
    assert len(layers) == 8 and all(s["hessian_error"] == s["rtn_hessian_error"] for s in layers)
