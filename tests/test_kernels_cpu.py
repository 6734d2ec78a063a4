"""QuantLinear's CPU fast paths against the reference path, exact code recovery, and path selection."""

from __future__ import annotations

import pytest
import torch
from formats_helpers import rtn_quantize

from quantize.qlinear import QuantLinear

# Max relative error (max |y - ref| / max |ref|) allowed vs the fp32 reference. bf16 activations and bf16
# scale/zero terms bound the int4 path (~2^-8 per product; 2-bit zero terms (8 - z) * s are the largest);
# fp32 int8 paths differ from the reference only in summation order.
TOLERANCE = {
    ("cpu_int4", 2): 4e-2,
    ("cpu_int4", 3): 1.5e-2,
    ("cpu_int4", 4): 8e-3,
    ("cpu_int8", torch.float32): 1e-5,
    ("cpu_int8", torch.bfloat16): 2e-2,
    ("cpu_w8a8", torch.float32): 1e-5,
    ("cpu_w8a8", torch.bfloat16): 1e-2,
}


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max())


CASES = [  # (bits, group_size, act_order, sym, out, in)
    (4, 128, False, False, 192, 576),  # the default model's ragged last group (576 = 4.5 x 128)
    (4, 32, True, False, 48, 96),
    (4, 64, False, True, 64, 320),
    (3, 32, True, False, 96, 64),
    (2, 128, False, False, 32, 256),
]


