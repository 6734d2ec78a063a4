"""CUDA fast paths on torch's own ops, with the layout conversions they need (done once, at path selection).

- int4 (2/3/4-bit codes fit in a nibble): ``aten._weight_int4pack_mm``, tinygemm, the kernel gpt-fast and torchao
  use. It dequantizes as ``(q - 8) * scale + zero`` per group of 32/64/128/256 input columns, like the CPU op,
  so the scales-and-zeros tensor is the CPU path's (zero = (8 - z) * s; cpu.int4_scales_and_zeros). The weight
  goes in as uint8 [N, K/2] with column 2j in the high nibble and 2j+1 in the low one (torch's convention, as
  its own tests pack it), and ``aten._convert_weight_to_int4pack`` tiles that for the kernel. bf16 activations.
- int8 weight-only, per output channel: ``F.linear(x, codes - 128) * s`` in plain torch ops. Eager it reads the
  weight twice; under ``torch.compile`` (runtime.compiled) inductor fuses the cast into the matmul, the way
  gpt-fast runs int8.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from quantize.kernels import cpu

INNER_K_TILES = (8, 4, 2)


def int4_nibbles(codes: Tensor) -> Tensor:
    """codes [N, K] (values 0..15, K even) -> uint8 [N, K/2]: column 2j in the high nibble, 2j+1 in the low."""
    c = codes.to(torch.uint8)
    return (c[:, ::2] << 4) | c[:, 1::2]


def int4_from_nibbles(packed: Tensor) -> Tensor:
    """Inverse of int4_nibbles: uint8 [N, K/2] -> codes [N, K] uint8."""
    return torch.stack([packed >> 4, packed & 15], dim=-1).flatten(-2)


def int4_inner_k_tiles(k_pad: int) -> int:
    """The kernel's K tiling: the largest of 8/4/2 with k_pad a multiple of 16 * tiles (k_pad % 32 == 0 always)."""
    return next(t for t in INNER_K_TILES if k_pad % (16 * t) == 0)


def int4_supported(bits: int, group_size: int, out_features: int) -> bool:
    return cpu.int4_supported(bits, group_size, out_features) and out_features % 8 == 0


def int4_prepare(codes: Tensor, scales: Tensor, zeros: Tensor, group_size: int, perm: Tensor | None):
    """The device-independent part of the conversion: (nibbles uint8 [N, K_pad/2], scales_and_zeros bf16
    [K_pad/gk, N, 2], gk). K is padded to the kernel's group size with code 0 (the padded inputs are zero)."""
    n, k = codes.shape
    gk = cpu.int4_subgroup_size(group_size, k)
    padded = cpu.int4_padded_codes(codes, perm, gk)
    return int4_nibbles(padded), cpu.int4_scales_and_zeros(scales, zeros, group_size, k, padded.shape[1], gk), gk


def int4_pack(codes: Tensor, scales: Tensor, zeros: Tensor, group_size: int, perm: Tensor | None):
    """codes [N, K] on a CUDA device -> (packed int32 [N/8, K_pad/(16 tiles), 32, tiles/2], scales_and_zeros, gk)."""
    nibbles, scales_and_zeros, gk = int4_prepare(codes, scales, zeros, group_size, perm)
    tiles = int4_inner_k_tiles(nibbles.shape[1] * 2)
    packed = torch.ops.aten._convert_weight_to_int4pack(nibbles.contiguous(), tiles)
    return packed, scales_and_zeros.to(codes.device), gk


def int4_mm(x: Tensor, packed: Tensor, scales_and_zeros: Tensor, gk: int, perm: Tensor | None) -> Tensor:
    """x [M, K] -> [M, N] bf16 through tinygemm."""
    if perm is not None:
        x = x.index_select(1, perm)
    k_pad = scales_and_zeros.shape[0] * gk
    if x.shape[1] != k_pad:
        x = F.pad(x, (0, k_pad - x.shape[1]))
    return torch.ops.aten._weight_int4pack_mm(x.to(torch.bfloat16).contiguous(), packed, gk, scales_and_zeros)


def int4_unpack(packed: Tensor, scales_and_zeros: Tensor, gk: int, n: int, k: int, perm: Tensor | None) -> Tensor:
    """Codes [N, K] uint8 back from the opaque tiled layout: multiply the identity with scale 1 and zero 8."""
    k_pad = scales_and_zeros.shape[0] * gk
    unit = torch.stack([torch.ones_like(scales_and_zeros[..., 0]), torch.full_like(scales_and_zeros[..., 0], 8)], -1)
    eye = torch.eye(k_pad, dtype=torch.bfloat16, device=packed.device)
    codes = torch.ops.aten._weight_int4pack_mm(eye, packed, gk, unit.contiguous()).t()[:, :k]
    codes = codes.round().to(torch.uint8).cpu()
    if perm is None:
        return codes
    out = torch.empty_like(codes)
    out[:, perm.cpu()] = codes
    return out


def int4_reference_mm(x: Tensor, nibbles: Tensor, scales_and_zeros: Tensor, gk: int) -> Tensor:
    """What ``_weight_int4pack_mm`` computes, in plain fp32 torch ops (tests check the conversion on CPU)."""
    q = int4_from_nibbles(nibbles).float()  # [N, K_pad]
    sz = scales_and_zeros.float().repeat_interleave(gk, dim=0)  # [K_pad, N, 2]
    w = (q - 8) * sz[..., 0].t() + sz[..., 1].t()
    return F.pad(x.float(), (0, q.shape[1] - x.shape[1])) @ w.t()


def int8_pack(codes: Tensor) -> Tensor:
    """codes [N, K] uint8 -> int8 codes - 128 (per-channel: one group spans K)."""
    return (codes.to(torch.int16) - 128).to(torch.int8).contiguous()


def int8_mm(x: Tensor, weight: Tensor, scales: Tensor, zero_shift: Tensor | None) -> Tensor:
    """x [M, K] @ ((w + 128 - z) s)^T: scales and zero_shift (z - 128, or None) are [N, 1]."""
    y = F.linear(x, weight.to(x.dtype)) * scales[:, 0].to(x.dtype)
    if zero_shift is not None:
        y = y - x.sum(-1, keepdim=True) * (scales[:, 0] * zero_shift[:, 0]).to(x.dtype)
    return y
