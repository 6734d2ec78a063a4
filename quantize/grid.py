"""The uniform integer grid shared by RTN, GPTQ and AWQ: per-row (per-group) scale and zero point, rounding,
and the optional MSE search over shrunken ranges (the GPTQ reference's ``mse`` option).

Conventions match quantize.qlinear: ``codes = clamp(round(w / scale) + zero, 0, maxq)`` and
``w_hat = (codes - zero) * scale``. Asymmetric grids span [min(w, 0), max(w, 0)] with an integer zero point;
symmetric grids span [-amax, amax] with the zero point fixed at ``(maxq + 1) / 2 == 2**(bits-1)``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def find_params(
    w: Tensor,
    bits: int,
    sym: bool,
    mse: bool = False,
    grid: int = 100,
    max_shrink: float = 0.8,
    norm: float = 2.4,
) -> tuple[Tensor, Tensor]:
    """Grid for each row of w [rows, cols] -> (scale [rows], zero [rows]), both float32.

    With mse=True the range is shrunk by factors 1, 1-1/grid, ... (max_shrink*grid steps) and the one with the
    smallest sum |w_hat - w|^norm per row is kept (clipping outliers can lower the total error).
    """
    w = w.float()
    maxq = 2**bits - 1
    xmin = w.amin(1).clamp(max=0)
    xmax = w.amax(1).clamp(min=0)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = -xmax
    empty = (xmin == 0) & (xmax == 0)  # an all-zero row: any positive scale represents it exactly
    xmin, xmax = torch.where(empty, -1.0, xmin), torch.where(empty, 1.0, xmax)
    scale, zero = _range_to_params(xmin, xmax, maxq, sym)
    if not mse:
        return scale, zero
    best = torch.full_like(xmin, float("inf"))
    for i in range(int(max_shrink * grid)):
        shrink = 1 - i / grid
        s, z = _range_to_params(shrink * xmin, shrink * xmax, maxq, sym)
        err = (fake_quantize(w, s[:, None], z[:, None], maxq) - w).abs().pow(norm).sum(1)
        better = err < best
        best = torch.where(better, err, best)
        scale, zero = torch.where(better, s, scale), torch.where(better, z, zero)
    return scale, zero


def _range_to_params(xmin: Tensor, xmax: Tensor, maxq: int, sym: bool) -> tuple[Tensor, Tensor]:
    # Scales are rounded to fp16 here, before any code is computed, because packed checkpoints (GPTQ, AWQ)
    # store fp16 scales: a saved-and-loaded model then equals the in-memory one bit for bit.
    scale = ((xmax - xmin) / maxq).clamp(min=2**-24).half().float()
    zero = torch.full_like(scale, (maxq + 1) / 2) if sym else torch.round(-xmin / scale)
    return scale, zero


def quantize_codes(w: Tensor, scale: Tensor, zero: Tensor, maxq: int) -> Tensor:
    """Integer codes (as float) of w under the grid; scale/zero broadcast against w."""
    return torch.clamp(torch.round(w / scale) + zero, 0, maxq)


def fake_quantize(w: Tensor, scale: Tensor, zero: Tensor, maxq: int) -> Tensor:
    return scale * (quantize_codes(w, scale, zero, maxq) - zero)


def group_bounds(in_features: int, group_size: int) -> list[tuple[int, int]]:
    """Column ranges of the groups; the last one is shorter when group_size does not divide the width."""
    return [(s, min(s + group_size, in_features)) for s in range(0, in_features, group_size)]


def group_params(w: Tensor, bits: int, sym: bool, group_size: int, **search) -> tuple[Tensor, Tensor]:
    """Grid of each (row, group) of w [out, in] -> (scales [out, n_groups], zeros [out, n_groups])."""
    out_features, in_features = w.shape
    n_full = in_features // group_size
    scales, zeros = [], []
    if n_full:  # all full groups in one batched call: rows become (row, group) pairs
        full = w[:, : n_full * group_size].reshape(out_features * n_full, group_size)
        s, z = find_params(full, bits, sym, **search)
        scales.append(s.view(out_features, n_full))
        zeros.append(z.view(out_features, n_full))
    if in_features % group_size:
        s, z = find_params(w[:, n_full * group_size :], bits, sym, **search)
        scales.append(s[:, None])
        zeros.append(z[:, None])
    return torch.cat(scales, 1), torch.cat(zeros, 1)


def expand_groups(params: Tensor, in_features: int, group_size: int) -> Tensor:
    """[out, n_groups] -> [out, in]: each column gets its group's value."""
    g = torch.arange(in_features, device=params.device) // group_size
    return params[:, g]


def quantize_activations_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """Dynamic symmetric int8 per token: x ≈ q * s with q in [-127, 127], s = max|x| / 127 per row."""
    scale = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-8) / 127.0
    q = torch.clamp(torch.round(x.float() / scale), -127, 127).to(torch.int8)
    return q, scale
