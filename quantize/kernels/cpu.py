"""CPU fast paths on torch's packed ops, with the layout conversions they need.

- int4 (and 2/3-bit codes, which fit in 4 bits): ``aten._weight_int4pack_mm_for_cpu``. Its dequantization is
  tinygemm's ``(q - 8) * scale + zero``; ours is ``(q - z) * s``, so zero = (8 - z) * s. It needs contiguous
  groups of 32/64/128/256 columns: act-order columns are permuted so each group is contiguous (the input is
  gathered with the same permutation), and a larger group is split into sub-groups that repeat its scale.
- int8 weight-only: ``aten._weight_int8pack_mm`` (per output channel scales), once per group, on codes - 128;
  an asymmetric zero point adds a rank-1 correction: x @ ((q - z) s)^T = s (x @ (q - 128)^T) - s (z - 128) sum(x).
- W8A8: ``torch._int_mm`` on int8 activations (dynamic per-token scales) and int8 codes, exact int32 sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from quantize.grid import quantize_activations_per_token

INT4_GROUP_SIZES = (256, 128, 64, 32)


def contiguous_group_order(g_idx: Tensor | None, group_size: int, in_features: int) -> Tensor | None:
    """A column permutation that makes every group contiguous (act-order), None when already contiguous.

    Raises ValueError when the groups do not have group_size columns each (last one excepted).
    """
    if g_idx is None:
        return None
    g = g_idx.long()
    n_groups = -(-in_features // group_size)
    expected = torch.full((n_groups,), group_size)
    expected[-1] = in_features - group_size * (n_groups - 1)
    if not torch.equal(torch.bincount(g, minlength=n_groups), expected):
        raise ValueError("act-order groups do not each hold group_size columns; no contiguous reordering")
    perm = torch.argsort(g, stable=True)
    return None if torch.equal(perm, torch.arange(in_features)) else perm


def int4_subgroup_size(group_size: int, in_features: int) -> int | None:
    """The kernel's group size: the largest of 256/128/64/32 dividing group_size, preferring no K padding."""
    fits = [g for g in INT4_GROUP_SIZES if group_size % g == 0]
    return next((g for g in fits if in_features % g == 0), fits[0] if fits else None)


def int4_supported(bits: int, group_size: int, out_features: int) -> bool:
    return bits <= 4 and out_features % 16 == 0 and int4_subgroup_size(group_size, group_size) is not None


def int4_padded_codes(codes: Tensor, perm: Tensor | None, gk: int) -> Tensor:
    """codes [N, K] -> int32 [N, K_pad]: columns in group order (perm), padded with code 0 to a multiple of gk
    (padded columns meet zero inputs)."""
    k = codes.shape[1]
    k_pad = -(-k // gk) * gk
    if perm is not None:
        codes = codes[:, perm.to(codes.device)]
    return torch.nn.functional.pad(codes.to(torch.int32), (0, k_pad - k))


def int4_scales_and_zeros(scales: Tensor, zeros: Tensor, group_size: int, k: int, k_pad: int, gk: int) -> Tensor:
    """tinygemm's [K_pad / gk, N, 2] bf16 (scale, zero) per sub-group: (q - 8) * s + (8 - z) * s == (q - z) * s."""
    group = torch.arange(0, k_pad, gk, device=scales.device).clamp(max=k - 1) // group_size  # first column's group
    s, z = scales.float()[:, group], zeros.float()[:, group]  # [N, K_pad / gk]
    return torch.stack([s.t(), ((8 - z) * s).t()], dim=-1).to(torch.bfloat16).contiguous()


def int4_pack(codes: Tensor, scales: Tensor, zeros: Tensor, group_size: int, perm: Tensor | None):
    """codes [N, K] (groups contiguous after perm) -> (packed uint8, scales_and_zeros [K_pad/gk, N, 2], gk)."""
    k = codes.shape[1]
    gk = int4_subgroup_size(group_size, k)
    padded = int4_padded_codes(codes, perm, gk)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(padded.contiguous(), 2)
    return packed, int4_scales_and_zeros(scales, zeros, group_size, k, padded.shape[1], gk), gk


def int4_mm(x: Tensor, packed: Tensor, scales_and_zeros: Tensor, gk: int, perm: Tensor | None) -> Tensor:
    """x [M, K] -> [M, N] in scales_and_zeros' dtype (bf16): fp32 inputs are rounded to bf16, because the
    op's fp32 variant runs ~10x slower than bf16 on this CPU (slower than dequantize + fp32 matmul)."""
    if perm is not None:
        x = x.index_select(1, perm)
    k_pad = scales_and_zeros.shape[0] * gk
    if x.shape[1] != k_pad:
        x = torch.nn.functional.pad(x, (0, k_pad - x.shape[1]))
    return torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.to(scales_and_zeros.dtype).contiguous(), packed, gk, scales_and_zeros
    )