@pytest.mark.parametrize("bits,group_size,act_order,sym,out_f,in_f", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_int4_matches_reference(bits, group_size, act_order, sym, out_f, in_f, dtype):
    gen = torch.Generator().manual_seed(bits * 100 + group_size)
    w = torch.randn(out_f, in_f, generator=gen) * 0.05
    qw = rtn_quantize(w, bits, group_size, sym=sym, act_order=act_order)
    qw.bias = torch.randn(out_f, generator=gen) * 0.1
    ref = QuantLinear(qw, path="reference")
    fast = QuantLinear(qw, compute_dtype=dtype, path="cpu_int4")
    assert fast.path == "cpu_int4" and not hasattr(fast, "packed_codes")
    for m in (1, 7, 16):
        x = torch.randn(2, m, in_f, generator=gen).to(dtype)
        y = fast(x)
        assert y.dtype == dtype and y.shape == (2, m, out_f)
        assert rel_err(y, ref(x.float())) < TOLERANCE[("cpu_int4", bits)]


@pytest.mark.parametrize("bits,group_size,act_order,sym,out_f,in_f", CASES + [(8, -1, False, True, 80, 192),
                                                                       (8, 64, True, False, 80, 192)])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_step_path_matches_reference(bits, group_size, act_order, sym, out_f, in_f, dtype):
    """qspec's own kernels (path "cpu"): the reference math up to summation order, for fp32 activations and
    for bf16 ones (compared with the reference on the same bf16-rounded inputs), any number of rows."""
    gen = torch.Generator().manual_seed(bits * 100 + out_f)
    w = torch.randn(out_f, in_f, generator=gen) * 0.05
    qw = rtn_quantize(w, bits, group_size, sym=sym, act_order=act_order)
    qw.bias = torch.randn(out_f, generator=gen) * 0.1
    ref = QuantLinear(qw, path="reference")
    fast = QuantLinear(qw, compute_dtype=dtype, path="cpu")
    assert fast.path == "cpu" and "kernel_data" in fast._buffers and "packed_codes" not in fast._buffers
    for m in (1, 7, 70):  # 70 rows: two kernel calls
        x = torch.randn(m, in_f, generator=gen).to(dtype)
        y = fast(x)
        assert y.dtype == dtype and y.shape == (m, out_f)
        expected = ref(x.float())
        tol = 2e-5 if dtype == torch.float32 else 8e-3  # bf16: the output's own rounding (2^-8)
        assert rel_err(y, expected) < tol, rel_err(y, expected)
    assert torch.equal(fast.qweight().codes, qw.codes)


@pytest.mark.parametrize("group_size,act_order,sym", [(-1, False, True), (-1, False, False), (64, True, False)])
@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_int8_and_w8a8_match_reference(group_size, act_order, sym, act_quant, dtype):
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(80, 192, generator=gen) * 0.05
    qw = rtn_quantize(w, 8, group_size, sym=sym, act_order=act_order)
    path = "cpu_w8a8" if act_quant else "cpu_int8"
    ref = QuantLinear(qw, act_quant=act_quant, path="reference")
    fast = QuantLinear(qw, act_quant=act_quant, compute_dtype=dtype, path=path)
    for m in (1, 16):
        x = torch.randn(m, 192, generator=gen).to(dtype)
        assert rel_err(fast(x), ref(x)) < TOLERANCE[(path, dtype)]


@pytest.mark.parametrize("bits,act_quant", [(4, False), (3, False), (8, True)])
def test_dense_path_is_bit_identical_to_reference_and_saves_only_codes(bits, act_quant):
    gen = torch.Generator().manual_seed(bits)
    qw = rtn_quantize(torch.randn(48, 160, generator=gen) * 0.05, bits, 32, act_order=True)
    qw.bias = torch.randn(48, generator=gen) * 0.1
    ref = QuantLinear(qw, act_quant=act_quant, path="reference")
    dense = QuantLinear(qw, act_quant=act_quant, path="dense")
    for m in (1, 9):
        x = torch.randn(m, 160, generator=gen)
        assert torch.equal(dense(x), ref(x))
    assert "dense_weight" not in dense.state_dict() and dense.state_dict().keys() == ref.state_dict().keys()
    assert torch.equal(dense.qweight().codes, qw.codes)


@pytest.mark.parametrize("path", ["cpu", "cpu_int4", "cpu_int8", "cpu_w8a8", "reference", "dense"])
def test_every_layout_recovers_the_exact_codes(path):
    bits = 8 if path in ("cpu_int8", "cpu_w8a8") else 4
    qw = rtn_quantize(torch.randn(64, 128) * 0.05, bits, 32, act_order=True)
    layer = QuantLinear(qw, act_quant=path == "cpu_w8a8", path=path)
    back = layer.qweight()
    assert torch.equal(back.codes, qw.codes) and torch.equal(back.zeros, qw.zeros)
    assert torch.equal(back.scales, qw.scales) and torch.equal(back.group_index(), qw.group_index())
    assert torch.equal(layer.set_path("reference").qweight().dequantize(), qw.dequantize())


def test_auto_picks_fast_paths_and_falls_back_with_reason():
    w = torch.randn(64, 128) * 0.05
    assert QuantLinear(rtn_quantize(w, 4, 128))(torch.randn(1, 128)).shape == (1, 64)
    picks = {
        "int4": QuantLinear(rtn_quantize(w, 4, 128), compute_dtype=torch.bfloat16),
        "int4-fp32": QuantLinear(rtn_quantize(w, 4, 128)),  # fp32 math kept: int4 would round to bf16
        "int8": QuantLinear(rtn_quantize(w, 8, -1)),
        "w8a8": QuantLinear(rtn_quantize(w, 8, -1), act_quant=True),
        "g16": QuantLinear(rtn_quantize(w, 4, 16)),  # no torch int4 kernel for groups of 16; qspec's takes them
        "g9": QuantLinear(rtn_quantize(w, 4, 9)),  # odd groups: no kernel at all
    }
    for layer in picks.values():
        layer(torch.randn(1, 128, dtype=layer.compute_dtype))
    assert [picks[k].path for k in picks] == ["cpu", "cpu", "cpu", "cpu", "cpu", "reference"]  # W8A8: the step's
    with pytest.raises(ValueError, match="cpu_int4 needs <= 4 bits, a group size that is a multiple of 32"):
        picks["g16"].set_path("cpu_int4")
    with pytest.raises(ValueError, match="the cpu kernels read codes in column pairs"):
        picks["g9"].set_path("cpu")
    with pytest.raises(ValueError, match="unknown QuantLinear path 'gpu'"):
        QuantLinear(rtn_quantize(w, 4, 128), path="gpu")


def test_resident_bytes_are_the_packed_size():
    w = torch.randn(576, 1536) * 0.05
    bf16_bytes = w.numel() * 2
    int4 = QuantLinear(rtn_quantize(w, 4, 128), path="cpu_int4")
    int8 = QuantLinear(rtn_quantize(w, 8, -1, sym=True), path="cpu_int8")
    assert int4.weight_bytes() <= 0.3 * bf16_bytes
    assert int8.weight_bytes() <= 0.55 * bf16_bytes
    reference = QuantLinear(rtn_quantize(w, 3, 128))
    assert reference.packed_codes.numel() * 4 == w.numel() * 3 // 8
