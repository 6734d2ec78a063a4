"""Triton kernels: dequantize GPTQ-packed codes inside the matmul (2/3/4/8 bits, group-wise, optional g_idx).

Layout read (QuantLinear's ``reference``/``triton`` layout, GPTQ's): ``packed`` int32 [ceil(K*b/32), N], code
(k, n) at bits [k*b, (k+1)*b) of column n's bit stream (3-bit codes may straddle two words); ``scales`` and
``zeros`` [N, G]; ``g_idx`` [K] (act-order) or group = k // group_size.

Two kernels:
- ``qmm_gemm_kernel``: [BLOCK_M x BLOCK_N] output tiles, K loop, ``tl.dot`` on dequantized tiles (prefill,
  batched decode, verification of k+1 tokens).
- ``qmm_gemv_kernel``: one input row per program, a BLOCK_N slice of outputs, broadcast-multiply-reduce
  (decode at batch <= GEMV_MAX_M, where the matmul is a bandwidth-bound read of the codes).

Under ``TRITON_INTERPRET=1`` (tests on CPU) autotune gets one config and tl.dot gets fp32 operands (the
interpreter's bf16 dot is wrong); on CUDA fp16/bf16 inputs dot in their own dtype with fp32 accumulation.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from quantize.grid import quantize_activations_per_token

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
GEMV_MAX_M = 4


def gemm_configs():
    if INTERPRET:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32}, num_warps=4)]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bm, bn, bk, w, s in [
            (16, 64, 64, 4, 3),
            (32, 64, 64, 4, 3),
            (64, 64, 32, 4, 3),
            (64, 128, 32, 4, 3),
            (128, 128, 32, 8, 3),
            (128, 64, 64, 4, 4),
        ]
    ]


def gemv_configs():
    if INTERPRET:
        return [triton.Config({"BLOCK_N": 32, "BLOCK_K": 32}, num_warps=4)]
    return [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w)
        for bn, bk, w in [(64, 64, 4), (128, 64, 4), (128, 128, 4), (256, 64, 8), (64, 256, 4)]
    ]


@triton.jit
def dequant_tile(
    packed_ptr, scales_ptr, zeros_ptr, g_idx_ptr, offs_k, offs_n, K, N, group_size,
    stride_pk, stride_sn, stride_sg,
    BITS: tl.constexpr, HAS_G_IDX: tl.constexpr,
):  # fmt: skip
    """[BLOCK_K, BLOCK_N] fp32 dequantized weights (q - z) * s for input rows offs_k, output columns offs_n."""
    mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
    bit = offs_k * BITS
    word = bit // 32
    shift = (bit % 32).to(tl.uint32)
    w0 = tl.load(packed_ptr + word[:, None] * stride_pk + offs_n[None, :], mask=mask, other=0)
    q = w0.to(tl.uint32, bitcast=True) >> shift[:, None]
    if BITS == 3:  # codes straddling a word boundary take their high bits from the next word
        straddle = (shift + BITS) > 32
        w1 = tl.load(
            packed_ptr + (word[:, None] + 1) * stride_pk + offs_n[None, :],
            mask=mask & straddle[:, None],
            other=0,
        )
        high_shift = tl.where(straddle, 32 - shift, 0).to(tl.uint32)
        q = q | tl.where(straddle[:, None], w1.to(tl.uint32, bitcast=True) << high_shift[:, None], 0)
    q = (q & ((1 << BITS) - 1)).to(tl.float32)
    if HAS_G_IDX:
        g = tl.load(g_idx_ptr + offs_k, mask=offs_k < K, other=0)
    else:
        g = offs_k // group_size
    sz_offs = offs_n[None, :] * stride_sn + g[:, None] * stride_sg
    s = tl.load(scales_ptr + sz_offs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(zeros_ptr + sz_offs, mask=mask, other=0.0).to(tl.float32)
    return (q - z) * s


@triton.autotune(configs=gemm_configs(), key=["M_BUCKET", "N", "K", "BITS"])
@triton.jit
def qmm_gemm_kernel(
    x_ptr, packed_ptr, scales_ptr, zeros_ptr, g_idx_ptr, y_ptr, M, N, K, group_size,
    stride_xm, stride_pk, stride_sn, stride_sg, stride_ym,
    M_BUCKET, BITS: tl.constexpr, HAS_G_IDX: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=(offs_m[:, None] < M) & (offs_k[None, :] < K),
            other=0.0,
        )
        w = dequant_tile(
            packed_ptr, scales_ptr, zeros_ptr, g_idx_ptr, offs_k, offs_n, K, N, group_size,
            stride_pk, stride_sn, stride_sg, BITS, HAS_G_IDX,
        )  # fmt: skip
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=gemv_configs(), key=["N", "K", "BITS"])
@triton.jit
def qmm_gemv_kernel(
    x_ptr, packed_ptr, scales_ptr, zeros_ptr, g_idx_ptr, y_ptr, N, K, group_size,
    stride_xm, stride_pk, stride_sn, stride_sg, stride_ym,
    BITS: tl.constexpr, HAS_G_IDX: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xm + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        w = dequant_tile(
            packed_ptr, scales_ptr, zeros_ptr, g_idx_ptr, offs_k, offs_n, K, N, group_size,
            stride_pk, stride_sn, stride_sg, BITS, HAS_G_IDX,
        )  # fmt: skip
        acc += tl.sum(x[:, None] * w, axis=0)
    tl.store(y_ptr + row * stride_ym + offs_n, acc.to(y_ptr.dtype.element_ty), mask=offs_n < N)


def quant_matmul(x: Tensor, layer, kernel: str = "auto") -> Tensor:
    """x [M, K] @ dequant(layer)^T -> [M, N] (no bias) in x's dtype; kernel: auto | gemm | gemv."""

    x_scale = None
    if layer.act_quant:  # W8A8 semantics: per-token int8 activations (simulated: the kernel dots in float)
        q, x_scale = quantize_activations_per_token(x)
        x = q.to(torch.float16 if x.is_cuda else torch.float32)
    m, k = x.shape
    n = layer.out_features
    x = x.contiguous()
    out_dtype = torch.float32 if x_scale is not None else x.dtype
    y = torch.empty(m, n, device=x.device, dtype=out_dtype)
    packed, scales, zeros = layer.packed_codes, layer.scales, layer.zeros
    has_g_idx = layer.g_idx is not None
    g_idx = layer.g_idx if has_g_idx else packed  # any pointer: unused when HAS_G_IDX is false
    group_size = layer.group_size
    common = dict(BITS=layer.bits, HAS_G_IDX=has_g_idx)
    if kernel == "gemv" or (kernel == "auto" and m <= GEMV_MAX_M):

        def grid(meta):
            return (m, triton.cdiv(n, meta["BLOCK_N"]))

        qmm_gemv_kernel[grid](
            x, packed, scales, zeros, g_idx, y, n, k, group_size,
            x.stride(0), packed.stride(0), scales.stride(0), scales.stride(1), y.stride(0), **common,
        )  # fmt: skip
    else:

        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))

        dot_fp32 = INTERPRET or x.dtype == torch.float32
        qmm_gemm_kernel[grid](
            x, packed, scales, zeros, g_idx, y, m, n, k, group_size,
            x.stride(0), packed.stride(0), scales.stride(0), scales.stride(1), y.stride(0),
            triton.next_power_of_2(m), DOT_FP32=dot_fp32, **common,
        )  # fmt: skip
    if x_scale is not None:
        y = y * x_scale
    return y