def int4_unpack(packed: Tensor, gk: int, n_groups_k: int, n: int, k: int, perm: Tensor | None) -> Tensor:
    """Recover the codes [N, K] uint8 from the opaque packed layout: multiply by the identity with scale 1, zero 8."""
    k_pad = n_groups_k * gk
    # bf16 is exact for the integers involved (codes 0..15, scale 1, zero 8) and far faster than fp32 here
    unit = torch.stack([torch.ones(n_groups_k, n), torch.full((n_groups_k, n), 8.0)], dim=-1).bfloat16()
    eye = torch.eye(k_pad, dtype=torch.bfloat16)
    codes = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed.cpu(), gk, unit).t()[:, :k]  # [N, K]
    codes = codes.round().to(torch.uint8)
    if perm is None:
        return codes
    out = torch.empty_like(codes)
    out[:, perm.cpu()] = codes
    return out


def group_bounds(in_features: int, group_size: int) -> list[tuple[int, int]]:
    return [(start, min(start + group_size, in_features)) for start in range(0, in_features, group_size)]


def int8_pack(codes: Tensor, group_size: int, perm: Tensor | None) -> Tensor:
    """codes [N, K] -> flat int8 (codes - 128), group-major so that each group is a contiguous [N, len] block."""
    if perm is not None:
        codes = codes[:, perm]
    signed = (codes.to(torch.int16) - 128).to(torch.int8)
    n, k = codes.shape
    return torch.cat([signed[:, a:b].reshape(-1) for a, b in group_bounds(k, group_size)])


def int8_blocks(flat: Tensor, n: int, k: int, group_size: int) -> list[Tensor]:
    """Views [N, len] of each group's block in the flat buffer (no copies)."""
    blocks, offset = [], 0
    for a, b in group_bounds(k, group_size):
        blocks.append(flat[offset : offset + n * (b - a)].view(n, b - a))
        offset += n * (b - a)
    return blocks


def int8_unpack(flat: Tensor, n: int, k: int, group_size: int, perm: Tensor | None) -> Tensor:
    codes = torch.cat(int8_blocks(flat, n, k, group_size), dim=1).to(torch.int16) + 128
    codes = codes.to(torch.uint8)
    if perm is None:
        return codes
    out = torch.empty_like(codes)
    out[:, perm] = codes
    return out


def int8_mm(
    x: Tensor, flat: Tensor, scales: Tensor, zero_shift: Tensor | None, group_size: int, perm: Tensor | None
) -> Tensor:
    """Weight-only int8: x [M, K] -> [M, N] in x's dtype. scales / zero_shift (= z - 128, or None) are [N, G]."""
    n, k = scales.shape[0], x.shape[1]
    if perm is not None:
        x = x.index_select(1, perm)
    if scales.dtype != x.dtype:
        scales = scales.to(x.dtype)
    y = None
    for g, ((a, b), w) in enumerate(zip(group_bounds(k, group_size), int8_blocks(flat, n, k, group_size))):
        xg = x[:, a:b].contiguous()
        part = torch.ops.aten._weight_int8pack_mm(xg, w, scales[:, g].contiguous())
        if zero_shift is not None:
            part = part - xg.sum(-1, keepdim=True) * (scales[:, g] * zero_shift[:, g].to(x.dtype))
        y = part if y is None else y + part
    return y


def w8a8_mm(
    x: Tensor, flat: Tensor, scales: Tensor, zero_shift: Tensor | None, group_size: int, perm: Tensor | None
) -> Tensor:
    """int8 activations (per-token dynamic, as quantize_activations_per_token) x int8 codes: fp32 [M, N]."""

    n, k = scales.shape[0], x.shape[1]
    q, x_scale = quantize_activations_per_token(x)
    if perm is not None:
        q = q.index_select(1, perm)
    acc = None
    for g, ((a, b), w) in enumerate(zip(group_bounds(k, group_size), int8_blocks(flat, n, k, group_size))):
        qg = q[:, a:b].contiguous()
        dots = torch._int_mm(qg, w.t())  # [M, N] exact int32
        if zero_shift is not None:
            dots = dots - qg.sum(-1, keepdim=True, dtype=torch.int32) * zero_shift[:, g].to(torch.int32)
        part = dots.float() * scales[:, g].float()
        acc = part if acc is None else acc + part
    return acc * x_scale


# ---- row gathers (a quantized embedding reads single rows of a packed lm_head) ---------------------------


