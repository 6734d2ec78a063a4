"""Paged decode attention: one query token per sequence attending to its KV through a block table.

``paged_decode_attention`` is a Triton kernel (CUDA; also runs under ``TRITON_INTERPRET=1`` on CPU, which
is how the tests check it). One program per (sequence, query head) walks the sequence's blocks in order,
loading each physical block's keys and values straight from the pool (no gather copy) and keeping an
online softmax (running max, running sum, rescaled accumulator), as in FlashAttention / vLLM's
PagedAttention v1. GQA: query head h reads kv head h // (H / Hkv).

``paged_decode_attention_reference`` is the torch reference: gather the blocks, mask past the context
length, softmax, weighted sum.

Pool layout (runtime.paged_cache): k_pool, v_pool [num_blocks, block_size, Hkv, D]. Quantized pools (int8 or
float8_e4m3fn codes, runtime.kv_quant) add k_scale, v_scale [num_blocks, block_size, Hkv] (one scale per token
and KV head): the kernel loads the codes and scales of a block and dequantizes them in registers. The pools are
indexed through their strides: a quantized pool is stored head-major within each block and passed as its
[num_blocks, block_size, Hkv, ...] view (runtime.kv_quant).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def paged_decode_attention_reference(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    """q [B, H, D] -> out [B, H, D] (fp32 math, q's dtype out); k_scale / v_scale: a quantized pool's scales."""
    B, H, D = q.shape
    _, bs, Hkv, _ = k_pool.shape
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    nb = block_tables.shape[1]
    k = k_pool[block_tables].float()  # [B, nb, bs, Hkv, D]
    v = v_pool[block_tables].float()
    if k_scale is not None:
        k, v = k * k_scale[block_tables].float()[..., None], v * v_scale[block_tables].float()[..., None]
    k = k.reshape(B, nb * bs, Hkv, D)  # [B, S, Hkv, D]
    v = v.reshape(B, nb * bs, Hkv, D)
    group = H // Hkv
    k = k.repeat_interleave(group, dim=2)  # [B, S, H, D]
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bhd,bshd->bhs", q.float(), k) * scale  # [B, H, S]
    valid = torch.arange(nb * bs, device=q.device)[None, :] < context_lens[:, None]  # [B, S]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = scores.softmax(-1)
    return torch.einsum("bhs,bshd->bhd", probs, v).to(q.dtype)


try:
    import triton
    import triton.language as tl
except ImportError:  # torch-only installs: the reference still works
    triton = None

if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, ks_ptr, vs_ptr,
        scale,
        stride_qb, stride_qh,
        stride_kn, stride_ks, stride_kh,
        stride_vn, stride_vs, stride_vh,
        stride_tb,
        stride_ob, stride_oh,
        stride_sn, stride_ss, stride_sh,
        GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        QUANT: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        h = tl.program_id(1)
        kv_h = h // GROUP
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        offs_s = tl.arange(0, BLOCK_SIZE)
        q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        context_len = tl.load(lens_ptr + b)
        num_blocks = tl.cdiv(context_len, BLOCK_SIZE)
        m_i = tl.full([], -float("inf"), tl.float32)
        l_i = tl.full([], 0.0, tl.float32)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for j in range(0, num_blocks):
            block = tl.load(tables_ptr + b * stride_tb + j).to(tl.int64)
            tok = j * BLOCK_SIZE + offs_s
            s_mask = tok < context_len
            kv_mask = s_mask[:, None] & d_mask[None, :]
            k = tl.load(
                k_ptr + block * stride_kn + offs_s[:, None] * stride_ks + kv_h * stride_kh + offs_d[None, :],
                mask=kv_mask,
                other=0.0,
            ).to(tl.float32)  # [BLOCK_SIZE, BLOCK_D]
            # per-token scales of a quantized pool ([N, bs, Hkv], the same strides for k and v)
            scale_offs = block * stride_sn + offs_s * stride_ss + kv_h * stride_sh
            if QUANT:
                k = k * tl.load(ks_ptr + scale_offs, mask=s_mask, other=0.0).to(tl.float32)[:, None]
            scores = tl.sum(k * q[None, :], axis=1) * scale  # [BLOCK_SIZE]
            scores = tl.where(s_mask, scores, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new)
            v = tl.load(
                v_ptr + block * stride_vn + offs_s[:, None] * stride_vs + kv_h * stride_vh + offs_d[None, :],
                mask=kv_mask,
                other=0.0,
            ).to(tl.float32)
            if QUANT:
                v = v * tl.load(vs_ptr + scale_offs, mask=s_mask, other=0.0).to(tl.float32)[:, None]
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new
        out = acc / l_i
        tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def paged_decode_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    """Triton paged decode attention: q [B, H, D] -> [B, H, D]. Every context_len must be >= 1. k_scale / v_scale
    [num_blocks, block_size, Hkv]: the pools hold int8 / float8_e4m3fn codes scaled per token and KV head."""
    if triton is None:
        raise RuntimeError("triton is not installed; use paged_decode_attention_reference")
    B, H, D = q.shape
    _, bs, Hkv, Dk = k_pool.shape
    if Dk != D or H % Hkv:
        raise ValueError(f"shape mismatch: q heads {H} dim {D}, pool kv heads {Hkv} dim {Dk}")
    if bs & (bs - 1):
        raise ValueError(f"the Triton kernel needs a power-of-two block size, got {bs}")
    if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q and the pools need a contiguous last (head_dim) dimension")
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    out = torch.empty_like(q)
    block_tables = block_tables.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    quant = k_scale is not None
    if quant and (k_scale.stride() != v_scale.stride() or k_scale.shape != k_pool.shape[:3]):
        raise ValueError("k_scale and v_scale must be [num_blocks, block_size, Hkv] with the same strides")
    scales = (k_scale, v_scale) if quant else (k_pool, v_pool)  # unread placeholders when not quantized
    sn, ss, sh = k_scale.stride() if quant else (0, 0, 0)
    _paged_decode_kernel[(B, H)](
        q, k_pool, v_pool, block_tables, context_lens, out, *scales,
        scale,
        q.stride(0), q.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        sn, ss, sh,
        GROUP=H // Hkv, BLOCK_SIZE=bs, HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D), QUANT=quant,
    )  # fmt: skip
    return out
