"""Contiguous KV cache: one preallocated [B, Hkv, S_max, D] buffer per layer, written at slots.

Writes go to ``meta.slots`` (so rejected speculative positions are simply overwritten by the next write
at the same slot); reads return the first ``meta.kv_len`` slots, which the attention mask restricts
further. Nothing is allocated per step.

``QuantizedKVCache`` is the same contract over quantized storage (int8, fp8_e4m3, int4; runtime.kv_quant):
it quantizes on write and attends over its chunks itself, dequantizing one chunk at a time.
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.config import ModelConfig
from runtime.kv_quant import KVPool, open_blocks_per_sequence, row_blocks


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

    def copy_first_row(self, rows: int, length: int) -> None:
        """Rows 1..rows-1 take row 0's first ``length`` positions (n samples of one prompt share its prefill)."""
        self.k[:, 1:rows, :, :length] = self.k[:, :1, :, :length]
        self.v[:, 1:rows, :, :length] = self.v[:, :1, :, :length]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class QuantizedKVCache:
    """The contiguous cache in a quantized format: a runtime.kv_quant.KVPool whose blocks are laid out row by row
    (row b's slot s is global slot b * capacity + s, so the pool's tensors read as [L, B, capacity, Hkv, D]).

    Same contract as KVCache for the model (``attend`` writes the new k/v, then attends), for speculation
    (``move``) and for memory (``nbytes``). block_size: int4's key group (tokens per channel scale); an int8 /
    fp8 cache holds each row in one block (stored [L, B, Hkv, S, D], the full-precision cache's order), so
    attention streams each head's rows.
    lookahead: trailing slots a later step may rewrite (a speculator's drafts): int4 keeps their key groups in
    full precision until they are final. The compiled CPU step (runtime.kernels.cpu_step) writes and reads its
    pool in place through these row-by-row block tables."""

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_seq_len: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        kv_dtype: str = "int8",
        block_size: int = 64,
        lookahead: int = 0,
    ):
        if kv_dtype != "int4":  # no key groups: one block per row
            block_size = max_seq_len
        self.capacity = -(-max_seq_len // block_size) * block_size
        per_row = self.capacity // block_size
        # ragged rows can hold a stale open group past their end (the padded prefill) besides the current ones
        open_blocks = 2 * batch_size * open_blocks_per_sequence(block_size, lookahead) if kv_dtype == "int4" else 0
        self.pool = KVPool.for_model(
            config, batch_size * per_row, block_size, kv_dtype, dtype, device, lookahead, open_blocks
        )
        self.tables, self.row_base = row_blocks(batch_size, self.capacity, block_size, device)
        self.batch_size, self.max_seq_len, self.kv_dtype = batch_size, max_seq_len, kv_dtype

    @property
    def device(self) -> torch.device:
        return self.pool.device

    def check_fits(self, kv_len: int) -> None:
        if kv_len > self.max_seq_len:
            raise ValueError(f"KV cache holds {self.max_seq_len} positions, {kv_len} requested")

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, meta) -> Tensor:
        """Quantize and write the new k/v [B, Hkv, T, D] at meta.slots [B, T], then attend q [B, H, T, D] over
        each row's first meta.kv_len slots under meta's mask -> [B, H, T, D]."""
        B = k.shape[0]
        self.check_fits(meta.kv_len)
        ends = (meta.slots.max(1).values + 1).tolist() if self.kv_dtype == "int4" and layer == 0 else []
        self.pool.write(layer, k, v, meta.slots + self.row_base[:B], self.tables[:B], ends)
        tables = self.tables[:B, : -(-meta.kv_len // self.pool.block_size)]
        return self.pool.attend(layer, q, tables, meta.kv_len, meta.mask, meta.is_causal, query_index=meta.slots)

    def move(self, batch_index: int, src_slots: Tensor, dst_start: int) -> None:
        """Copy the k/v at src_slots of one sequence to consecutive slots from dst_start (tree acceptance)."""
        base = batch_index * self.capacity
        dst = torch.arange(dst_start, dst_start + src_slots.numel(), device=self.device)
        self.pool.copy_slots(src_slots.to(self.device) + base, dst + base)

    def nbytes(self) -> int:
        return self.pool.nbytes()
