"""Round-to-nearest of one weight matrix onto a QuantConfig's grid: the one RTN that quantize.rtn, AWQ's RTN
stages and scale search, int8 and ``--rotate-layers auto`` (quantize.cli) all use. It sits below quantize.cli,
which cannot import quantize.rtn (rtn is a CLI built on cli); quantize.rtn re-exports it."""

from __future__ import annotations

import torch
from torch import Tensor

from quantize.config import QuantConfig
from quantize.grid import expand_groups, group_params, quantize_codes
from quantize.qlinear import QuantizedWeight


def quantize_weight(
    weight: Tensor, cfg: QuantConfig, bias: Tensor | None = None, mse: bool = False, name: str = "layer"
) -> QuantizedWeight:
    """RTN of one weight [out, in] onto cfg's grid (groups of consecutive input columns); ``.dequantize()`` of
    the result is the fake-quantized (round-tripped) weight."""
    w = weight.detach().float()
    group_size = cfg.group_size_for(w.shape[1], name)
    scales, zeros = group_params(w, cfg.bits, cfg.sym, group_size, mse=mse)
    codes = quantize_codes(
        w, expand_groups(scales, w.shape[1], group_size), expand_groups(zeros, w.shape[1], group_size), cfg.maxq
    )
    return QuantizedWeight(
        codes=codes.to(torch.uint8),
        scales=scales,
        zeros=zeros,
        bits=cfg.bits,
        group_size=group_size,
        bias=None if bias is None else bias.detach().float(),
    )
