"""Which KV cache a run uses (``--kv-cache-dtype``, ``--kv-policy``), and the bounded sink + window cache.

``KVCacheSpec`` names the cache: its storage format (auto = the compute dtype; int8, fp8_e4m3, int4:
runtime.kv_quant) and its policy: ``full`` keeps every token; ``sink-window`` (StreamingLLM, Xiao et al.
2024) keeps the first ``sinks`` tokens (the attention sinks) and the most recent ``window`` tokens and evicts
the rest, so its memory stays flat however long the context grows. Every setting but auto + full changes the
model's outputs: APPROXIMATE.

Rope under eviction (the StreamingLLM rule: positions are assigned within the cache, not in the text). Keys
are cached with rope applied at their text positions. A query at text position p in a full cache sits at
in-cache position c = sinks + window - 1 (the last cache slot; c = p until the cache fills). The recent
window is contiguous, so a query's distance to a window key is the same in the text and in the cache: those
scores use the query and keys as cached. Only the sinks move: their in-cache positions are 0..sinks-1 while
the query's is c, so the sinks are scored against the query re-rotated from p to c (rope rotations compose:
R(c) = R(c - p) R(p)). This equals StreamingLLM's recipe (cache keys before rope, re-apply rope over cache
positions every step) up to float rounding, without re-rotating the cache each step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from runtime.config import ModelConfig
from runtime.kv_cache import KVCache, QuantizedKVCache
from runtime.kv_quant import KV_DTYPES, KVPool, check_kv_dtype, row_blocks
from runtime.layout import device_of
from runtime.model import AttentionMetadata, apply_rope

KV_POLICIES = ("full", "sink-window")
MAX_CHUNK = 64  # tokens per forward a sink + window cache takes (longer prompts are fed in chunks)


@dataclass(frozen=True)
class KVCacheSpec:
    """dtype: auto | fp8_e4m3 | int8 | int4; policy: full | sink-window (sinks + window tokens attended);
    block_size: tokens per block of a quantized cache (int4: the key group, one scale per channel per block)."""

    dtype: str = "auto"
    policy: str = "full"
    sinks: int = 4
    window: int = 1020
    block_size: int = 64

    def __post_init__(self):
        check_kv_dtype(self.dtype)
        if self.policy not in KV_POLICIES:
            raise ValueError(f"kv policy must be one of {KV_POLICIES}, got {self.policy!r}")
        if self.sinks < 0 or self.window < 1:
            raise ValueError(f"sink-window needs sinks >= 0 and window >= 1, got {self.sinks} and {self.window}")
        if self.block_size < 1:
            raise ValueError(f"kv block size must be >= 1, got {self.block_size}")
        if self.policy == "sink-window" and self.dtype == "int4":
            raise ValueError(
                "sink-window with int4 KV is not supported: int4 key groups span tokens that eviction removes"
            )

    @property
    def approximate(self) -> bool:
        return self.dtype != "auto" or self.policy != "full"

    @property
    def compilable(self) -> bool:
        """Whether runtime.compiled's static cache implements it (int4's residual and eviction are dynamic)."""
        return self.policy == "full" and self.dtype in ("auto", "int8", "fp8_e4m3")

    def label(self) -> str:
        name = "full precision" if self.dtype == "auto" else self.dtype
        if self.policy == "sink-window":
            name += f", sink-window {self.sinks}+{self.window} (approximate)"
        elif self.approximate:
            name += " (approximate)"
        return name

    def build(self, model, batch_size: int, max_len: int, lookahead: int = 0):
        """The cache for `batch_size` rows of up to max_len tokens (lookahead: trailing slots a speculator may
        rewrite)."""
        cfg, dtype, device = model.config, model.compute_dtype, device_of(model)
        if self.policy == "sink-window":
            return SinkWindowKVCache(
                cfg, batch_size, self.sinks, self.window, model.inv_freq, dtype, device, self.dtype,
                max_chunk=MAX_CHUNK + lookahead, block_size=self.block_size,
            )  # fmt: skip
        if self.dtype == "auto":
            return KVCache(cfg, batch_size, max_len, dtype, device)
        return QuantizedKVCache(cfg, batch_size, max_len, dtype, device, self.dtype, self.block_size, lookahead)


def add_kv_cache_args(ap) -> None:
    """--kv-cache-dtype and --kv-policy (with its --kv-sinks / --kv-window) on a CLI."""
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_DTYPES,
        help="KV cache storage: auto = the compute dtype; int8 / fp8_e4m3 per token and head; int4 KIVI-style "
        "(keys per channel over --kv-block-size tokens, values per token). Quantized caches are approximate",
    )
    ap.add_argument(
        "--kv-policy",
        default="full",
        choices=KV_POLICIES,
        help="sink-window: keep --kv-sinks first + --kv-window recent tokens (StreamingLLM; approximate)",
    )
    ap.add_argument("--kv-sinks", type=int, default=4, help="sink-window: attention-sink tokens kept")
    ap.add_argument("--kv-window", type=int, default=1020, help="sink-window: recent tokens kept")
    ap.add_argument("--kv-block-size", type=int, default=64, help="tokens per quantized block (int4: key group)")


def kv_spec_from_args(ap, args) -> KVCacheSpec:
    try:
        return KVCacheSpec(args.kv_cache_dtype, args.kv_policy, args.kv_sinks, args.kv_window, args.kv_block_size)
    except ValueError as err:
        ap.error(str(err))


class SinkWindowKVCache:
    """StreamingLLM's cache: the first `sinks` tokens plus a ring of the most recent ones, in any per-token
    format (auto, int8, fp8_e4m3). Memory is fixed: sinks + window + max_chunk slots per row, whatever the
    context length. A query at index i attends to the sinks and to indices (i - window, i] (window tokens,
    itself included); rope as in the module docstring. One forward may write at most max_chunk tokens (the ring
    keeps the window of the chunk's first query and the chunk)."""

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        sinks: int,
        window: int,
        inv_freq: Tensor,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        kv_dtype: str = "auto",
        max_chunk: int = MAX_CHUNK,
        block_size: int = 64,
    ):
        if kv_dtype == "int4":
            raise ValueError("sink-window with int4 KV is not supported")
        self.sinks, self.window, self.max_chunk = sinks, window, max_chunk
        self.ring = window + max_chunk - 1
        self.capacity = -(-(sinks + self.ring) // block_size) * block_size
        per_row = self.capacity // block_size
        self.pool = KVPool.for_model(config, batch_size * per_row, block_size, kv_dtype, dtype, device)
        self.tables, self.row_base = row_blocks(batch_size, self.capacity, block_size, device)
        self.slot_index = torch.full((batch_size, self.capacity), -1, dtype=torch.int64, device=device)
        self.inv_freq = inv_freq
        self.batch_size = batch_size
        self._step: tuple[Tensor, Tensor] | None = None  # (mask, sink rotation) of the current forward

    def nbytes(self) -> int:
        return self.pool.nbytes()

    def check_fits(self, kv_len: int) -> None:  # any length: that is the point
        pass

    def physical(self, index: Tensor) -> Tensor:
        """Sequence index -> slot in the row: sinks stay put, the rest go round the ring."""
        ring = self.sinks + (index - self.sinks).remainder(self.ring)
        return torch.where(index < self.sinks, index, ring)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
        B, _, T, _ = q.shape
        if T > self.max_chunk:
            raise ValueError(f"a sink-window cache takes at most {self.max_chunk} tokens per forward, got {T}")
        slots = self.physical(meta.slots)
        if layer == 0:
            self.slot_index[:B].scatter_(1, slots, meta.slots)
            self._step = (self._mask(meta, B), self._sink_rotation(meta.positions, q.dtype))
        self.pool.write(layer, k, v, slots + self.row_base[:B], self.tables[:B], [])
        mask, (cos, sin) = self._step
        sink_q = apply_rope(q.transpose(1, 2), cos, sin).transpose(1, 2) if self.sinks else None
        return self.pool.attend(layer, q, self.tables[:B], self.capacity, mask, False, sink_q, self.sinks)

    def move(self, batch_index: int, src_slots: Tensor, dst_start: int) -> None:
        """Copy the k/v of sequence indices src_slots of one row to consecutive indices from dst_start (a tree's
        accepted path; both within the last write, so their slots hold those indices)."""
        dst = torch.arange(dst_start, dst_start + src_slots.numel(), device=src_slots.device)
        base = self.row_base[batch_index]
        self.pool.copy_slots(self.physical(src_slots) + base, self.physical(dst) + base)

    def _mask(self, meta: AttentionMetadata, B: int) -> Tensor:
        """[B, 1, T, capacity]: keys in the row's sinks or in the query's window, causal by index, and allowed by
        meta's own mask (a tree's) at the key's sequence index."""
        key = self.slot_index[:B, None, None, :]  # [B, 1, 1, S]
        query = meta.slots[:, None, :, None]  # [B, 1, T, 1]
        allowed = (key >= 0) & (key <= query) & ((key < self.sinks) | (key > query - self.window))
        if meta.mask is not None:
            index = key.clamp(0, meta.kv_len - 1).expand(-1, -1, query.shape[2], -1)
            allowed &= meta.mask.gather(3, index)
        return allowed

    def _sink_rotation(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos / signed sin that rotate a query from its text position p to its in-cache position
        min(p, sinks + window - 1) (apply_rope's operands)."""
        delta = positions.clamp(max=self.sinks + self.window - 1) - positions  # [B, T], <= 0
        freqs = delta[..., None].float() * self.inv_freq  # unscaled: a rotation, not rope's attention factor
        cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
        return torch.cat((cos, cos), dim=-1)[:, :, None, :], torch.stack((-sin, sin), dim=-2)[:, :, None]


def chunked_prefill(model, tokens: Tensor, cache, start: int = 0, chunk: int | None = None) -> Tensor:
    """Feed tokens [B, T] (every row at positions start..) into the cache, `chunk` tokens per forward (default:
    the cache's max_chunk, else all at once); returns final-norm hidden states [B, T, hidden]."""
    B, T = tokens.shape
    chunk = chunk or getattr(cache, "max_chunk", None) or T
    out = []
    for i in range(0, T, chunk):
        n = min(chunk, T - i)
        meta = AttentionMetadata.contiguous(B, start + i, n, tokens.device)
        out.append(model(tokens[:, i : i + n], meta, cache, hidden_only=True))
    return torch.cat(out, dim=1)
