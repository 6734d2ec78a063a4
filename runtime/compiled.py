"""Compiled decode, the gpt-fast way: a static-shape KV cache and a ``torch.compile``d step.

Eager decode on a GPU is launch-bound (~45 small ops per layer, each a Python dispatch and a kernel launch).
A step whose shapes never change can be captured once as a CUDA graph and replayed: ``StaticKVCache`` makes
the shapes constant by attending over every slot of the cache, masked by position (a query at position p
sees slots 0..p), instead of over a ``kv_len`` prefix that grows every step. Chain verifications of T tokens
are padded to a bucket (1, 2, 4, 8, 16, 32), so each bucket is one graph; the padding tokens write cache slots
after the real ones, which the position mask hides and later writes overwrite (as with rejected drafts).

One switch, ``compile``: "off" (eager), "on" (compile on any device: inductor on CPU, inductor with CUDA
graphs on CUDA) or "auto" (on for CUDA; off on CPU, where runtime/kernels/cpu_step's C++ step is faster
for fp32 and mixed bf16). ``resolve_compile`` names what runs; generation results record it.

Compiled steps are cached per (model, batch size, capacity bucket): capacity is rounded up to a multiple of
CAPACITY_STEP so a new prompt length reuses the graphs instead of compiling new ones.

Quantized KV (int8, fp8_e4m3; runtime.kv_quant): ``StaticQuantKVCache`` quantizes the new k/v in the graph and
folds the per-token scales into the scores and into the value weights (softmax(q codes_k^T * s_k) * s_v) codes_v),
so no scaled copy of the cache is made (the codes are cast to the compute dtype inside the graph). int4 and
sink-window caches change shape with their data (open key groups, eviction): they run eager.
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.kv_cache import KVCache, QuantizedKVCache
from runtime.kv_policy import KVCacheSpec
from runtime.kv_quant import as_bytes, quantize_fp8, quantize_int8
from runtime.model import AttentionMetadata, Transformer

COMPILE_MODES = ("off", "auto", "on")
BACKENDS = ("eager", "inductor", "cudagraphs")  # also accepted as a mode: "eager" traces without compiling (tests)
BUCKETS = (1, 2, 4, 8, 16, 32)  # verification lengths captured; longer chunks (prefills) run eager
CAPACITY_STEP = 256
# model -> {(B, S, backend, dtype): decoder}. A decoder references its model, so an entry lives until clear().
_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def coordinate_descent() -> bool:
    """QSPEC_COORDINATE_DESCENT=0 keeps inductor's default tuning on CUDA (faster compiles, slower batch-1 GEMVs)."""
    return os.environ.get("QSPEC_COORDINATE_DESCENT", "1") != "0"


def resolve_compile(mode: str, device: torch.device | str) -> str:
    """What a compile mode runs on a device: "off", "inductor" (CPU) or "cudagraphs" (inductor + CUDA graphs)."""
    if mode in BACKENDS:
        if mode == "cudagraphs" and torch.device(device).type != "cuda":
            raise ValueError("compile='cudagraphs' needs a CUDA device")
        return mode
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES + BACKENDS}, got {mode!r}")
    cuda = torch.device(device).type == "cuda"
    if mode == "off" or (mode == "auto" and not cuda):
        return "off"
    return "cudagraphs" if cuda else "inductor"


def bucket(t: int) -> int | None:
    """The captured length that holds t tokens, or None when t is longer than every bucket."""
    return next((b for b in BUCKETS if b >= t), None)


class StaticKVCache(nn.Module):
    """A KVCache's buffers (the same storage) read with constant shapes: writes scatter at meta.slots, attention
    covers all max_seq_len slots under the mask ``slot <= position``. Registered buffers, so CUDA graphs treat
    them as static inputs that the graph mutates in place."""

    def __init__(self, cache: KVCache):
        super().__init__()
        self.register_buffer("k", cache.k, persistent=False)
        self.register_buffer("v", cache.v, persistent=False)
        self.register_buffer("slot_ids", torch.arange(cache.max_seq_len, device=cache.k.device), persistent=False)
        self.max_seq_len = cache.max_seq_len

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
        """q [B, H, T, D], new k/v [B, Hkv, T, D] -> [B, H, T, D]; meta.slots == meta.positions (chains)."""
        B, H, T, D = k.shape
        index = meta.slots[:, None, :, None].expand(B, H, T, D)
        k_all, v_all = self.k[layer, :B], self.v[layer, :B]
        k_all.scatter_(2, index, k)
        v_all.scatter_(2, index, v)
        mask = self.slot_ids <= meta.positions[:, None, :, None]  # [B, 1, T, S]
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=True)


