"""Textbook attention (softmax(QK^T / sqrt(d) + mask) V, materialised) as a same-math reference for SDPA.

``naive_attention(model)`` swaps every layer's attention forward for one that differs from
runtime.model.Attention only in the attention product: same projections, rope, cache and mask. The fused
kernel and this one compute the same function in a different floating-point order, so the flagship table
can report what "same math" costs or buys.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import Tensor

from runtime.model import Attention, apply_rope


def naive_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool = False) -> Tensor:
    """q [B, H, T, D], k/v [B, Hkv, S, D] (grouped-query heads repeated), mask [B, 1, T, S] bool, or None:
    all keys (is_causal: the plain causal mask of T queries over T keys), as AttentionMetadata says."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if is_causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


class NaiveAttention(Attention):
    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, meta, cache) -> Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v, meta)
        out = naive_sdpa(q, k, v, meta.mask, meta.is_causal)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.q_size))


@contextmanager
def naive_attention(model):
    """Within the block, every Attention module of `model` runs NaiveAttention.forward (weights untouched)."""
    swapped = [m for m in model.modules() if type(m) is Attention]
    for m in swapped:
        m.__class__ = NaiveAttention
    try:
        yield model
    finally:
        for m in swapped:
            m.__class__ = Attention
