"""compressed-tensors layouts (what llm-compressor writes and vLLM prefers), ``quant_method: compressed-tensors``.

Codes are signed there: ``q = code - 2**(b-1)``, ``zero_point = zero - 2**(b-1)``, ``W = (q - zero_point) * scale``
(the same weight as qspec's ``(code - zero) * scale``). Per linear layer ``P`` (out x in, G groups):

format "pack-quantized" (int weight-only, 2..8 bits, strategy "group" or "channel"):
  P.weight_packed      int32 [out, ceil(in * b / 32)]  q + 2**(b-1) as one little-endian bit stream per row
                                                       (32 codes fill b words; a short tail is zero-padded)
  P.weight_scale       fp16  [out, G]
  P.weight_zero_point  int32 [ceil(out * b / 32), G]   asymmetric only: zero points, packed along dim 0
  P.weight_shape       int64 [2]                       (out, in)
format "int-quantized" (W8A8: int8 weights, dynamic per-token int8 activations):
  P.weight             int8  [out, in]                  q, symmetric per-channel
  P.weight_scale       fp16  [out, 1]
format "float-quantized" (FP8 e4m3 weights, quantize.fplinear.FloatWeight; W8A8-FP8 adds dynamic per-token
e4m3 activations, llm-compressor's FP8_DYNAMIC scheme; strategy "channel" or "block" with block_structure):
  P.weight             float8_e4m3fn [out, in]          the e4m3 codes, W = weight * weight_scale
  P.weight_scale       fp32  [out, 1] (channel) or [ceil(out/b), ceil(in/b)] (block b x b): stored in fp32,
                                                       exactly qspec's scales (vLLM loads them into fp32)
Groups are contiguous: compressed-tensors (>= 0.14) dropped the g_idx layout ("actorder: group"), so act-order
checkpoints are expressible only with static groups ("actorder: weight", no g_idx). Group sizes must divide
the input width (the library's group reshape refuses a ragged one).
"""

from __future__ import annotations

import torch
from torch import Tensor

from quantize.formats.errors import CheckpointError, expect_tensor, fp16_scales, optional_bias
from quantize.fplinear import E4M3, FloatWeight
from quantize.packing import pack_codes, unpack_codes
from quantize.qlinear import QuantizedWeight

# The compressed-tensors release whose layout and config this follows (and the tests decompress with).
CT_VERSION = "0.20.1"
FORMATS = ("pack-quantized", "int-quantized", "float-quantized")
FLOAT_FORMAT = "float-quantized"


