"""Quantized KV storage: the formats, the block pool that holds them, and attention that dequantizes chunk by chunk.

Formats (``--kv-cache-dtype``), quantized when a token's k/v is written, dequantized inside attention:

- ``auto``: the compute dtype, no quantization (the full-precision cache).
- ``int8``: per token and KV head, symmetric: ``s = amax(|x|) / 127`` (stored fp16), ``code = round(x / s)``
  clamped to [-127, 127], int8. ``x ~ code * s``. Keys are scored against the query rounded to 16-bit integers
  (``round_query``: 2^-16 of its largest element, where the codes are 2^-8 of theirs), so a CPU kernel can take
  the scores as exact integer dot products of the query's and the key's codes.
- ``fp8_e4m3``: per token and KV head: ``s = amax(|x|) / 448`` (fp16), ``code = float8_e4m3fn(x / s)`` (torch's
  round-to-nearest-even cast; x / s is clamped to +-448 first, so fp16 rounding of s cannot overflow).
- ``int4`` (KIVI, Liu et al. 2024): keys per channel over a group of G tokens (G = the pool's block size),
  values per token; both asymmetric 4-bit, ``code = round((x - min) / s)`` in [0, 15], ``s = (max - min) / 15``,
  scale and min stored fp16. The keys of a group that is not yet final stay in full precision (the residual
  window) and are quantized when the group fills: "final" means no later write may rewrite it, i.e. the
  group ends at or before ``end - lookahead``, where end is the row's last written index + 1 and lookahead
  is the number of trailing slots a later step may rewrite (speculative drafts; 0 for plain decoding).
  Values need no group: they are quantized per token as they are written, so the residual holds keys only
  (KIVI keeps the residual's values in full precision too; here that would double the residual's memory).

Memory per token and KV head with head_dim D (what the engine's block budget and ``evals.speed.calculator`` count):
auto 2 * D * itemsize; int8 / fp8 2 * (D + 2); int4 D + 4 + 4 * D / G (codes, value scale/min, key scale/min
shared by G tokens), plus, per running sequence, the residual: ``1 + ceil(lookahead / G)`` blocks of keys
in the compute dtype.

Layout of ``KVPool`` (plain contiguous tensors in ``stored``, so a C++ or Triton kernel can read them directly; L
layers, N blocks of bs tokens, Hkv KV heads, D channels; slot = block * bs + offset). Every reader in Python indexes
the attributes ``k``, ``v``, ... as [L, N, bs, Hkv, ...] (slot-major views); a quantized pool stores them
head-major within each block, [L, N, Hkv, bs, ...], so one KV head's rows of a block are adjacent: attention reads
each head's keys and values as one stream (token-major rows of one head, Hkv rows apart, left the CPU step's
quantized attention waiting on memory: 3x slower at 4k tokens, notes/issue-39.md).

- auto: ``k``, ``v`` [L, N, bs, Hkv, D] in the compute dtype (stored so: the engine's full-precision pool).
- int8 / fp8_e4m3: ``k``, ``v`` int8 / float8_e4m3fn codes, stored [L, N, Hkv, bs, D]; ``k_scale``, ``v_scale``
  fp16, stored [L, N, Hkv, bs] (one scale per token and KV head).
- int4: ``k``, ``v`` uint8, stored [L, N, Hkv, bs, D / 2], two codes per byte: channel 2i in the low nibble,
  channel 2i + 1 in the high nibble (``byte = code[2i] | code[2i+1] << 4``). ``k_scale``, ``k_min`` [L, N, Hkv, D]
  fp16 (per block = per key group, per channel); ``v_scale``, ``v_min`` fp16, stored [L, N, Hkv, bs] (per token).
  ``k_open`` [L, M, bs, Hkv, D] compute dtype: the residual, M open-block slots; ``open_of`` [N] int64 says
  which open slot holds block n's keys (-1: the block's keys are the int4 codes). A block's values are always
  its codes. Dequantize: ``x = code * scale + min``.

The contiguous caches (runtime.kv_cache) are pools whose blocks are laid out row by row (row b owns blocks
b * S / bs ..). An int8 / fp8 one holds each row in one block, so it is stored [L, B, Hkv, S, D] like the
full-precision KVCache (and reads as [L, B, S, Hkv, D]); an int4 one keeps blocks of its key group. The paged
cache's blocks are the engine's.

Attention (``chunked_attention``) never materialises a full-precision copy of the cache: it reads a chunk of
keys and values (CHUNK slots), dequantizes only that chunk to fp32, and keeps an online softmax (running max,
running sum, rescaled accumulator) over the chunks, as FlashAttention does.

What an int4 query reads (the rule a kernel must follow): a decode step (one new token per row, written before
attention) reads an open block's keys from ``k_open`` and every other block's from its codes. A write of several
tokens (a prefill chunk, a verification) may seal groups it completes; query i of such a write still reads key j
of those groups in full precision when j >= G * floor((i + 1 - lookahead) / G), i.e. while the group was open at
i's own step in token-by-token decoding. So int4 attention does not depend on how a sequence was chunked.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

KV_DTYPES = ("auto", "fp8_e4m3", "int8", "int4")
CHUNK = 256  # keys dequantized at a time inside attention
DENSE_BYTES = 128 << 20  # up to this much dequantized fp32 k/v, attention reads them whole and runs SDPA
QUERY_ROWS = 256  # queries per SDPA call over an int4 cache's codes and fresh keys (_fresh_attention)
INT8_MAX = 127.0
QUERY_MAX = 32767.0  # int8 caches: queries on a 16-bit grid (round_query)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT4_LEVELS = 15.0
SCALE_DTYPE = torch.float16


def check_kv_dtype(kv_dtype: str) -> str:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv cache dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    return kv_dtype


def bytes_per_token_head(kv_dtype: str, head_dim: int, dtype_bytes: float, group: int = 64) -> float:
    """Stored bytes of one token's k and v for one KV head (codes + scales; int4's residual not included)."""
    check_kv_dtype(kv_dtype)
    if kv_dtype == "auto":
        return 2 * head_dim * dtype_bytes
    scale = torch.empty((), dtype=SCALE_DTYPE).element_size()
    if kv_dtype in ("int8", "fp8_e4m3"):
        return 2 * (head_dim + scale)
    return head_dim + 2 * scale + 2 * scale * head_dim / group  # codes k+v, value scale+min, key scale+min / G


def residual_bytes_per_block(head_dim: int, num_kv_heads: int, num_layers: int, block_size: int, dtype_bytes: float):
    """One open int4 block's full-precision keys, every layer."""
    return num_layers * block_size * num_kv_heads * head_dim * dtype_bytes


