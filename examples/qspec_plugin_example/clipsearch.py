"""A calibrated weight quantizer as a plug-in: per group of input columns, the clipping range that minimises the
error of the layer's outputs on calibration inputs (the search AWQ's auto-clip does, without AWQ's scaling). qspec
runs the calibration pass and hands each linear its inputs; the plug-in returns integer codes, scales and zeros.

    python -m quantize.plugin --method qspec_plugin_example.clipsearch:ClipSearch --bits 3 --group-size 64 \\
        --nsamples 32 --seqlen 512 --out DIR
"""

from __future__ import annotations

import torch
from torch import Tensor

from quantize.config import QuantConfig
from quantize.qlinear import QuantizedWeight
from quantize.registry import CalibratedQuantizer


def fake_quantize(w: Tensor, ratio: float, bits: int, sym: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """w [out, n_groups, g] on a grid whose range is the group's own shrunk by ratio -> (dequantized, codes,
    scales, zeros); scales rounded to fp16, as checkpoints store them."""
    top = 2**bits - 1
    if sym:
        half = 2 ** (bits - 1)
        scales = (w.abs().amax(-1) * ratio / (half - 1)).clamp(min=1e-8).half().float()
        zeros = torch.full_like(scales, float(half))
        codes = (w / scales[..., None]).round().clamp(1 - half, half - 1) + half
    else:
        hi, lo = w.amax(-1).clamp(min=0) * ratio, w.amin(-1).clamp(max=0) * ratio
        scales = ((hi - lo) / top).clamp(min=1e-8).half().float()
        zeros = (-lo / scales).round().clamp(0, top)
        codes = (w / scales[..., None] + zeros[..., None]).round().clamp(0, top)
    return (codes - zeros[..., None]) * scales[..., None], codes, scales, zeros


class ClipSearch(CalibratedQuantizer):
    name = "clip-search"

    def __init__(self, steps: int = 10, min_ratio: float = 0.5, tokens: int = 512):
        self.steps, self.min_ratio, self.tokens = steps, min_ratio, tokens  # ratios 1, ..., min_ratio; tokens used

    def ratios(self) -> list[float]:
        return [1.0 - (1.0 - self.min_ratio) * i / max(self.steps - 1, 1) for i in range(self.steps)]

    def quantize_weight(self, weight: Tensor, cfg: QuantConfig, name: str, inputs: list[Tensor]) -> QuantizedWeight:
        out_f, in_f = weight.shape
        g = cfg.group_size_for(in_f, name)
        x = torch.cat([b.reshape(-1, in_f) for b in inputs]).float()
        x = x[torch.linspace(0, len(x) - 1, min(self.tokens, len(x))).long()]  # evenly spaced tokens [n, in]
        pad = -in_f % g  # a last, partial group: zero columns change no range and no output
        x, w = torch.nn.functional.pad(x, (0, pad)), torch.nn.functional.pad(weight.float(), (0, pad))
        xg = x.reshape(len(x), -1, g).transpose(0, 1)  # [n_groups, n, g]
        w = w.reshape(out_f, -1, g)  # [out, n_groups, g]
        best_err = torch.full(w.shape[:2], float("inf"))
        best = None
        for ratio in self.ratios():
            deq, codes, scales, zeros = fake_quantize(w, ratio, cfg.bits, cfg.sym)
            # each group's share of the output error: sum over tokens of (x_g . (w_g - q_g))^2 -> [out, n_groups]
            err = torch.einsum("gnk,ogk->ogn", xg, w - deq).square().sum(-1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            if best is None:
                best = [codes, scales, zeros]
            else:
                best[0] = torch.where(better[..., None], codes, best[0])
                best[1] = torch.where(better, scales, best[1])
                best[2] = torch.where(better, zeros, best[2])
        codes, scales, zeros = best
        codes = codes.reshape(out_f, -1)[:, :in_f]
        return QuantizedWeight(codes.to(torch.uint8), scales, zeros, cfg.bits, g)

    def describe(self) -> dict:
        return {"name": self.name, "steps": self.steps, "min_ratio": self.min_ratio, "tokens": self.tokens}