def packed_words(n: int, bits: int) -> int:
    return -(-n * bits // 32)


def pack_rows(codes: Tensor, bits: int) -> Tensor:
    """codes [rows, n] (unsigned, < 2**bits) -> int32 [rows, ceil(n * bits / 32)]: each row one bit stream."""
    rows, n = codes.shape
    padded = -(-n // 32) * 32
    if padded > n:
        codes = torch.cat([codes, codes.new_zeros(rows, padded - n)], 1)
    return pack_codes(codes.t(), bits).t()[:, : packed_words(n, bits)].contiguous()


def unpack_rows(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of pack_rows: int32 [rows, ceil(n * bits / 32)] -> uint8 [rows, n]."""
    rows, words = packed.shape
    padded_words = -(-n // 32) * bits
    if padded_words > words:
        packed = torch.cat([packed, packed.new_zeros(rows, padded_words - words)], 1)
    return unpack_codes(packed.t(), bits, -(-n // 32) * 32).t()[:, :n].contiguous()


def weight_args(bits: int, group_size: int, symmetric: bool, actorder: str | None = None) -> dict:
    """QuantizationArgs for the weights, serialised as compressed-tensors does (None fields omitted)."""
    args = {
        "num_bits": bits,
        "type": "int",
        "symmetric": symmetric,
        "group_size": group_size if group_size > 0 else None,
        "strategy": "group" if group_size > 0 else "channel",
        "dynamic": False,
    }
    if actorder is not None:
        args["actorder"] = actorder
    return args


def float_weight_args(block: int) -> dict:
    """QuantizationArgs of FP8 e4m3 weights: per-channel (block 0) or block x block scales."""
    strategy = {"strategy": "block", "block_structure": [block, block]} if block else {"strategy": "channel"}
    return {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, **strategy, "dynamic": False}


def token_activation_args(kind: str) -> dict:
    """Dynamic symmetric per-token 8-bit activations (kind "int" or "float")."""
    return {"num_bits": 8, "type": kind, "symmetric": True, "group_size": None, "strategy": "token", "dynamic": True}


def quantization_config(
    bits: int, group_size: int, symmetric: bool, act_quant: bool, ignore: list[str], actorder: str | None = None
) -> dict:
    """``quantization_config`` of integer weights as llm-compressor writes it."""
    fmt = "int-quantized" if act_quant else "pack-quantized"
    inputs = token_activation_args("int") if act_quant else None  # W8A8: per-token int8 activations
    return config_document(fmt, weight_args(bits, group_size, symmetric, actorder), inputs, ignore)


def float_quantization_config(block: int, act_quant: bool, ignore: list[str]) -> dict:
    """``quantization_config`` of FP8 e4m3 weights (W8A8-FP8 with act_quant) as llm-compressor writes it."""
    inputs = token_activation_args("float") if act_quant else None
    return config_document(FLOAT_FORMAT, float_weight_args(block), inputs, ignore)


def config_document(fmt: str, weights: dict, inputs: dict | None, ignore: list[str]) -> dict:
    """llm-compressor's serialisation (ModelCompressor.update_config): one config group targeting every Linear,
    the unquantized ones listed in ``ignore``."""
    return {
        "version": CT_VERSION,
        "quant_method": "compressed-tensors",
        "sparsity_config": {},
        "transform_config": {},
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": inputs,
                "output_activations": None,
                "format": fmt,
            }
        },
        "kv_cache_scheme": None,
        "format": fmt,
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "ignore": ignore,
    }


def to_tensors(name: str, qw: QuantizedWeight, symmetric: bool, act_quant: bool) -> dict[str, Tensor]:
    """One layer's tensors; the layer must already have passed quantize.formats.refusal."""
    half = 2 ** (qw.bits - 1)
    zeros = qw.zeros.double()
    if not torch.equal(zeros, zeros.round()) or int(zeros.min()) < 0 or int(zeros.max()) >= 2**qw.bits:
        raise CheckpointError(f"{name}: compressed-tensors stores integer zero points in [0, {2**qw.bits - 1}]")
    tensors = {f"{name}.weight_scale": fp16_scales(name, qw.scales).contiguous()}
    if act_quant:
        tensors[f"{name}.weight"] = (qw.codes.to(torch.int16) - half).to(torch.int8).contiguous()
    else:
        tensors[f"{name}.weight_packed"] = pack_rows(qw.codes, qw.bits)
        tensors[f"{name}.weight_shape"] = torch.tensor([qw.out_features, qw.in_features])
        if not symmetric:
            tensors[f"{name}.weight_zero_point"] = pack_rows(zeros.long().t(), qw.bits).t().contiguous()
    if qw.bias is not None:
        tensors[f"{name}.bias"] = qw.bias
    return tensors


def parse_config(qc: dict) -> dict:
    """A compressed-tensors ``quantization_config`` -> the settings qspec can load, or a CheckpointError."""
    fmt = str(qc.get("format", ""))
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise CheckpointError("compressed-tensors quantization_config has no config_groups")
    weights = groups[0].get("weights")
    inputs = groups[0].get("input_activations")
    if any(g.get("weights") != weights or g.get("input_activations") != inputs for g in groups):
        raise CheckpointError("compressed-tensors: config groups with different schemes are not supported")
    fmt = groups[0].get("format") or fmt
    if fmt not in FORMATS:
        raise CheckpointError(f"unsupported compressed-tensors format {fmt!r}; supported: {FORMATS}")
    if fmt == FLOAT_FORMAT:
        return parse_float_config(weights, inputs)
    if not weights or weights.get("type", "int") != "int":
        raise CheckpointError(f"compressed-tensors: only integer weights are supported, got {weights}")
    strategy = weights.get("strategy") or ("group" if (weights.get("group_size") or 0) > 0 else "channel")
    if strategy not in ("group", "channel"):
        raise CheckpointError(f"compressed-tensors: weight strategy {strategy!r} not supported (group, channel)")
    if weights.get("actorder") in ("group", "dynamic"):
        raise CheckpointError("compressed-tensors: actorder 'group' (g_idx) is not supported; 'weight' is")
    act_quant = inputs is not None
    if act_quant and not (
        inputs.get("num_bits") == 8 and inputs.get("type", "int") == "int" and inputs.get("dynamic") is True
    ):
        raise CheckpointError(f"compressed-tensors: input activations {inputs} not supported (dynamic int8 only)")
    bits = int(weights["num_bits"])
    return {
        "method": "compressed-tensors",
        "format": fmt,
        "bits": bits,
        "group_size": int(weights["group_size"]) if strategy == "group" else -1,
        "symmetric": bool(weights.get("symmetric", True)),
        "act_quant": act_quant,
    }


def from_tensors(tensors: dict[str, Tensor], name: str, in_features: int, out_features: int, qc: dict):
    bits, group_size = qc["bits"], qc["group_size"]
    if group_size > 0 and in_features % group_size:
        raise CheckpointError(f"{name}: in_features {in_features} is not a multiple of group_size {group_size}")
    group_size = in_features if group_size <= 0 else group_size
    n_groups = in_features // group_size
    half = 2 ** (bits - 1)
    scales = expect_tensor(tensors, f"{name}.weight_scale", (out_features, n_groups), None)
    if qc["format"] == "int-quantized":
        weight = expect_tensor(tensors, f"{name}.weight", (out_features, in_features), torch.int8)
        codes = (weight.to(torch.int16) + half).to(torch.uint8)
    else:
        shape = expect_tensor(tensors, f"{name}.weight_shape", (2,), None)
        if shape.tolist() != [out_features, in_features]:
            raise CheckpointError(
                f"tensor {name}.weight_shape is {shape.tolist()}, expected {[out_features, in_features]}"
            )
        packed = expect_tensor(
            tensors, f"{name}.weight_packed", (out_features, packed_words(in_features, bits)), torch.int32
        )
        codes = unpack_rows(packed, bits, in_features)
    if qc["symmetric"]:
        zeros = torch.full((out_features, n_groups), float(half))
    else:
        zp = expect_tensor(
            tensors, f"{name}.weight_zero_point", (packed_words(out_features, bits), n_groups), torch.int32
        )
        zeros = unpack_rows(zp.t().contiguous(), bits, out_features).t().float()
    return QuantizedWeight(
        codes=codes,
        scales=scales.float().contiguous(),
        zeros=zeros.contiguous(),
        bits=bits,
        group_size=group_size,
        bias=optional_bias(tensors, name, out_features),
    )


def parse_float_config(weights: dict | None, inputs: dict | None) -> dict:
    """The float-quantized settings qspec loads: 8-bit float weights, per channel or square blocks, optional
    dynamic per-token float8 activations."""
    if not weights or weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise CheckpointError(
            f"compressed-tensors float-quantized: only 8-bit float weights are supported, got {weights}"
        )
    strategy = weights.get("strategy")
    structure = weights.get("block_structure") or []
    if strategy == "block" and (len(structure) != 2 or structure[0] != structure[1]):
        raise CheckpointError(f"compressed-tensors: block_structure {structure} not supported (square blocks only)")
    if strategy not in ("channel", "block"):
        raise CheckpointError(
            f"compressed-tensors float-quantized: strategy {strategy!r} not supported (channel, block)"
        )
    act_quant = inputs is not None
    if act_quant and {k: inputs.get(k) for k in ("num_bits", "type", "strategy", "dynamic")} != {
        "num_bits": 8, "type": "float", "strategy": "token", "dynamic": True
    }:  # fmt: skip
        raise CheckpointError(f"compressed-tensors: input activations {inputs} not supported (dynamic per-token fp8)")
    block = int(structure[0]) if strategy == "block" else 0
    return {"method": "compressed-tensors", "format": FLOAT_FORMAT, "bits": 8, "block": block, "act_quant": act_quant}


def float_to_tensors(name: str, fw: FloatWeight) -> dict[str, Tensor]:
    """One FP8 layer's tensors (its bias, if any, in the caller's dtype)."""
    tensors = {f"{name}.weight": fw.codes.contiguous(), f"{name}.weight_scale": fw.scales.float().contiguous()}
    if fw.bias is not None:
        tensors[f"{name}.bias"] = fw.bias
    return tensors


def float_from_tensors(tensors: dict[str, Tensor], name: str, in_features: int, out_features: int, qc: dict):
    block = qc["block"]
    shape = (out_features, 1) if not block else (-(-out_features // block), -(-in_features // block))
    scales = expect_tensor(tensors, f"{name}.weight_scale", shape, None)
    codes = expect_tensor(tensors, f"{name}.weight", (out_features, in_features), E4M3)
    return FloatWeight(
        codes, scales.float().contiguous(), "e4m3", block, bias=optional_bias(tensors, name, out_features)
    )
