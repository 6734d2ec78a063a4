"""FP8 (e4m3) and emulated FP4 (e2m1; MXFP4, NVFP4): rounding against an independent enumeration of each
format's representable values with round-to-nearest-even, scales against their definitions, and FPLinear
against dequantize-then-matmul."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from quantize import fp8
from quantize.fplinear import (
    FPLinear,
    decode_e2m1,
    quantize_activations_fp8,
    quantize_fp4,
    quantize_fp8,
    round_e2m1,
    round_e4m3,
)
from runtime.model import random_model
from tests.test_quant_cli import TINY, run_error, tiny_checkpoint  # noqa: F401 (fixture)


def enumerate_format(exp_bits: int, man_bits: int, bias: int, nan_codes: set[int]) -> list[tuple[float, int]]:
    """Every finite value of a sign/exponent/mantissa format with subnormals, as (value, code)."""
    out = []
    for code in range(1 << (1 + exp_bits + man_bits)):
        if code in nan_codes:
            continue
        sign = -1.0 if code >> (exp_bits + man_bits) else 1.0
        e = (code >> man_bits) & ((1 << exp_bits) - 1)
        m = code & ((1 << man_bits) - 1)
        if e == 0:
            v = (m / (1 << man_bits)) * 2.0 ** (1 - bias)
        else:
            v = (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)
        out.append((sign * v, code))
    return out


E4M3_TABLE = enumerate_format(4, 3, 7, nan_codes={0x7F, 0xFF})  # e4m3fn: no infinities, S.1111.111 = NaN
E2M1_TABLE = enumerate_format(2, 1, 1, nan_codes=set())


def oracle_round(x: float, table: list[tuple[float, int]]) -> float:
    """Nearest representable value, a tie going to the even code (mantissa LSB 0); beyond max: saturate."""
    top = max(v for v, _ in table)
    x = min(max(x, -top), top)
    best = min(table, key=lambda vc: (abs(vc[0] - x), vc[1] & 1))
    return best[0]


def test_enumeration_matches_the_formats():
    values = sorted({v for v, _ in E4M3_TABLE})
    assert max(values) == 448.0 and min(v for v in values if v > 0) == 2.0**-9 and len(values) == 253  # +-0 merge
    assert sorted({abs(v) for v, _ in E2M1_TABLE}) == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def probe_values(table: list[tuple[float, int]], gen: torch.Generator) -> torch.Tensor:
    """Every representable value, every midpoint between neighbours (ties), points just around them, values
    beyond the range and random values spanning it."""
    vals = sorted({v for v, _ in table})
    mids = [(a + b) / 2 for a, b in zip(vals, vals[1:])]
    top = vals[-1]
    pts = vals + mids + [m * (1 + 1e-6) for m in mids] + [m * (1 - 1e-6) for m in mids] + [top * 1.01, top * 3]
    rand = (torch.rand(2000, generator=gen, dtype=torch.float64) * 2 - 1) * top * 1.1
    return torch.tensor(pts + [-p for p in pts] + rand.tolist(), dtype=torch.float32)


def test_e4m3_rounding_matches_enumeration():
    x = probe_values(E4M3_TABLE, torch.Generator().manual_seed(0))
    got = round_e4m3(x).float().tolist()
    want = [oracle_round(v, E4M3_TABLE) for v in x.tolist()]
    assert got == want


def test_e2m1_rounding_matches_enumeration():
    x = probe_values(E2M1_TABLE, torch.Generator().manual_seed(1))
    codes = round_e2m1(x)
    assert int(codes.max()) <= 15
    assert decode_e2m1(codes).tolist() == [oracle_round(v, E2M1_TABLE) for v in x.tolist()]
    # codes follow the bit layout (sign bit 3, then exponent and mantissa) of the enumeration
    by_code = {c: v for v, c in E2M1_TABLE}
    assert all(by_code[c] == v or (v == 0 and by_code[c] == 0) for c, v in zip(codes.tolist(), decode_e2m1(codes)))


def test_fp8_per_channel_and_block_scales():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(40, 200, generator=gen) * torch.rand(40, 1, generator=gen) * 3
    fw = quantize_fp8(w)
    amax = w.abs().amax(1, keepdim=True)
    assert torch.equal(fw.scales, amax / 448)
    want = torch.tensor([oracle_round(v, E4M3_TABLE) for v in (w / (amax / 448)).flatten().tolist()]).view_as(w)
    assert torch.equal(fw.codes.float(), want)
    assert torch.equal(fw.dequantize(), want * (amax / 448))
    blk = quantize_fp8(w, block=16)
    assert blk.scales.shape == (3, 13)  # ceil(40 / 16), ceil(200 / 16): edge blocks are partial
    for bi in range(3):
        for bj in range(13):
            part = w[bi * 16 : (bi + 1) * 16, bj * 16 : (bj + 1) * 16]
            s = blk.scales[bi, bj]
            assert s == part.abs().max() / 448
            q = blk.codes[bi * 16 : (bi + 1) * 16, bj * 16 : (bj + 1) * 16].float()
            assert torch.equal(q, round_e4m3(part / s).float())
    rel = (blk.dequantize() - w).abs() / w.abs().clamp(min=1e-3)
    assert float(rel[w.abs() > 0.05].max()) <= 2.0**-4  # 3 mantissa bits: half an ulp is 2^-4 relative


def test_mxfp4_scales_are_powers_of_two_per_32():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(8, 96, generator=gen) * 0.1
    w[0, :32] = 0  # an all-zero block
    fw = quantize_fp4(w, "mxfp4")
    assert fw.scales.dtype == torch.uint8 and fw.scales.shape == (8, 3)
    for r in range(8):
        for b in range(3):
            part = w[r, b * 32 : (b + 1) * 32]
            amax = float(part.abs().max())
            e = math.frexp(amax)[1] - 1 - 2 if amax > 0 else -127  # floor(log2 amax) - emax(e2m1)
            assert int(fw.scales[r, b]) == e + 127
            got = decode_e2m1(fw.codes[r, b * 32 : (b + 1) * 32])
            assert got.tolist() == [oracle_round(v / 2.0**e, E2M1_TABLE) for v in part.tolist()]
    assert float(fw.dequantize()[0, :32].abs().max()) == 0


def test_nvfp4_scales():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(6, 64, generator=gen)
    fw = quantize_fp4(w, "nvfp4")
    g = float(w.abs().max()) / (448 * 6)
    assert fw.global_scale == pytest.approx(g, rel=1e-7)
    assert fw.scales.dtype == torch.float8_e4m3fn and fw.scales.shape == (6, 4)
    for r in range(6):
        for b in range(4):
            part = w[r, b * 16 : (b + 1) * 16]
            s = oracle_round(float(part.abs().max()) / 6 / fw.global_scale, E4M3_TABLE)
            assert float(fw.scales[r, b]) == s
            got = decode_e2m1(fw.codes[r, b * 16 : (b + 1) * 16])
            want = [oracle_round(v, E2M1_TABLE) for v in (part / torch.tensor(s * fw.global_scale)).tolist()]
            assert got.tolist() == want
    assert fw.weight_bytes() == 6 * 64 // 2 + 6 * 4


@pytest.mark.parametrize("fmt", ["e4m3", "e4m3-block32", "mxfp4", "nvfp4"])
def test_fplinear_is_dequantize_then_matmul(fmt):
    gen = torch.Generator().manual_seed(5)
    w, bias = torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen)
    fw = quantize_fp4(w, fmt) if "fp4" in fmt else quantize_fp8(w, 32 if "block" in fmt else 0)
    fw.bias = bias
    x = torch.randn(3, 5, 64, generator=gen)
    want = F.linear(x, fw.dequantize(), bias)
    for path in ("reference", "dense", "dequant"):
        layer = FPLinear(fw, path=path)
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    layer = FPLinear(fw, compute_dtype=torch.bfloat16, path="dequant").to(torch.bfloat16)
    assert layer.codes.dtype == fw.codes.dtype and layer.scales.dtype == fw.scales.dtype  # casts never re-round
    torch.testing.assert_close(layer(x.bfloat16()).float(), want, rtol=0.03, atol=0.15)


def test_w8a8_fp8_per_token_activations_and_scaled_mm():
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(32, 64, generator=gen)
    x = torch.randn(7, 64, generator=gen) * torch.rand(7, 1, generator=gen) * 10
    fw = quantize_fp8(w)
    q, s = quantize_activations_fp8(x)
    assert torch.equal(s, x.abs().amax(1, keepdim=True) / 448)
    assert q.float().tolist() == [[oracle_round(v, E4M3_TABLE) for v in row] for row in (x / s).tolist()]
    want = F.linear(q.float() * s, fw.dequantize())
    torch.testing.assert_close(FPLinear(fw, act_quant=True, path="reference")(x), want, rtol=1e-5, atol=1e-5)
    # torch._scaled_mm (the GPU path; CPU has a kernel too): same math, bf16 output
    got = FPLinear(fw, act_quant=True, path="scaled_mm")(x)
    torch.testing.assert_close(got, want, rtol=0.01, atol=0.05)
    with pytest.raises(ValueError, match="scaled_mm runs W8A8-FP8"):
        FPLinear(fw, path="scaled_mm")
    with pytest.raises(ValueError, match="needs e4m3"):
        FPLinear(quantize_fp4(w, "nvfp4"), act_quant=True)


@pytest.mark.parametrize(
    "fmt,block,w8a8", [("e4m3", 0, False), ("e4m3", 32, False), ("e4m3", 0, True), ("nvfp4", 0, False)]
)
def test_quantize_model_equals_dequantized_dense_model(fmt, block, w8a8):
    model = random_model(TINY, seed=0)
    tokens = torch.randint(0, TINY.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    q = fp8.quantize_model(random_model(TINY, seed=0), fp8.float_config(fmt, block, w8a8))
    layers = [(n, m) for n, m in q.named_modules() if isinstance(m, FPLinear)]
    assert len(layers) == 4 * TINY.num_layers
    if not w8a8:  # oracle: the float model with every quantized weight replaced by its dequantized value
        with torch.no_grad():
            for name, m in layers:
                model.get_submodule(name).weight.copy_(m.fweight().dequantize())
        torch.testing.assert_close(q(tokens), model(tokens), rtol=1e-5, atol=1e-5)
    else:
        assert all(m.act_quant for _, m in layers)


def test_cli_errors_and_record(tiny_checkpoint, tmp_path, capsys, monkeypatch):  # noqa: F811
    monkeypatch.setenv("QSPEC_CPU_STEP", "0")  # no compiled-extension build in the fixture's fresh QSPEC_HOME
    ckpt = str(tiny_checkpoint)
    assert "--out: mxfp4 is emulated" in run_error(
        fp8.main, ["--model", ckpt, "--format", "mxfp4", "--out", str(tmp_path / "x")], capsys
    )
    assert "nothing to do" in run_error(fp8.main, ["--model", ckpt], capsys)
    assert "--block-size applies to e4m3" in run_error(
        fp8.main, ["--model", ckpt, "--format", "mxfp4", "--block-size", "64", "--eval", "wiki"], capsys
    )
    assert "W8A8-FP8 is per-channel e4m3" in run_error(
        fp8.main, ["--model", ckpt, "--w8a8", "--block-size", "32", "--eval", "wiki"], capsys
    )
    record = tmp_path / "r.jsonl"
    fp8.main(["--model", ckpt, "--format", "e4m3", "--eval", "wiki:4", "--record", str(record)])
    rec = json.loads(record.read_text())
    assert rec["quant_config"]["fmt"] == "e4m3" and rec["quant_config"]["quant_method"] == "fp8"
    assert rec["perplexity"]["wiki"] > 1 and "git_sha" in json.dumps(rec)