@dataclass(frozen=True)
class Int4RowLayout:
    """Where torch's CPU int4 pack of an [n, K] matrix keeps row r's codes, for any K: code (r, k) is nibble
    ``start[r] * K + k * stride[r] + offset[r]`` of the flat uint8 buffer (nibble = 2 * byte + high half).

    The pack lays rows out in blocks (64 rows on AVX-512, 32 on AVX2) with one in-block pattern, and the last,
    partial block with its own: rows below n_full repeat the pattern of the first ``period`` rows (shifted by
    whole blocks), the rows from n_full on are listed one by one (tail_*)."""

    period: int
    n_full: int
    start: Tensor  # [period] int64, block-relative
    stride: Tensor  # [period]
    offset: Tensor  # [period]
    tail_start: Tensor  # [n - n_full]
    tail_stride: Tensor
    tail_offset: Tensor

    def rows(self, rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(start, stride, offset) of each row id in rows [T]."""
        r = rows.long().cpu()
        full = r < self.n_full
        q, i = r // self.period, r % self.period
        start, stride, offset = q * self.period + self.start[i], self.stride[i], self.offset[i]
        if len(self.tail_start):
            t = (r - self.n_full).clamp(min=0)
            start = torch.where(full, start, self.tail_start[t])
            stride = torch.where(full, stride, self.tail_stride[t])
            offset = torch.where(full, offset, self.tail_offset[t])
        return start, stride, offset

    def nibbles(self, rows: Tensor, k: int) -> Tensor:
        """[T, k] nibble index of every code of the given rows in a pack with k columns."""
        start, stride, offset = self.rows(rows)
        return (start * k + offset)[:, None] + torch.arange(k)[None, :] * stride[:, None]


def int4_nibble_positions(n: int, k: int) -> Tensor:
    """[n, k] nibble index of each code (r, c) in torch's CPU int4 pack of an [n, k] matrix, found by packing
    the hex digits of each code's own flat index r * k + c and reading them back from every nibble."""
    ids = torch.arange(n * k)
    at_nibble = torch.zeros(n * k, dtype=torch.int64)  # flat id of the code stored at each nibble
    digits = max(1, -(-(n * k - 1).bit_length() // 4))
    for d in range(digits):
        digit = ((ids >> (4 * d)) & 15).view(n, k).to(torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(digit, 2).reshape(-1)
        if packed.numel() * 2 != n * k:
            raise ValueError(f"torch's int4 CPU pack of [{n}, {k}] holds {packed.numel()} bytes, not {n * k // 2}")
        at_nibble |= torch.stack([packed & 15, packed >> 4], 1).reshape(-1).long() << (4 * d)
    if not torch.equal(torch.sort(at_nibble).values, ids):
        raise ValueError("torch's int4 CPU pack is not a permutation of the codes")
    pos = torch.empty_like(at_nibble)
    pos[at_nibble] = ids
    return pos.view(n, k)


@lru_cache(maxsize=8)
def int4_row_layout(n: int) -> Int4RowLayout:
    """Learn the row layout of torch's CPU int4 pack for n rows (packs of 2 and 4 columns fix it), then check
    it on packs of 6 and 8 columns. Raises ValueError when the pack does not follow such a layout."""
    p2, p4 = int4_nibble_positions(n, 2), int4_nibble_positions(n, 4)
    # nibble(r, k) = start * K + k * stride + offset: two pack widths separate start from offset
    start, offset, stride = (p4[:, 0] - p2[:, 0]) // 2, 2 * p2[:, 0] - p4[:, 0], p2[:, 1] - p2[:, 0]
    layout = None
    for period in (16, 32, 64, 128, 256):
        n_full = n // period * period
        if n_full == 0:
            break
        q, i = torch.arange(n_full) // period, torch.arange(n_full) % period
        rel = start[:n_full] - q * period
        if (
            torch.equal(rel, rel[i])
            and torch.equal(stride[:n_full], stride[i])
            and torch.equal(offset[:n_full], offset[i])
        ):
            layout = Int4RowLayout(
                period, n_full, rel[:period], stride[:period], offset[:period],
                start[n_full:], stride[n_full:], offset[n_full:],
            )  # fmt: skip
            break
    if layout is None:  # no repeating block: list every row
        zero = torch.zeros(1, dtype=torch.int64)
        layout = Int4RowLayout(1, 0, zero, zero, zero, start, stride, offset)
    rows = torch.arange(n)
    for k in (2, 4, 6, 8):
        if not torch.equal(layout.nibbles(rows, k), int4_nibble_positions(n, k)):
            raise ValueError(
                f"torch {torch.__version__}'s int4 CPU pack of {n} rows does not keep each row at a fixed stride; "
                "rows cannot be gathered from it (keep the layer on the reference path)"
            )
    return layout


def int4_gather_rows(packed: Tensor, n: int, k_pad: int, rows: Tensor) -> Tensor:
    """Codes [T, k_pad] uint8 of the given rows of an int4_pack'ed [n, k_pad] matrix, without unpacking the rest."""
    nib = int4_row_layout(n).nibbles(rows, k_pad).to(packed.device)
    byte = packed.reshape(-1)[nib >> 1].to(torch.int32)
    return ((byte >> ((nib & 1) * 4)) & 15).to(torch.uint8)


def int8_gather_rows(flat: Tensor, n: int, k: int, group_size: int, rows: Tensor) -> Tensor:
    """Codes [T, k] uint8 (in the packed column order) of the given rows of an int8_pack'ed [n, k] matrix."""
    blocks = [b.index_select(0, rows) for b in int8_blocks(flat, n, k, group_size)]
    return (torch.cat(blocks, 1).to(torch.int16) + 128).to(torch.uint8)