class StaticQuantKVCache(nn.Module):
    """A QuantizedKVCache's int8 / fp8 pool (the same storage) read with constant shapes, as StaticKVCache: codes
    [L, B, S, Hkv, D] and scales [L, B, S, Hkv] viewed row by row; attention over all S slots, masked by position."""

    def __init__(self, cache: QuantizedKVCache):
        super().__init__()
        pool, B, S = cache.pool, cache.batch_size, cache.capacity
        L = pool.k.shape[0]
        for name in ("k", "v", "k_scale", "v_scale"):
            t = getattr(pool, name)
            self.register_buffer(name, t.view(L, B, S, *t.shape[3:]), persistent=False)
        self.register_buffer("slot_ids", torch.arange(S, device=pool.device), persistent=False)
        self.quantize = quantize_int8 if cache.kv_dtype == "int8" else quantize_fp8
        self.max_seq_len = S

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
        B, H, T, D = q.shape
        Hkv = k.shape[1]
        index = meta.slots[:, :, None]  # [B, T, 1]
        for codes, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            c, s = self.quantize(x.transpose(1, 2))  # [B, T, Hkv, D], [B, T, Hkv]
            as_bytes(codes[layer, :B]).scatter_(1, index[..., None].expand(B, T, Hkv, D), as_bytes(c))
            scales[layer, :B].scatter_(1, index.expand(B, T, Hkv), s)
        g = H // Hkv
        qg = q.reshape(B, Hkv, g * T, D) * D**-0.5
        k_codes = self.k[layer, :B].transpose(1, 2).to(q.dtype)  # [B, Hkv, S, D]
        scores = (qg @ k_codes.transpose(-1, -2)).float() * self.k_scale[layer, :B].transpose(1, 2)[:, :, None]
        mask = self.slot_ids <= meta.positions[:, None, :, None]  # [B, 1, T, S]
        mask = mask[:, :, None].expand(-1, -1, g, -1, -1).reshape(B, 1, g * T, -1)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        weights = (probs * self.v_scale[layer, :B].transpose(1, 2)[:, :, None]).to(q.dtype)
        out = weights @ self.v[layer, :B].transpose(1, 2).to(q.dtype)  # [B, Hkv, g*T, D]
        return out.reshape(B, H, T, D)


class DecodeStep(nn.Module):
    """tokens [B, T], positions [B, T] -> final-norm hidden states [B, T, hidden], over the static cache."""

    def __init__(self, model: Transformer, cache: StaticKVCache):
        super().__init__()
        self.model, self.cache = model, cache

    def forward(self, tokens: Tensor, positions: Tensor) -> Tensor:
        meta = AttentionMetadata(positions, positions, None, self.cache.max_seq_len)
        return self.model(tokens, meta, self.cache, hidden_only=True)


class CompiledDecoder:
    """Runs decode steps and chain verifications of up to BUCKETS[-1] tokens through one compiled step per
    bucket. ``cache`` is the eager KVCache over the same storage: prefills and tree steps use it directly."""

    def __init__(self, model: Transformer, batch_size: int, capacity: int, backend: str, kv: KVCacheSpec | None = None):
        kv = kv or KVCacheSpec()
        if not kv.compilable:
            raise ValueError(f"the compiled step has no static cache for {kv.label()}: run it eager (compile off)")
        self.cache = kv.build(model, batch_size, capacity)
        self.backend = backend
        static = StaticKVCache(self.cache) if isinstance(self.cache, KVCache) else StaticQuantKVCache(self.cache)
        self.step = DecodeStep(model, static)
        # "eager": dynamo tracing only, with fullgraph so tests catch a graph break in the model's own code; the
        # real backends allow breaks (a stand-in module, e.g. a Triton QuantLinear, costs speed, not correctness)
        if backend == "eager":
            self.compiled = torch.compile(self.step, backend="eager", dynamic=False, fullgraph=True)
        elif backend == "cudagraphs":
            if coordinate_descent():
                # gpt-fast's setting: inductor then lowers one-row matmuls (batch-1 decode) to fused reductions that
                # reach full bandwidth and absorb a dequantizing cast (int8 weights); compiles take longer
                torch._inductor.config.coordinate_descent_tuning = True
            self.compiled = torch.compile(self.step, mode="reduce-overhead", dynamic=False)
        else:
            self.compiled = torch.compile(self.step, dynamic=False)

    @property
    def capacity(self) -> int:
        return self.cache.max_seq_len

    def __call__(self, tokens: Tensor, positions: Tensor, min_tokens: int = 1) -> Tensor:
        """tokens [B, T], positions [B, T] (each row consecutive) -> hidden [B, T, hidden]. min_tokens pads short
        steps up to a longer bucket (a speculator's steps then share one graph instead of compiling each)."""
        T = tokens.shape[1]
        size = bucket(max(T, min_tokens))
        if size is None:
            raise ValueError(f"{T} tokens is longer than the largest compiled bucket ({BUCKETS[-1]})")
        if size > T:  # pad with token 0 at the following positions (slots hidden by the mask, overwritten later)
            extra = positions[:, -1:] + torch.arange(1, size - T + 1, device=positions.device)
            positions = torch.cat([positions, extra.clamp(max=self.capacity - 1)], 1)
            tokens = torch.cat([tokens, torch.zeros_like(tokens[:, :1]).expand(-1, size - T)], 1)
        if self.backend == "cudagraphs":
            torch.compiler.cudagraph_mark_step_begin()
        # clone: a CUDA graph's output buffer is overwritten by its next replay
        return self.compiled(tokens.contiguous(), positions.contiguous())[:, :T].clone()


def compiled_decoder(
    model: Transformer, batch_size: int, max_len: int, backend: str, kv: KVCacheSpec | None = None
) -> CompiledDecoder:
    """The cached decoder for this model and batch size whose capacity holds max_len tokens plus the largest
    bucket's padding; built (and compiled lazily, at its first call) when none fits."""
    capacity = -(-(max_len + BUCKETS[-1]) // CAPACITY_STEP) * CAPACITY_STEP
    capacity = min(capacity, model.config.max_position_embeddings + BUCKETS[-1])
    # Every (batch, bucket, model) is its own graph of the same code: let dynamo keep them all.
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, 256)
    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 1024)
    per_model = _DECODERS.setdefault(model, {})
    kv = kv or KVCacheSpec()
    key = (batch_size, capacity, backend, model.compute_dtype, kv)
    if key not in per_model:
        per_model[key] = CompiledDecoder(model, batch_size, capacity, backend, kv)
    return per_model[key]


def clear(model: Transformer | None = None) -> None:
    """Drop the cached compiled decoders (and their static caches) of one model, or of all."""
    if model is None:
        _DECODERS.clear()
    else:
        _DECODERS.pop(model, None)
