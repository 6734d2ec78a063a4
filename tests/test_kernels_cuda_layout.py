"""QuantLinear's CUDA paths, checked on CPU where the math allows: the int4 conversion (nibble order, K padding,
act-order permutation, tinygemm scales and zeros) against dequantize-then-matmul and against torch's CPU int4 op
on the same scales-and-zeros; the shape torch's CUDA pack op gives (its meta kernel); cuda_int8 (plain torch ops)
against the reference; and the stated automatic rule on CUDA."""

from __future__ import annotations

import pytest
import torch
from formats_helpers import rtn_quantize

from quantize.kernels import cpu, cuda
from quantize.qlinear import QuantLinear

CASES = [  # (bits, group_size, act_order, sym, out, in)
    (4, 128, False, False, 192, 576),  # ragged last group: K padded to the kernel's group
    (4, 32, True, False, 48, 96),
    (4, 64, False, True, 64, 320),
    (4, 256, False, False, 32, 512),
    (3, 32, True, False, 96, 64),
    (2, 128, False, False, 32, 256),
]
TOLERANCE = {2: 4e-2, 3: 1.5e-2, 4: 8e-3}  # bf16 activations and bf16 scale/zero terms (as the CPU int4 path)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max())


def test_nibble_order_is_torch_convention():
    codes = torch.tensor([[1, 2, 3, 4], [15, 0, 7, 8]], dtype=torch.uint8)
    packed = cuda.int4_nibbles(codes)
    assert packed.tolist() == [[0x12, 0x34], [0xF0, 0x78]]  # column 2j high nibble, 2j+1 low
    assert torch.equal(cuda.int4_from_nibbles(packed), codes)


@pytest.mark.parametrize("bits,group_size,act_order,sym,out_f,in_f", CASES)
def test_int4_conversion_matches_reference_and_cpu_op(bits, group_size, act_order, sym, out_f, in_f):
    gen = torch.Generator().manual_seed(bits * 100 + group_size)
    w = torch.randn(out_f, in_f, generator=gen) * 0.05
    qw = rtn_quantize(w, bits, group_size, sym=sym, act_order=act_order)
    perm = cpu.contiguous_group_order(qw.g_idx, qw.group_size, in_f)
    nibbles, sz, gk = cuda.int4_prepare(qw.codes, qw.scales, qw.zeros, qw.group_size, perm)
    k_pad = sz.shape[0] * gk
    assert nibbles.shape == (out_f, k_pad // 2) and k_pad % gk == 0 and k_pad >= in_f and sz.dtype == torch.bfloat16
    # the codes survive the conversion, in group order
    order = torch.arange(in_f) if perm is None else perm
    assert torch.equal(cuda.int4_from_nibbles(nibbles)[:, :in_f], qw.codes[:, order])
    assert not cuda.int4_from_nibbles(nibbles)[:, in_f:].any()
    x = torch.randn(5, in_f, generator=gen).bfloat16()
    ref = x.float() @ qw.dequantize().t()
    got = cuda.int4_reference_mm(x[:, order], nibbles, sz, gk)
    assert rel_err(got, ref) < TOLERANCE[bits]
    # torch's CPU int4 op reads the same scales-and-zeros the same way (tinygemm's (q - 8) * s + z)
    cpu_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(cpu.int4_padded_codes(qw.codes, perm, gk), 2)
    x_pad = torch.nn.functional.pad(x[:, order], (0, k_pad - in_f))
    cpu_out = torch.ops.aten._weight_int4pack_mm_for_cpu(x_pad, cpu_packed, gk, sz)
    assert rel_err(cpu_out, got) < 4e-3
    # the CUDA pack op's own shape rule (its meta kernel): [N/8, K/(16 tiles), 32, tiles/2]
    tiles = cuda.int4_inner_k_tiles(k_pad)
    meta = torch.ops.aten._convert_weight_to_int4pack(nibbles.to("meta"), tiles)
    assert tuple(meta.shape) == (out_f // 8, k_pad // (16 * tiles), 32, tiles // 2)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_int8_path_matches_reference(sym, dtype):
    gen = torch.Generator().manual_seed(11)
    qw = rtn_quantize(torch.randn(80, 192, generator=gen) * 0.05, 8, -1, sym=sym)
    ref = QuantLinear(qw, path="reference")
    fast = QuantLinear(qw, compute_dtype=dtype, path="cuda_int8")
    assert torch.equal(fast.codes_now(), qw.codes)
    assert torch.equal(fast.row_codes(torch.tensor([3, 0])), qw.codes[[3, 0]])
    x = torch.randn(3, 192, generator=gen).to(dtype)
    assert rel_err(fast(x), ref(x.float())) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_auto_rule_on_cuda():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=gen) * 0.05
    cuda_dev = torch.device("cuda")

    def layer(bits, group_size, act_order=False, act_quant=False, dtype=torch.bfloat16):
        qw = rtn_quantize(w, bits, group_size, sym=bits == 8, act_order=act_order)
        return QuantLinear(qw, act_quant=act_quant, compute_dtype=dtype, path="reference")

    assert layer(4, 128).auto_path(cuda_dev) == "cuda_int4"
    assert layer(2, 64).auto_path(cuda_dev) == "cuda_int4"
    assert layer(4, 128, dtype=torch.float32).auto_path(cuda_dev) == "triton"  # fp32 models keep fp32 math
    assert layer(4, 128, act_order=True).auto_path(cuda_dev) == "triton"
    assert layer(4, 16).auto_path(cuda_dev) == "triton"  # group smaller than the kernel's 32
    assert layer(8, -1).auto_path(cuda_dev) == "cuda_int8"
    assert layer(8, 64).auto_path(cuda_dev) == "triton"  # grouped int8
    assert layer(8, -1, act_quant=True).auto_path(cuda_dev) == "triton"  # W8A8
    head = layer(4, 128)
    head.serves_rows = True
    assert head.auto_path(cuda_dev) == "triton"
    with pytest.raises(ValueError, match="cuda_int8 needs weight-only 8-bit"):
        layer(4, 128).set_path("cuda_int8")
