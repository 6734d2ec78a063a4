"""A weight quantizer as a plug-in: symmetric absmax rounding per group of input columns. It returns integer
codes, scales and zeros (quantize.qlinear.QuantizedWeight), so qspec's layers, formats and loaders do the rest.

    python -m quantize.plugin --method qspec_plugin_example.absmax:Absmax --bits 4 --group-size 64 --out DIR
"""

from __future__ import annotations

import torch
from torch import Tensor

from quantize.config import QuantConfig
from quantize.qlinear import QuantizedWeight
from quantize.registry import WeightQuantizer


class Absmax(WeightQuantizer):
    name = "absmax"

    def __init__(self, shrink: float = 1.0):
        self.shrink = shrink  # scale the absmax range down (< 1 clips the largest weights)

    def quantize_weight(self, weight: Tensor, cfg: QuantConfig, name: str) -> QuantizedWeight:
        out_f, in_f = weight.shape
        g = cfg.group_size_for(in_f, name)
        w = weight.float().reshape(out_f, -1, g)  # [out, n_groups, g]
        half = 2 ** (cfg.bits - 1)  # the symmetric grid's zero point
        scales = (w.abs().amax(-1) * self.shrink / (half - 1)).clamp(min=1e-8)  # [out, n_groups]
        scales = scales.half().float()  # checkpoints store fp16 scales: the saved model then equals this one
        codes = (w / scales[..., None]).round().clamp(1 - half, half - 1) + half
        zeros = torch.full_like(scales, float(half))
        return QuantizedWeight(codes.reshape(out_f, in_f).to(torch.uint8), scales, zeros, cfg.bits, g)

    def describe(self) -> dict:
        return {"name": self.name, "shrink": self.shrink}