def open_blocks_per_sequence(block_size: int, lookahead: int) -> int:
    """int4 blocks of one row that can be open at once: the block being filled and those a rewrite may reach."""
    return 1 + -(-lookahead // block_size)


# ---- formats: quantize / dequantize ------------------------------------------------------------------


def _scale(amax: Tensor, qmax: float) -> Tensor:
    """fp16 scale amax / qmax (1 where amax is 0, so a zero vector stays exactly zero)."""
    return torch.where(amax > 0, amax / qmax, torch.ones_like(amax)).to(SCALE_DTYPE)


def quantize_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., D] -> int8 codes [..., D], fp16 scale [...] (per row of D, symmetric)."""
    scale = _scale(x.float().abs().amax(-1), INT8_MAX)
    codes = torch.round(x.float() / scale.float()[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scale


def quantize_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., D] -> float8_e4m3fn codes [..., D], fp16 scale [...] (per row of D)."""
    scale = _scale(x.float().abs().amax(-1), FP8_MAX)
    codes = (x.float() / scale.float()[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def round_query(q: Tensor) -> Tensor:
    """q [..., D] -> fp32 on the 16-bit grid an int8 cache's keys are scored against: ``round(q / f) * f`` (half to
    even), ``f = amax(|q|) / 32767`` per vector (1 for a zero vector). The CPU step scores ``round(q / f)`` against
    the int8 codes as integers and multiplies by f and the key's scale: the same values."""
    q = q.float()
    amax = q.abs().amax(-1, keepdim=True)
    f = torch.where(amax > 0, amax / QUERY_MAX, torch.ones_like(amax))
    return torch.round(q / f).clamp_(-QUERY_MAX, QUERY_MAX) * f


def dequantize_scaled(codes: Tensor, scale: Tensor) -> Tensor:
    """int8 / fp8 codes [..., D] and scale [...] -> fp32 [..., D]."""
    return codes.float() * scale.float()[..., None]


def pack_int4(codes: Tensor) -> Tensor:
    """uint8 codes in [0, 15], [..., D] -> [..., D/2]: channel 2i in the low nibble, 2i + 1 in the high one."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """[..., D/2] uint8 -> [..., D] codes (inverse of pack_int4)."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def quantize_asym4(x: Tensor, dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric 4-bit over `dim` (the reduction axis): -> packed codes (x's shape, last dim halved), fp16
    scale and min (x's shape without `dim`)."""
    xf = x.float()
    lo, hi = xf.amin(dim), xf.amax(dim)
    scale = _scale(hi - lo, INT4_LEVELS)
    low = lo.to(SCALE_DTYPE)
    codes = torch.round((xf - low.float().unsqueeze(dim)) / scale.float().unsqueeze(dim))
    return pack_int4(codes.clamp_(0, INT4_LEVELS).to(torch.uint8)), scale, low


def dequantize_asym4(packed: Tensor, scale: Tensor, low: Tensor, dim: int) -> Tensor:
    """Inverse of quantize_asym4 (fp32)."""
    return unpack_int4(packed).float() * scale.float().unsqueeze(dim) + low.float().unsqueeze(dim)


def row_blocks(batch_size: int, capacity: int, block_size: int, device) -> tuple[Tensor, Tensor]:
    """A contiguous cache's rows laid out one after another in a pool: each row's block table [B, capacity / bs]
    and its first global slot [B, 1] (row b's slot s is global slot b * capacity + s)."""
    per_row = capacity // block_size
    tables = torch.arange(batch_size * per_row, device=device).view(batch_size, per_row)
    return tables, torch.arange(batch_size, device=device)[:, None] * capacity


def as_bytes(t: Tensor) -> Tensor:
    """fp8 codes viewed as uint8 (copies and scatters have no float8 kernels on CPU); other tensors as they are."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


# ---- attention over chunks ---------------------------------------------------------------------------


def chunked_attention(
    q: Tensor,
    read: Callable[[int, int], tuple[Tensor, Tensor]],
    kv_len: int,
    mask: Tensor | None = None,
    is_causal: bool = False,
    chunk: int = CHUNK,
    sink_q: Tensor | None = None,
    num_sinks: int = 0,
    read_fresh: Callable[[int, int], tuple[Tensor, Tensor] | None] | None = None,
    fresh_from: Tensor | None = None,
    query_grid: bool = False,
) -> Tensor:
    """softmax(q k^T / sqrt(D)) v over keys 0..kv_len-1, read `chunk` at a time, with an online softmax in fp32.

    q [B, H, T, D]; read(start, stop) -> k, v [B, Hkv, stop - start, D] (dequantized; any float dtype);
    mask [B, 1, T, kv_len] bool (True = may attend) or None; is_causal: query t sees keys up to kv_len - T + t.
    GQA: query head h reads KV head h // (H / Hkv). sink_q [B, H, T, D]: the query the first num_sinks keys are
    scored against (StreamingLLM's in-cache positions; runtime.kv_policy.SinkWindowKVCache).
    read_fresh(start, stop) -> (k [B, Hkv, n, D], fresh [B, n]) or None: full-precision keys of int4 groups sealed
    by this very write; query t reads fresh key j in full precision when j >= fresh_from[b, t] (as it would in
    token-by-token decoding, where the group was still open at its step). query_grid: score the queries (and
    sink_q) rounded by round_query, as an int8 cache's keys are. -> [B, H, T, D].

    Without sinks, a cache whose dequantized k/v take at most DENSE_BYTES is read whole and handed to SDPA (the same
    math, its fused kernel: a 2k-token prefill over an int8 cache runs ~4x faster). A whole causal prompt (kv_len ==
    T) is SDPA's own causal case (it skips the masked half); int4's fresh keys are a second copy of the key range
    that each query sees where its rule says (quantized key j where j < fresh_from, the full-precision one from
    there), so every visible key is still scored exactly once."""
    B, H, T, D = q.shape
    copies = 1 if read_fresh is None else 2
    out_dtype = q.dtype
    if query_grid:
        q = round_query(q)
        sink_q = round_query(sink_q) if sink_q is not None else None
    if sink_q is None and B * H * kv_len * D * 8 * copies <= DENSE_BYTES:  # q's heads bound k/v's
        return _dense_attention(q, read, kv_len, mask, is_causal, read_fresh, fresh_from).to(out_dtype)
    scale = D**-0.5
    m = l = acc = None
    for start in range(0, kv_len, chunk):
        stop = min(kv_len, start + chunk)
        k, v = read(start, stop)
        Hkv = k.shape[1]
        g = H // Hkv
        if m is None:
            qf = (q.float() * scale).reshape(B, Hkv, g * T, D)
            m = torch.full((B, Hkv, g * T, 1), -math.inf, device=q.device)
            l = torch.zeros_like(m)
            acc = torch.zeros(B, Hkv, g * T, D, device=q.device)
        k, v = k.float(), v.float()
        s = qf @ k.transpose(-1, -2)  # [B, Hkv, g*T, n]
        if sink_q is not None and start == 0 and num_sinks:
            sq = (sink_q.float() * scale).reshape(B, Hkv, g * T, D)
            s[..., :num_sinks] = sq @ k[:, :, :num_sinks].transpose(-1, -2)
        fresh = read_fresh(start, stop) if read_fresh is not None else None
        if fresh is not None:
            k_fp, is_fresh = fresh
            use = _reads_fresh(start, stop, fresh_from, is_fresh)[:, None, None]  # [B, 1, 1, T, n]
            use = use.expand(-1, -1, g, -1, -1).reshape(B, 1, g * T, stop - start)
            s = torch.where(use, qf @ k_fp.float().transpose(-1, -2), s)
        allowed = _chunk_mask(mask, is_causal, start, stop, kv_len, T, g, q.device)
        if allowed is not None:
            s = s.masked_fill(~allowed, -math.inf)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)  # a row with no key yet: exp(-inf) = 0, not NaN
        p = torch.exp(s - m_safe)
        alpha = torch.exp(m - m_safe)
        l = l * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + p @ v
        m = m_new
    if acc is None:
        raise ValueError("attention over an empty cache (kv_len 0)")
    out = torch.where(l > 0, acc / l.clamp_min(1e-30), torch.zeros_like(acc))
    return out.reshape(B, H, T, D).to(out_dtype)


def _dense_attention(q, read, kv_len, mask, is_causal, read_fresh, fresh_from) -> Tensor:
    """chunked_attention's math over the whole key range in one SDPA call (its docstring says when)."""
    B, H, T, D = q.shape
    k, v = read(0, kv_len)
    fresh = read_fresh(0, kv_len) if read_fresh is not None else None
    if fresh is None and mask is None and is_causal and kv_len == T:
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
        return out.to(q.dtype)
    allowed = _chunk_mask(mask, is_causal, 0, kv_len, kv_len, T, 1, q.device)  # [B, 1, T, n], [T, n] or None
    if fresh is not None:
        k_fp, is_fresh = fresh  # [B, Hkv, n, D], [B, n]
        use = _reads_fresh(0, kv_len, fresh_from, is_fresh)[:, None]  # [B, 1, T, n]
        seen = torch.ones_like(use) if allowed is None else allowed.expand_as(use)
        return _fresh_attention(q.float(), k.float(), v.float(), k_fp.float(), seen, use).to(q.dtype)
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=allowed, enable_gqa=True)
    if allowed is not None:  # a query with no key: zeros, as chunked_attention gives (SDPA gives NaN)
        out = out.masked_fill(~allowed.any(-1, keepdim=True), 0.0)
    return out.to(q.dtype)


def _fresh_attention(q: Tensor, k: Tensor, v: Tensor, k_fp: Tensor, seen: Tensor, use: Tensor) -> Tensor:
    """SDPA over an int4 cache's codes k and its fresh full-precision keys k_fp side by side (query t sees key j where
    seen[b, 0, t, j], in full precision where use[b, 0, t, j] too), QUERY_ROWS queries a call: a call reads the keys
    up to the last one its queries see, and the full-precision copy only from the first one they read that way (the
    groups still open near the diagonal), so a prompt costs ~T^2 / 2 scores instead of 2 T^2. -> [B, H, T, D]."""
    B, H, T, D = q.shape
    out = torch.zeros(B, H, T, D, device=q.device)
    for t0 in range(0, T, QUERY_ROWS):
        rows = slice(t0, min(T, t0 + QUERY_ROWS))
        sees, fresh = seen[:, :, rows], use[:, :, rows]  # [B, 1, C, n]
        visible = sees.flatten(0, 2).any(0).nonzero()
        if not len(visible):  # no query here sees a key: zeros
            continue
        hi = int(visible[-1]) + 1
        read_fp = fresh.flatten(0, 2).any(0).nonzero()
        lo = int(read_fp[0]) if len(read_fp) else hi
        keys = torch.cat([k[:, :, :hi], k_fp[:, :, lo:hi]], dim=2)
        values = torch.cat([v[:, :, :hi], v[:, :, lo:hi]], dim=2)
        mask = torch.cat([(sees & ~fresh)[..., :hi], (sees & fresh)[..., lo:hi]], dim=-1)  # codes, then full precision
        part = F.scaled_dot_product_attention(q[:, :, rows], keys, values, attn_mask=mask, enable_gqa=True)
        out[:, :, rows] = part.masked_fill(~mask.any(-1, keepdim=True), 0.0)  # SDPA gives NaN where no key is seen
    return out


def _reads_fresh(start: int, stop: int, fresh_from: Tensor, is_fresh: Tensor) -> Tensor:
    """[B, T, n]: whether query t reads key start + j in full precision (a fresh key at or past fresh_from[b, t])."""
    return (torch.arange(start, stop, device=fresh_from.device) >= fresh_from[..., None]) & is_fresh[:, None]


def _chunk_mask(mask, is_causal, start, stop, kv_len, T, g, device) -> Tensor | None:
    """The [.., g*T, n] allowed-keys mask of one chunk (query rows ordered as q.reshape(B, Hkv, g*T, D))."""
    if mask is not None:
        part = mask[..., start:stop]  # [B, 1, T, n]
        return part[:, :, None].expand(-1, -1, g, -1, -1).reshape(part.shape[0], 1, g * T, stop - start)
    if is_causal:
        keys = torch.arange(start, stop, device=device)
        last = kv_len - T + torch.arange(T, device=device)
        return (keys[None, :] <= last[:, None]).repeat(g, 1)  # [g*T, n]
    return None


# ---- the block pool ----------------------------------------------------------------------------------


@dataclass
class _Int4Plan:
    """Where one forward's new keys go in an int4 pool (computed once per forward, replayed by every layer)."""

    seal_blocks: Tensor  # [ns] blocks quantized by this write
    seal_from: Tensor  # [ns] their open slot (keys so far) or -1 (start from their codes)
    opened_blocks: Tensor  # [no] blocks that get an open slot now, initialised from their codes
    opened_slots: Tensor  # [no]
    stage_src: Tensor  # new-token indices whose keys go to the sealing stage ...
    stage_dst: Tensor  # ... at stage rows (stage index * bs + offset)
    open_src: Tensor  # new-token indices whose keys go to an open slot ...
    open_dst: Tensor  # ... at k_open rows (open slot * bs + offset)
    stage_of: Tensor  # [num_blocks] a block's index in the stage (-1: not sealed by this write)


class KVPool:
    """Blocks of k/v in one format (see the module docstring for the layout), written at global slots and read
    through block tables. Front ends: runtime.kv_cache (contiguous, identity tables) and runtime.paged_cache.

    lookahead: trailing slots of a row a later write may rewrite (int4 keeps their groups open);
    open_blocks: int4 residual slots (open blocks at once, over all rows)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        kv_dtype: str,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        lookahead: int = 0,
        open_blocks: int = 0,
    ):
        self.kv_dtype = check_kv_dtype(kv_dtype)
        self.dtype, self.block_size, self.num_blocks = dtype, block_size, num_blocks
        self.lookahead = lookahead
        L, N, bs, H, D = num_layers, num_blocks, block_size, num_kv_heads, head_dim
        self.stored: dict[str, Tensor] = {}  # name -> the contiguous tensor as stored (what kernels read)

        def tensor(name: str, *shape, dtype=SCALE_DTYPE, per_token: bool = False) -> None:
            """A zero tensor; per_token: stored [L, N, Hkv, bs, ...], the attribute its [L, N, bs, Hkv, ...] view."""
            t = (
                torch.zeros(L, N, H, bs, *shape, dtype=dtype, device=device)
                if per_token
                else torch.zeros(*shape, dtype=dtype, device=device)
            )
            self.stored[name] = t
            setattr(self, name, t.transpose(2, 3) if per_token else t)

        if kv_dtype == "int4":
            if D % 2:
                raise ValueError(f"int4 KV packs two channels per byte: head_dim {D} must be even")
            tensor("k", D // 2, dtype=torch.uint8, per_token=True)
            tensor("v", D // 2, dtype=torch.uint8, per_token=True)
            tensor("k_scale", L, N, H, D)
            tensor("k_min", L, N, H, D)
            tensor("v_scale", per_token=True)
            tensor("v_min", per_token=True)
            tensor("k_open", L, max(open_blocks, 1), bs, H, D, dtype=dtype)
            self.open_of = torch.full((N,), -1, dtype=torch.int64)  # host copy: the write plan reads it
            self.open_of_dev = self.open_of.to(device)
            self.open_slot_of: dict[int, int] = {}  # open_of's open blocks -> their slot (what the plan reads)
            self._no_stage = torch.full((N,), -1, dtype=torch.int64, device=device)  # a plan that seals nothing
            self.free_open = list(range(open_blocks - 1, -1, -1))
            self.plan: _Int4Plan | None = None
            self.fresh: tuple[int, Tensor] | None = None  # (layer, keys of the blocks the last write sealed)
        elif kv_dtype == "auto":
            tensor("k", L, N, bs, H, D, dtype=dtype)
            tensor("v", L, N, bs, H, D, dtype=dtype)
        else:
            code = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}[kv_dtype]
            tensor("k", D, dtype=code, per_token=True)
            tensor("v", D, dtype=code, per_token=True)
            tensor("k_scale", per_token=True)
            tensor("v_scale", per_token=True)

    @classmethod
    def for_model(
        cls, config, num_blocks: int, block_size: int, kv_dtype: str, dtype, device, lookahead=0, open_blocks=0
    ):
        """A pool shaped for a model config (layers, KV heads, head_dim)."""
        return cls(
            config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim, kv_dtype, dtype, device,
            lookahead, open_blocks,
        )  # fmt: skip

    @property
    def device(self) -> torch.device:
        return self.k.device

    def tensors(self) -> list[Tensor]:
        return list(self.stored.values())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    # ---- write ------------------------------------------------------------------------------------

    def write(self, layer: int, k: Tensor, v: Tensor, slots: Tensor, tables: Tensor, ends: list[int]) -> None:
        """k, v [B, Hkv, T, D] at global slots [B, T] (a slot < 0 is padding: not written). tables [B, nb]: each
        row's blocks; ends[b]: row b's last written index + 1 (int4: which key groups are final)."""
        B, H, T, D = k.shape
        valid = (slots >= 0).reshape(-1)
        flat = slots.reshape(-1)[valid]
        k = k.transpose(1, 2).reshape(B * T, H, D)[valid]
        v = v.transpose(1, 2).reshape(B * T, H, D)[valid]
        if self.kv_dtype == "auto":
            self.k[layer].view(-1, H, D).index_copy_(0, flat, k.to(self.dtype))
            self.v[layer].view(-1, H, D).index_copy_(0, flat, v.to(self.dtype))
            return
        block, offset = flat // self.block_size, flat % self.block_size
        if self.kv_dtype in ("int8", "fp8_e4m3"):
            quantize = quantize_int8 if self.kv_dtype == "int8" else quantize_fp8
            for codes, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
                c, s = quantize(x)
                as_bytes(codes[layer])[block, offset] = as_bytes(c)
                scales[layer][block, offset] = s
            return
        packed, scale, low = quantize_asym4(v, dim=-1)  # values: per token, over channels
        self.v[layer][block, offset] = packed
        self.v_scale[layer][block, offset] = scale
        self.v_min[layer][block, offset] = low
        if layer == 0 or self.plan is None:
            self.plan = self._plan_int4(flat, tables, ends)
        self._write_keys_int4(layer, k, self.plan)

    def _plan_int4(self, flat: Tensor, tables: Tensor, ends: list[int]) -> _Int4Plan:
        """Which blocks this forward seals (quantizes), opens, and where each new key goes. Updates open_of. Plain
        Python over the few touched and open blocks: it runs once per decode step."""
        bs, open_now = self.block_size, self.open_slot_of
        slots = flat.tolist()
        blocks = [s // bs for s in slots]
        touched = set(blocks)
        candidates = touched | open_now.keys()
        seal: set[int] = set()
        for b, end in enumerate(ends):
            final = max(0, end - self.lookahead) // bs  # leading blocks of the row no write will touch again
            if final:
                seal.update(x for x in tables[b, :final].tolist() if x in candidates)
        seal_blocks = sorted(seal)
        seal_from = [open_now.get(x, -1) for x in seal_blocks]
        opened = sorted(x for x in touched if x not in seal and x not in open_now)
        free = len(self.free_open) + sum(x in open_now for x in seal_blocks)  # sealing frees their slots
        if len(opened) > free:
            raise RuntimeError(
                f"int4 KV: {len(opened)} blocks to open, {free} residual slots free (a bug: the "
                "cache was sized for fewer rows or a shorter lookahead)"
            )
        for x in seal_blocks:
            if x in open_now:
                self.free_open.append(open_now.pop(x))
                self.open_of[x] = -1
        opened_slots = [self.free_open.pop() for _ in opened]
        for x, s in zip(opened, opened_slots):
            open_now[x] = self.open_of[x] = s
        if (seal_blocks or opened) and self.open_of_dev is not self.open_of:
            self.open_of_dev.copy_(self.open_of)
        stage_of = self._no_stage
        if seal_blocks:
            stage_of = torch.full((self.num_blocks,), -1, dtype=torch.int64)
            stage_of[seal_blocks] = torch.arange(len(seal_blocks))
        stage_index = {x: i for i, x in enumerate(seal_blocks)}
        to_stage = [i for i, x in enumerate(blocks) if x in stage_index]
        to_open = [i for i, x in enumerate(blocks) if x not in stage_index]
        dev = self.device

        def t(x: list[int]) -> Tensor:
            return torch.tensor(x, dtype=torch.int64, device=dev)

        return _Int4Plan(
            seal_blocks=t(seal_blocks),
            seal_from=t(seal_from),
            opened_blocks=t(opened),
            opened_slots=t(opened_slots),
            stage_src=t(to_stage),
            stage_dst=t([stage_index[blocks[i]] * bs + slots[i] % bs for i in to_stage]),
            open_src=t(to_open),
            open_dst=t([open_now[blocks[i]] * bs + slots[i] % bs for i in to_open]),
            stage_of=stage_of.to(dev),
        )

    def _write_keys_int4(self, layer: int, k: Tensor, plan: _Int4Plan) -> None:
        H, D = k.shape[1:]
        stage = torch.empty(plan.seal_blocks.numel(), *self.k_open.shape[2:], dtype=self.dtype, device=self.device)
        self._stage_keys(layer, plan, stage)
        stage.view(-1, H, D)[plan.stage_dst] = k[plan.stage_src].to(self.dtype)
        self.k_open[layer].view(-1, H, D)[plan.open_dst] = k[plan.open_src].to(self.dtype)
        if plan.seal_blocks.numel():
            self._seal(layer, plan.seal_blocks, stage)
        self.fresh = (layer, stage)  # what this layer's attention reads in full precision (read_fresh)

    def _stage_keys(self, layer: int, plan: _Int4Plan, stage: Tensor) -> None:
        """Before a write's new keys: the keys so far of the blocks it seals into stage [ns, bs, Hkv, D], and the
        residual of the blocks it opens, from their codes."""
        if plan.seal_blocks.numel():  # keys written so far: the block's open slot, or its codes (reopened, resealed)
            from_open = plan.seal_from >= 0
            stage[from_open] = self.k_open[layer, plan.seal_from[from_open]]
            stage[~from_open] = self.dequantize_keys(layer, plan.seal_blocks[~from_open]).to(self.dtype)
        if plan.opened_blocks.numel():  # opened now: start from the codes (tokens written before a rewrite)
            self.k_open[layer, plan.opened_slots] = self.dequantize_keys(layer, plan.opened_blocks).to(self.dtype)

    def begin_step_write(self, flat: Tensor, tables: Tensor, ends: list[int]) -> Tensor:
        """int4, for a writer that stores every layer's new keys itself (the compiled CPU step, which then writes
        each new key to its stage row or residual slot and seals the staged blocks, as ``write`` does): this
        forward's plan (``self.plan``), opened blocks' residuals and the sealed blocks' keys so far, every layer.
        flat: the written global slots; tables, ends: as ``write``'s. -> stage [L, ns, bs, Hkv, D] (compute dtype)."""
        plan = self.plan = self._plan_int4(flat, tables, ends)
        self.fresh = None  # the writer keeps its own stage
        L, ns = self.k.shape[0], plan.seal_blocks.numel()
        stage = torch.empty(L, ns, *self.k_open.shape[2:], dtype=self.dtype, device=self.device)
        if ns or plan.opened_blocks.numel():
            for layer in range(L):
                self._stage_keys(layer, plan, stage[layer])
        return stage

    def _seal(self, layer: int, blocks: Tensor, keys: Tensor) -> None:
        """keys [n, bs, Hkv, D] of whole blocks -> their int4 codes, per channel over the block's tokens."""
        packed, scale, low = quantize_asym4(keys, dim=1)
        self.k[layer, blocks] = packed
        self.k_scale[layer, blocks] = scale
        self.k_min[layer, blocks] = low

    def block_freed(self, block: int) -> None:
        """A block went back to the free pool: seal its open keys (a prefix-cached block is read again later) and
        give its residual slot back (runtime.paged_cache.BlockManager.on_free)."""
        if self.kv_dtype != "int4" or block not in self.open_slot_of:
            return
        slot = self.open_slot_of.pop(block)
        index = torch.tensor([block], device=self.device)
        for layer in range(self.k.shape[0]):
            self._seal(layer, index, self.k_open[layer, slot : slot + 1])
        self.open_of[block] = -1
        self.open_of_dev[block] = -1
        self.free_open.append(slot)

    # ---- read -------------------------------------------------------------------------------------

    def dequantize_keys(self, layer: int, blocks: Tensor) -> Tensor:
        """int4: keys of blocks [...] from their codes (open slots ignored) -> fp32 [..., bs, Hkv, D]."""
        return dequantize_asym4(self.k[layer, blocks], self.k_scale[layer, blocks], self.k_min[layer, blocks], -3)

    def read_slots(self, layer: int, tables: Tensor, start: int, stop: int) -> tuple[Tensor, Tensor]:
        """Indices start .. stop - 1 of each row (tables [B, nb]) -> k, v [B, Hkv, stop - start, D], dequantized
        (fp32; auto: the stored dtype): only those rows are read, whatever the block size."""
        bs = self.block_size
        index = torch.arange(start, stop, device=tables.device)
        block, offset = tables[:, index // bs], index % bs  # [B, n], [n]
        if self.kv_dtype == "auto":
            k, v = self.k[layer][block, offset], self.v[layer][block, offset]
        elif self.kv_dtype in ("int8", "fp8_e4m3"):
            k = dequantize_scaled(self.k[layer][block, offset], self.k_scale[layer][block, offset])
            v = dequantize_scaled(self.v[layer][block, offset], self.v_scale[layer][block, offset])
        else:  # keys: the block's per-channel scale and min, or the open block's residual
            codes = unpack_int4(self.k[layer][block, offset]).float()
            k = codes * self.k_scale[layer][block].float() + self.k_min[layer][block].float()
            slot = self.open_of_dev[block]  # [B, n]
            if bool((slot >= 0).any()):
                open_keys = self.k_open[layer][slot.clamp(min=0), offset].float()
                k = torch.where((slot >= 0)[..., None, None], open_keys, k)
            v_scale, v_min = self.v_scale[layer][block, offset], self.v_min[layer][block, offset]
            v = dequantize_asym4(self.v[layer][block, offset], v_scale, v_min, -1)
        return k.transpose(1, 2), v.transpose(1, 2)

    def attend(
        self,
        layer: int,
        q: Tensor,
        tables: Tensor,
        kv_len: int,
        mask: Tensor | None = None,
        is_causal: bool = False,
        sink_q: Tensor | None = None,
        num_sinks: int = 0,
        query_index: Tensor | None = None,
    ) -> Tensor:
        """Attention of q [B, H, T, D] over slots 0..kv_len-1 of each row's blocks (tables [B, nb]).
        query_index [B, T]: each query's index in its sequence (int4: which of the groups this write sealed it
        still reads in full precision)."""
        bs = self.block_size
        chunk = max(1, CHUNK // bs) * bs if bs < CHUNK else CHUNK  # whole blocks, unless one block holds a row

        def window(start: int, stop: int) -> tuple[Tensor, int]:
            first, last = start // bs, -(-stop // bs)
            return tables[:, first:last], start - first * bs

        def read(start: int, stop: int) -> tuple[Tensor, Tensor]:
            return self.read_slots(layer, tables, start, stop)

        fresh_from = read_fresh = None
        if self.kv_dtype == "int4" and query_index is not None and self.fresh is not None and self.fresh[0] == layer:
            stage = self.fresh[1]
            # token-by-token, query i read group g in full precision while g was not final: g ends after i+1-lookahead
            fresh_from = torch.div(query_index + 1 - self.lookahead, bs, rounding_mode="floor").clamp(min=0) * bs

            def read_fresh(start: int, stop: int) -> tuple[Tensor, Tensor] | None:
                blocks, lo = window(start, stop)
                pos = self.plan.stage_of[blocks]  # [B, n]
                if not bool((pos >= 0).any()):
                    return None
                B, n = pos.shape
                k = stage[pos.clamp(min=0)].reshape(B, n * bs, *stage.shape[2:]).transpose(1, 2)
                is_fresh = (pos >= 0)[:, :, None].expand(-1, -1, bs).reshape(B, n * bs)
                return k[:, :, lo : lo + stop - start], is_fresh[:, lo : lo + stop - start]

        return chunked_attention(
            q, read, kv_len, mask, is_causal, chunk, sink_q, num_sinks, read_fresh, fresh_from, self.kv_dtype == "int8"
        )

    # ---- copies -----------------------------------------------------------------------------------

    def copy_slots(self, src: Tensor, dst: Tensor) -> None:
        """Copy the k/v at global slots src to slots dst in every layer (a tree's accepted path)."""
        L, bs = self.k.shape[0], self.block_size
        if self.kv_dtype == "int4":  # values per token; keys of open blocks live in the residual
            per_token = [self.v, self.v_scale, self.v_min]
        elif self.kv_dtype == "auto":
            per_token = [self.k, self.v]
        else:
            per_token = [self.k, self.v, self.k_scale, self.v_scale]
        for t in per_token:
            t = as_bytes(t)
            t[:, dst // bs, dst % bs] = t[:, src // bs, src % bs]
        if self.kv_dtype == "int4":
            src_rows, dst_rows = self._open_rows(src), self._open_rows(dst)
            flat = self.k_open.view(L, -1, *self.k_open.shape[3:])
            flat[:, dst_rows] = flat[:, src_rows]

    def _open_rows(self, slots: Tensor) -> Tensor:
        """Global slots of open int4 blocks -> their rows in k_open (open slot * bs + offset)."""
        bs = self.block_size
        open_slot = self.open_of[(slots // bs).cpu()]
        if bool((open_slot < 0).any()):
            raise RuntimeError("int4 KV: a copy touches a sealed key group (the cache's lookahead is too short)")
        return open_slot.to(self.device) * bs + slots % bs
