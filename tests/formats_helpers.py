"""Test-side helpers for the formats and kernels tests: an RTN quantizer and independent packers.

The packers follow the published loop-by-loop reference layouts (AutoGPTQ's ``pack``, AutoAWQ's
``WQLinear_GEMM.from_linear``) word by word in numpy, sharing no code with quantize.formats.
"""

from __future__ import annotations

import numpy as np
import torch

from quantize.qlinear import QuantizedWeight


def rtn_quantize(
    w: torch.Tensor, bits: int, group_size: int, sym: bool = False, act_order: bool = False, seed: int = 0
) -> QuantizedWeight:
    """Min/max round-to-nearest codes; act_order draws a random column permutation (GPTQ's g_idx layout)."""
    out_features, in_features = w.shape
    group_size = in_features if group_size in (-1, 0) else min(group_size, in_features)
    g_idx = None
    group = torch.arange(in_features) // group_size
    if act_order:
        perm = torch.randperm(in_features, generator=torch.Generator().manual_seed(seed))
        group = torch.argsort(perm) // group_size  # column perm[j] is the j-th quantized: group j // size
        g_idx = group.to(torch.int32)
    n_groups = -(-in_features // group_size)
    qmax = 2**bits - 1
    scales = torch.zeros(out_features, n_groups)
    zeros = torch.zeros(out_features, n_groups)
    for g in range(n_groups):
        cols = w[:, group == g].float()
        if sym:
            s = cols.abs().amax(1).clamp(min=1e-6) / (2 ** (bits - 1) - 1)
            z = torch.full_like(s, 2 ** (bits - 1))
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s = ((hi - lo) / qmax).clamp(min=1e-6)
            z = torch.round(-lo / s.half().float()).clamp(0, qmax)
        scales[:, g] = s.half().float()  # fp16-exact, as every packed format stores them
        zeros[:, g] = z
    codes = torch.clamp(torch.round(w.float() / scales[:, group]) + zeros[:, group], 0, qmax).to(torch.uint8)
    return QuantizedWeight(codes, scales, zeros, bits, group_size, g_idx)


def autogptq_pack_rows(intweight: np.ndarray, bits: int) -> np.ndarray:
    """AutoGPTQ's reference packer: [n, cols] codes -> uint32 [n * bits / 32, cols] along dim 0."""
    intweight = intweight.astype(np.uint32)
    packed = np.zeros((intweight.shape[0] * bits // 32, intweight.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < packed.shape[0]:
        if bits in (2, 4, 8):
            for j in range(i, i + 32 // bits):
                packed[row] |= intweight[j] << (bits * (j - i))
            i += 32 // bits
            row += 1
        else:  # 3 bits: 32 codes in 3 words; codes 10 and 21 straddle words
            for j in range(i, i + 10):
                packed[row] |= intweight[j] << (3 * (j - i))
            i += 10
            packed[row] |= intweight[i] << 30
            row += 1
            packed[row] |= (intweight[i] >> 2) & 1
            i += 1
            for j in range(i, i + 10):
                packed[row] |= intweight[j] << (3 * (j - i) + 1)
            i += 10
            packed[row] |= intweight[i] << 31
            row += 1
            packed[row] |= (intweight[i] >> 1) & 0x3
            i += 1
            for j in range(i, i + 10):
                packed[row] |= intweight[j] << (3 * (j - i) + 2)
            i += 10
            row += 1
    return packed


def gptq_layer_tensors(prefix: str, qw: QuantizedWeight, v1: bool) -> dict[str, torch.Tensor]:
    """A GPTQ layer as AutoGPTQ (v1: zeros - 1) or GPTQModel (v2) writes it."""
    codes = qw.codes.numpy().T  # [in, out]
    zeros = qw.zeros.numpy().astype(np.int64) - (1 if v1 else 0)  # [out, G]
    qzeros = autogptq_pack_rows(zeros, qw.bits).T  # packed along out: [G, out * bits / 32]
    return {
        f"{prefix}.qweight": torch.from_numpy(autogptq_pack_rows(codes, qw.bits).view(np.int32).copy()),
        f"{prefix}.qzeros": torch.from_numpy(np.ascontiguousarray(qzeros).view(np.int32).copy()),
        f"{prefix}.scales": qw.scales.t().half().contiguous(),
        f"{prefix}.g_idx": qw.group_index().to(torch.int32),
    }


def autoawq_pack_cols(intweight: np.ndarray) -> np.ndarray:
    """AutoAWQ GEMM packer: [rows, out] 4-bit codes -> uint32 [rows, out / 8] in order (0,2,4,6,1,3,5,7)."""
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    intweight = intweight.astype(np.uint32)
    packed = np.zeros((intweight.shape[0], intweight.shape[1] // 8), dtype=np.uint32)
    for col in range(packed.shape[1]):
        for i in range(8):
            packed[:, col] |= intweight[:, col * 8 + order_map[i]] << (i * 4)
    return packed


def awq_layer_tensors(prefix: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}.qweight": torch.from_numpy(autoawq_pack_cols(qw.codes.numpy().T).view(np.int32).copy()),
        f"{prefix}.qzeros": torch.from_numpy(autoawq_pack_cols(qw.zeros.numpy().T).view(np.int32).copy()),
        f"{prefix}.scales": qw.scales.t().half().contiguous(),
    }
