"""Checkpoint errors that name the offending tensor, and the shape/dtype check that raises them."""

from __future__ import annotations

import json
import struct
import warnings
from pathlib import Path

import torch
from torch import Tensor


class CheckpointError(ValueError):
    """A packed checkpoint that is truncated, misshapen or does not match its quantization_config."""


def expect_tensor(tensors: dict[str, Tensor], name: str, shape: tuple[int, ...], dtype: torch.dtype | None) -> Tensor:
    if name not in tensors:
        raise CheckpointError(f"tensor {name!r} is missing from the checkpoint")
    t = tensors[name]
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(
            f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)} from the model config and "
            "quantization_config (bits, group_size)"
        )
    if dtype is not None and t.dtype != dtype:
        raise CheckpointError(f"tensor {name!r} has dtype {t.dtype}, expected {dtype}")
    return t


def group_layout(group_size: int, in_features: int) -> tuple[int, int]:
    """A config's group size as the layer uses it (-1, 0 or >= the width: one group per row) and the group count."""
    if group_size in (-1, 0) or group_size >= in_features:
        group_size = in_features
    return group_size, -(-in_features // group_size)


def optional_bias(tensors: dict[str, Tensor], name: str, out_features: int) -> Tensor | None:
    """The layer's bias when the checkpoint has one, checked for shape."""
    if f"{name}.bias" not in tensors:
        return None
    return expect_tensor(tensors, f"{name}.bias", (out_features,), None)


def check_safetensors_file(path: Path) -> None:
    """Fail with the name of the first tensor whose bytes lie past the end of a (truncated) safetensors file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated before the safetensors header ({size} bytes)")
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            raise CheckpointError(f"{path}: truncated inside the safetensors header ({size} of {8 + header_len} bytes)")
        try:
            header = json.loads(f.read(header_len))
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{path}: corrupt safetensors header ({err})") from err
    for name, info in header.items():
        if name == "__metadata__":
            continue
        end = 8 + header_len + info["data_offsets"][1]
        if end > size:
            raise CheckpointError(f"{path}: truncated: tensor {name!r} needs bytes up to {end}, the file has {size}")


def fp16_scales(name: str, scales: Tensor) -> Tensor:
    """Scales as fp16 (what GPTQ/AWQ loaders read), warning when that changes them: the loaded model then
    differs from the in-memory one. Quantizers should round their scales to fp16 before computing codes."""
    half = scales.to(torch.float16)
    if not torch.equal(half.float(), scales.float()):
        change = float(((half.float() - scales.float()).abs() / scales.float().abs().clamp(min=1e-30)).max())
        warnings.warn(
            f"{name}: scales are not fp16-exact; the checkpoint stores them in fp16 (max relative change "
            f"{change:.1e}), so the loaded weights differ from the in-memory ones",
            stacklevel=3,
        )
    return half
