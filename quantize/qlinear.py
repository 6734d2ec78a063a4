"""The shared quantized-linear contract.

Every quantizer (RTN, int8, GPTQ, AWQ) produces a ``QuantizedWeight``: unsigned integer codes plus
per-group scales and zero points. Every packed format saves and loads one. ``QuantLinear`` holds one and
is a drop-in for ``nn.Linear`` (same ``forward(x)`` contract); its ``reference`` path is plain
dequantize-then-matmul, which faster paths (CPU packed ops, Triton) are tested against.

Dequantization: ``W[o, i] = (codes[o, i] - zeros[o, g]) * scales[o, g]`` with ``g = g_idx[i]``.
Symmetric quantization is the case ``zeros == 2**(bits-1)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SUPPORTED_BITS = (2, 3, 4, 8)


@dataclass
class QuantizedWeight:
    codes: Tensor  # [out, in] uint8, values in [0, 2**bits)
    scales: Tensor  # [out, n_groups] float
    zeros: Tensor  # [out, n_groups] float (integer-valued zero points in code units)
    bits: int
    group_size: int  # input columns per group; == in_features for per-channel
    g_idx: Tensor | None = None  # [in] int32 group of each input column (act-order); None: i // group_size
    bias: Tensor | None = None

    def __post_init__(self):
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"unsupported bit width {self.bits}; supported: {SUPPORTED_BITS}")
        out_features, in_features = self.codes.shape
        n_groups = -(-in_features // self.group_size)
        if self.scales.shape != (out_features, n_groups) or self.zeros.shape != (out_features, n_groups):
            raise ValueError(
                f"scales {tuple(self.scales.shape)} / zeros {tuple(self.zeros.shape)} do not match "
                f"codes {tuple(self.codes.shape)} with group size {self.group_size} ({n_groups} groups)"
            )

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def n_groups(self) -> int:
        return self.scales.shape[1]

    def group_index(self) -> Tensor:
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.in_features, device=self.codes.device) // self.group_size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        g = self.group_index()
        w = (self.codes.float() - self.zeros.float()[:, g]) * self.scales.float()[:, g]
        return w.to(dtype)

    def weight_bytes(self) -> int:
        """Bytes of a packed checkpoint: bits per code plus fp16 scales and zeros per group."""
        return self.codes.numel() * self.bits // 8 + 2 * 2 * self.scales.numel()


def quantize_activations_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """Dynamic symmetric int8 per token: x ≈ q * s with q in [-127, 127], s = max|x| / 127 per row."""
    scale = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-8) / 127.0
    q = torch.clamp(torch.round(x.float() / scale), -127, 127).to(torch.int8)
    return q, scale


class QuantLinear(nn.Module):
    """nn.Linear stand-in holding a QuantizedWeight.

    act_quant=True is W8A8: activations are quantized per token to int8 before the matmul (the reference
    path dequantizes both; fast paths use an integer matmul and give the same result up to summation order).
    """

    def __init__(self, qweight: QuantizedWeight, act_quant: bool = False, compute_dtype: torch.dtype = torch.float32):
        super().__init__()
        if act_quant and qweight.bits != 8:
            raise ValueError("W8A8 needs 8-bit weights")
        self.in_features, self.out_features = qweight.in_features, qweight.out_features
        self.bits, self.group_size, self.act_quant = qweight.bits, qweight.group_size, act_quant
        self.register_buffer("codes", qweight.codes.to(torch.uint8))
        self.register_buffer("scales", qweight.scales.to(compute_dtype))
        self.register_buffer("zeros", qweight.zeros.to(compute_dtype))
        self.register_buffer("g_idx", None if qweight.g_idx is None else qweight.g_idx.to(torch.int32))
        self.register_buffer("bias", None if qweight.bias is None else qweight.bias.to(compute_dtype))
        self.path = "reference"  # which forward implementation runs; fast paths set this

    @property
    def weight(self) -> Tensor:
        """The dequantized weight (for code that inspects .weight; not used by forward fast paths)."""
        return self.qweight().dequantize(self.scales.dtype)

    def qweight(self) -> QuantizedWeight:
        return QuantizedWeight(self.codes, self.scales, self.zeros, self.bits, self.group_size, self.g_idx, self.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.reference_forward(x)

    def reference_forward(self, x: Tensor) -> Tensor:
        w = self.qweight().dequantize(torch.float32)
        if self.act_quant:
            q, s = quantize_activations_per_token(x)
            y = F.linear(q.float(), w) * s
        else:
            y = F.linear(x.float(), w)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, bits={self.bits}, group_size={self.group_size}, "
            f"act_order={self.g_idx is not None}, w8a8={self.act_quant}, path={self.path}"
        )


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the submodule at a dotted path (e.g. 'layers.3.mlp.down_proj')."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)
