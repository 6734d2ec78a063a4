"""GPTQ packed layout (AutoGPTQ / GPTQModel / transformers), checkpoint formats "gptq" (v1) and "gptq_v2".

Per linear layer ``P`` (in -> out features, G groups, b bits):
  P.qweight  int32 [in * b / 32, out]   codes packed along the input dim, low bits first (3-bit crosses words)
  P.qzeros   int32 [G, out * b / 32]    zero points packed along the output dim; v1 stores zero - 1
  P.scales   fp16  [G, out]
  P.g_idx    int32 [in]                 group of each input column (act-order permutes it)
  P.bias     [out]                      only when the layer has one
Dequantization: W[o, i] = (q[i, o] - z[g_idx[i], o]) * s[g_idx[i], o].
"""

from __future__ import annotations

import torch
from torch import Tensor

from quantize.formats.errors import CheckpointError, expect_tensor, fp16_scales, group_layout, optional_bias
from quantize.packing import block_shape, pack_codes, unpack_codes
from quantize.qlinear import QuantizedWeight

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


def check_packable(name: str, qw: QuantizedWeight) -> None:
    codes_per_block = block_shape(qw.bits)[0]
    for what, n in (("in_features", qw.in_features), ("out_features", qw.out_features)):
        if n % codes_per_block:
            raise CheckpointError(
                f"{name}: GPTQ packs {qw.bits}-bit codes {codes_per_block} at a time; {what}={n} is not a multiple"
            )


def integer_zeros(name: str, qw: QuantizedWeight, checkpoint_format: str) -> Tensor:
    """Zero points as int64 in the range the format can store; anything else is an error naming the layer."""
    z = qw.zeros.double()
    if not torch.equal(z, z.round()):
        raise CheckpointError(f"{name}: zero points are not integers; GPTQ stores integer zero points")
    z = z.long()
    low, high = (1, 2**qw.bits) if checkpoint_format == "gptq" else (0, 2**qw.bits - 1)
    if int(z.min()) < low or int(z.max()) > high:
        hint = (
            " (v1 stores zero - 1, so zero point 0, a group with no negative weight, needs --format gptq_v2 or "
            "compressed-tensors, or --sym)"
            if checkpoint_format == "gptq"
            else ""
        )
        raise CheckpointError(
            f"{name}: zero points span [{int(z.min())}, {int(z.max())}], {checkpoint_format} with {qw.bits} bits "
            f"stores [{low}, {high}]{hint}"
        )
    return z


def to_tensors(name: str, qw: QuantizedWeight, checkpoint_format: str = "gptq_v2") -> dict[str, Tensor]:
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"unknown GPTQ checkpoint_format {checkpoint_format!r}; expected one of {CHECKPOINT_FORMATS}")
    check_packable(name, qw)
    stored_zeros = integer_zeros(name, qw, checkpoint_format) - (1 if checkpoint_format == "gptq" else 0)
    tensors = {
        f"{name}.qweight": pack_codes(qw.codes.t(), qw.bits),
        f"{name}.qzeros": pack_codes(stored_zeros, qw.bits).t().contiguous(),
        f"{name}.scales": fp16_scales(name, qw.scales).t().contiguous(),
        f"{name}.g_idx": qw.group_index().to(torch.int32),
    }
    if qw.bias is not None:
        tensors[f"{name}.bias"] = qw.bias
    return tensors


def from_tensors(
    tensors: dict[str, Tensor],
    name: str,
    in_features: int,
    out_features: int,
    bits: int,
    group_size: int,
    checkpoint_format: str,
) -> QuantizedWeight:
    """One layer's GPTQ tensors -> QuantizedWeight (checked against the expected shapes, naming any mismatch)."""
    group_size, n_groups = group_layout(group_size, in_features)
    codes_per_block, words_per_block = block_shape(bits)
    if in_features % codes_per_block or out_features % codes_per_block:
        raise CheckpointError(f"{name}: {in_features}x{out_features} cannot hold packed {bits}-bit codes")
    qweight = expect_tensor(tensors, f"{name}.qweight", (in_features * bits // 32, out_features), torch.int32)
    qzeros = expect_tensor(tensors, f"{name}.qzeros", (n_groups, out_features * bits // 32), torch.int32)
    scales = expect_tensor(tensors, f"{name}.scales", (n_groups, out_features), None)
    g_idx = tensors.get(f"{name}.g_idx")
    if g_idx is not None:
        g_idx = expect_tensor(tensors, f"{name}.g_idx", (in_features,), None).to(torch.int64)
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= n_groups:
            raise CheckpointError(
                f"tensor {name}.g_idx: group ids span [{int(g_idx.min())}, {int(g_idx.max())}], "
                f"but there are {n_groups} groups"
            )
        if torch.equal(g_idx, torch.arange(in_features) // group_size):
            g_idx = None  # the plain grouping: no act-order
    bias = optional_bias(tensors, name, out_features)
    codes = unpack_codes(qweight, bits, in_features).t().contiguous()  # [out, in]
    zeros = unpack_codes(qzeros.t(), bits, out_features).float()  # [out, G]
    if checkpoint_format == "gptq":
        zeros = zeros + 1  # v1 stores zero - 1 (AutoGPTQ's kernels add the one back)
    return QuantizedWeight(
        codes=codes,
        scales=scales.t().float().contiguous(),
        zeros=zeros.contiguous(),
        bits=bits,
        group_size=group_size,
        g_idx=None if g_idx is None else g_idx.to(torch.int32),
        bias=bias,
    )
