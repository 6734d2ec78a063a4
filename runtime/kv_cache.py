"""Contiguous KV cache: one preallocated [B, Hkv, S_max, D] buffer per layer, written at slots.

Writes go to ``meta.slots`` (so rejected speculative positions are simply overwritten by the next write
at the same slot); reads return the first ``meta.kv_len`` slots, which the attention mask restricts
further. Nothing is allocated per step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.config import ModelConfig


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_seq_len: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        shape = (config.num_layers, batch_size, config.num_kv_heads, max_seq_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.batch_size, self.max_seq_len = batch_size, max_seq_len

    def update(self, layer: int, k: Tensor, v: Tensor, meta) -> tuple[Tensor, Tensor]:
        """Write k/v [B, Hkv, T, D] at meta.slots [B, T]; return [B, Hkv, kv_len, D] views."""
        B, H, T, D = k.shape
        self.check_fits(meta.kv_len)
        k_cache, v_cache = self.k[layer, :B], self.v[layer, :B]
        start = meta.contiguous_start
        if start is not None:  # every row writes the same contiguous slot range: a plain slice copy
            k_cache[:, :, start : start + T] = k
            v_cache[:, :, start : start + T] = v
        else:
            index = meta.slots[:, None, :, None].expand(B, H, T, D)
            k_cache.scatter_(2, index, k)
            v_cache.scatter_(2, index, v)
        return k_cache[:, :, : meta.kv_len], v_cache[:, :, : meta.kv_len]

    def check_fits(self, kv_len: int) -> None:
        if kv_len > self.max_seq_len:
            raise ValueError(f"KV cache holds {self.max_seq_len} positions, {kv_len} requested")

    def move(self, batch_index: int, src_slots: Tensor, dst_start: int) -> None:
        """Copy the k/v at src_slots of one sequence to consecutive slots from dst_start (tree acceptance)."""
        n = src_slots.numel()
        self.k[:, batch_index, :, dst_start : dst_start + n] = self.k[:, batch_index, :, src_slots]
        self.v[:, batch_index, :, dst_start : dst_start + n] = self.v[:, batch_index, :, src_slots]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
