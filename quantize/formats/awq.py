"""AWQ GEMM packed layout (AutoAWQ, transformers ``quant_method: awq``, ``version: gemm``).

Per linear layer ``P`` (in -> out features, G = in // group_size groups, 4 bits; in % group_size must be 0):
  P.qweight  int32 [in, out / 8]   codes packed along the OUTPUT dim, 8 per word in AWQ_ORDER (0,2,4,6,1,3,5,7)
  P.qzeros   int32 [G, out / 8]    zero points, same packing, stored as is
  P.scales   fp16  [G, out]
  P.bias     [out]                 only when the layer has one
No g_idx: AWQ groups are always contiguous. With ``zero_point: false`` the zero point is 2**(bits-1).
"""

from __future__ import annotations

import torch
from torch import Tensor

from quantize.formats.errors import CheckpointError, expect_tensor, fp16_scales, group_layout, optional_bias
from quantize.packing import pack_codes_awq, unpack_codes_awq
from quantize.qlinear import QuantizedWeight

VERSIONS = ("gemm",)


def to_tensors(name: str, qw: QuantizedWeight) -> dict[str, Tensor]:
    if qw.bits != 4:
        raise CheckpointError(f"{name}: AWQ GEMM stores 4-bit codes, this layer has {qw.bits} bits")
    if qw.g_idx is not None:
        raise CheckpointError(f"{name}: AWQ has no g_idx, so act-order (permuted groups) cannot be saved; use GPTQ")
    if qw.out_features % 8:
        raise CheckpointError(f"{name}: AWQ GEMM packs 8 output columns per word; out_features={qw.out_features}")
    z = qw.zeros.double()
    if not torch.equal(z, z.round()) or int(z.min()) < 0 or int(z.max()) > 15:
        raise CheckpointError(f"{name}: AWQ stores integer zero points in [0, 15]")
    tensors = {
        f"{name}.qweight": pack_codes_awq(qw.codes.t()),
        f"{name}.qzeros": pack_codes_awq(z.long().t()),
        f"{name}.scales": fp16_scales(name, qw.scales).t().contiguous(),
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
    zero_point: bool,
) -> QuantizedWeight:
    if bits != 4:
        raise CheckpointError(f"AWQ GEMM checkpoints hold 4-bit codes; quantization_config says bits={bits}")
    if out_features % 8:
        raise CheckpointError(f"{name}: out_features={out_features} cannot hold AWQ GEMM words of 8 codes")
    group_size, n_groups = group_layout(group_size, in_features)
    if in_features % group_size:  # AutoAWQ allocates in // group_size groups: a ragged tail has no scales
        raise CheckpointError(
            f"{name}: in_features {in_features} is not a multiple of group_size {group_size}; AWQ GEMM holds "
            f"in // group_size = {in_features // group_size} groups, so the last {in_features % group_size} "
            "columns have no scale (not a valid AWQ checkpoint)"
        )
    qweight = expect_tensor(tensors, f"{name}.qweight", (in_features, out_features // 8), torch.int32)
    scales = expect_tensor(tensors, f"{name}.scales", (n_groups, out_features), None)
    if zero_point:
        qzeros = expect_tensor(tensors, f"{name}.qzeros", (n_groups, out_features // 8), torch.int32)
        zeros = unpack_codes_awq(qzeros).t().float()
    else:
        zeros = torch.full((out_features, n_groups), 2.0 ** (bits - 1))
    bias = optional_bias(tensors, name, out_features)
    return QuantizedWeight(
        codes=unpack_codes_awq(qweight).t().contiguous(),
        scales=scales.t().float().contiguous(),
        zeros=zeros.contiguous(),
        bits=bits,
        group_size=group_size,
        bias=bias,
    )
