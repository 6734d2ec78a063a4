"""Checkpoint errors that name the offending tensor, and the shape/dtype check that raises them."""

from __future__ import annotations

import json
import struct
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
