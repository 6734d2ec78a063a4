"""Paged KV cache: a pool of fixed-size blocks, per-sequence block tables, and prefix caching.

Layout: per layer a pool ``[num_blocks, block_size, Hkv, D]`` for k and for v. A sequence owns a list of
block ids (its block table); token i of the sequence lives at slot ``table[i // bs] * bs + i % bs``.
``PagedAttentionMetadata.slots`` carries those global slot ids, so the model's one forward writes through
them unchanged. ``PagedKVCache.attend`` is the model's attention over the pool: pure decode steps (one
query per row, plain causal mask) go to the Triton paged-decode kernel in
``runtime/kernels/paged_attention.py``, which reads the blocks in place; everything else (prefill chunks,
k+1 verification, tree masks, CPU by default) gathers the blocks into ``[B, Hkv, S, D]`` and runs SDPA with
the metadata's mask, exactly as ``update`` + the model's SDPA would.

Quantized pools (``kv_cache_dtype`` int8, fp8_e4m3, int4; layouts in runtime.kv_quant): every write is
quantized, attention dequantizes a chunk of blocks at a time (the Triton decode kernel reads int8 / fp8 codes and
scales in place); the block budget counts the real bytes per block (codes + scales) and, for int4, the residual
of full-precision keys each running sequence may hold (``residual_bytes``). int4's key group is the block.

Block 0 is never handed out: padding tokens of a ragged batch write there, and block tables of shorter
sequences are padded with it (those keys are masked, and its contents stay finite).

Prefix caching: when a block is full its KV is final, so it is registered under a hash chained over the
previous block's hash and the block's token ids. A new sequence whose leading full blocks hash (and
compare, id by id) equal to registered ones shares them by reference count instead of recomputing them.
Freed blocks that carry a hash stay in the pool as "cached free" blocks, evicted least recently used
first when a fresh block is needed.
"""

from __future__ import annotations

import importlib.util
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.config import ModelConfig
from runtime.kv_quant import (
    KVPool,
    bytes_per_token_head,
    check_kv_dtype,
    open_blocks_per_sequence,
    residual_bytes_per_block,
    round_query,
)
from runtime.model import AttentionMetadata

SCRATCH_BLOCK = 0
DECODE_KERNELS = ("auto", "triton", "torch")


class BlockAllocationError(RuntimeError):
    """The pool has no block to give (the scheduler checks first; reaching this is a bug)."""


def chain_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """The prefix-cache key of a full block: depends on every token before it through prev_hash."""
    return hash((prev_hash, token_ids))


@dataclass
class PrefixMatch:
    block_ids: list[int]  # leading full blocks of the sequence already in the cache
    hashes: list[int]

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


class BlockManager:
    """Hands out blocks, counts references, keeps the prefix cache and its LRU of unreferenced blocks.

    A sequence is any object with ``block_table: list[int]`` and ``block_hashes: list[int]`` (hashes of
    its full, registered blocks, in order); the manager mutates both.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < 2:
            raise ValueError(f"the pool needs at least 2 blocks (one is reserved scratch), got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        # per-block state as flat lists (pools of 10^5-10^6 blocks are normal)
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks  # set while registered in the prefix cache
        self.block_token_ids: list[tuple[int, ...] | None] = [None] * num_blocks  # compared on a hit
        self.free_ids: deque[int] = deque(range(1, num_blocks))  # ref 0, no hash
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # ref 0, hashed; LRU first
        self.hash_to_block: dict[int, int] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens served from cached blocks
        self.on_free: Callable[[int], None] | None = None  # told each block whose last reference goes (int4 KV)

    # ---- accounting --------------------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take: never-used or freed ones, plus evictable cached ones."""
        return len(self.free_ids) + len(self.cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ------------------------------------------------------------------------------

    def match_prefix(self, token_ids: list[int]) -> PrefixMatch:
        """Leading full blocks of token_ids found in the cache; at least one token is left to compute
        (the last prompt token's logits are needed), so a fully cached prompt gives up its last block."""
        match = PrefixMatch([], [])
        if not self.enable_prefix_caching:
            return match
        bs, prev = self.block_size, None
        for i in range((len(token_ids) - 1) // bs):
            ids = tuple(token_ids[i * bs : (i + 1) * bs])
            h = chain_hash(prev, ids)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.block_token_ids[block_id] != ids:
                break
            match.block_ids.append(block_id)
            match.hashes.append(h)
            prev = h
        return match

    def blocks_needed(self, seq, num_tokens: int, match: PrefixMatch | None = None) -> int:
        """Free-pool blocks that admitting/extending seq to num_tokens slots takes (cached-free hits
        leave the free pool too, so they count)."""
        have = len(seq.block_table)
        taken_from_lru = 0
        if match is not None:
            have += match.num_blocks
            taken_from_lru = sum(1 for b in match.block_ids if self.ref_counts[b] == 0)
        return max(0, self.blocks_for(num_tokens) - have) + taken_from_lru

    def can_allocate(self, seq, num_tokens: int, match: PrefixMatch | None = None) -> bool:
        return self.blocks_needed(seq, num_tokens, match) <= self.num_free_blocks

    def take_prefix(self, seq, match: PrefixMatch, num_prompt_tokens: int, count: bool = True) -> int:
        """Give seq (with an empty table) the matched blocks; returns the number of cached tokens.
        count=False keeps the lookup out of the hit-rate statistics (re-admission after preemption)."""
        assert not seq.block_table, "prefix blocks go at the start of an empty block table"
        for block_id in match.block_ids:
            if self.ref_counts[block_id] == 0:
                del self.cached_free[block_id]
            self.ref_counts[block_id] += 1
            seq.block_table.append(block_id)
        seq.block_hashes = list(match.hashes)
        cached = match.num_blocks * self.block_size
        if self.enable_prefix_caching and count:
            self.prefix_queries += num_prompt_tokens
            self.prefix_hits += cached
        return cached

    def register_full_blocks(self, seq, token_ids: list[int], num_computed: int) -> None:
        """Register every block of seq whose bs tokens all have their KV written (num_computed)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), num_computed // bs):
            ids = tuple(token_ids[i * bs : (i + 1) * bs])
            prev = seq.block_hashes[-1] if seq.block_hashes else None
            h = chain_hash(prev, ids)
            seq.block_hashes.append(h)
            block_id = seq.block_table[i]
            if h in self.hash_to_block:  # computed twice concurrently: keep the registered copy
                continue
            self.block_hash[block_id], self.block_token_ids[block_id] = h, ids
            self.hash_to_block[h] = block_id

    # ---- allocate / free ---------------------------------------------------------------------------

    def _fresh_block(self) -> int:
        if self.free_ids:
            block_id = self.free_ids.popleft()
        elif self.cached_free:
            block_id, _ = self.cached_free.popitem(last=False)  # least recently used
            self._forget(block_id)
        else:
            raise BlockAllocationError("KV block pool exhausted")
        self.ref_counts[block_id] = 1
        return block_id

    def _forget(self, block_id: int) -> None:
        del self.hash_to_block[self.block_hash[block_id]]
        self.block_hash[block_id] = self.block_token_ids[block_id] = None

    def allocate(self, seq, num_tokens: int) -> None:
        """Grow seq's block table to cover num_tokens slots."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need > self.num_free_blocks:
            raise BlockAllocationError(f"need {need} blocks, {self.num_free_blocks} free")
        for _ in range(need):
            seq.block_table.append(self._fresh_block())

    def free(self, seq) -> None:
        """Drop seq's references. Tail blocks first, so the LRU evicts a prefix's end before its start."""
        for block_id in reversed(seq.block_table):
            if self.ref_counts[block_id] <= 0:
                raise AssertionError(f"double free of block {block_id}")
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                if self.on_free is not None:
                    self.on_free(block_id)
                if self.block_hash[block_id] is not None:
                    self.cached_free[block_id] = None
                else:
                    self.free_ids.append(block_id)
        seq.block_table = []
        seq.block_hashes = []

    def reset_prefix_cache(self) -> None:
        """Forget every unreferenced cached block (referenced ones keep their hash until freed)."""
        for block_id in list(self.cached_free):
            self._forget(block_id)
            self.free_ids.append(block_id)
        self.cached_free.clear()

    def check_invariants(self, live_seqs) -> None:
        """Exact bookkeeping checks (used by tests): every usable block is in exactly one of {free,
        cached free, referenced}, and each ref count equals the number of live tables holding it."""
        refs = [0] * self.num_blocks
        for seq in live_seqs:
            for block_id in seq.block_table:
                refs[block_id] += 1
        assert refs[SCRATCH_BLOCK] == 0 and self.ref_counts[SCRATCH_BLOCK] == 0
        free, cached = set(self.free_ids), set(self.cached_free)
        assert len(free) == len(self.free_ids), "a block is in the free list twice"
        assert not (free & cached), "a block is both free and cached-free"
        assert SCRATCH_BLOCK not in free | cached
        assert self.ref_counts == refs, "ref counts differ from the live block tables"
        for b in range(1, self.num_blocks):
            in_pool = b in free or b in cached
            assert in_pool == (refs[b] == 0), f"block {b}: referenced yet free, or lost"
            assert (b in cached) <= (self.block_hash[b] is not None)
            assert (b in free) <= (self.block_hash[b] is None)
            if self.block_hash[b] is not None:
                assert self.hash_to_block[self.block_hash[b]] == b
        assert len(self.hash_to_block) == sum(h is not None for h in self.block_hash)


@dataclass
class PagedAttentionMetadata(AttentionMetadata):
    """AttentionMetadata plus the block tables the reads go through.

    slots: [B, T] global pool slots (block_id * block_size + offset) the new k/v are written to.
    block_tables: [B, nb] block ids per row (padded with the scratch block), nb * block_size >= kv_len.
    context_lens: [B] keys each row attends to after this step's write (for the decode kernel).
    prefix_mask: True when row b's mask is exactly keys [0, context_lens[b]) (causal decoding); False for a
        custom mask (tree verification), which only the gather + SDPA path honours.
    """

    block_tables: Tensor = field(default=None)
    context_lens: Tensor = field(default=None)
    prefix_mask: bool = True


def paged_metadata(
    rows_pos: list[list[int]],
    rows_index: list[list[int]],
    tables: list[list[int]],
    block_size: int,
    device,
    local_masks: list[Tensor | None] | None = None,
) -> PagedAttentionMetadata:
    """Metadata for one forward over B sequences' new tokens, right-padded to the longest row.

    rows_pos: [B] rope positions of each row's new tokens; rows_index: [B] their indices in the sequence
    (the slot through the block table; equal to the positions except in a tree, whose siblings share a
    position). A query sees every key at an index up to its own (causal by index); local_masks[b] [T_b, T_b]
    (a tree's ancestor mask) replaces that rule among row b's new tokens. Padding tokens write the scratch
    block and, at index 0, see key 0 only: finite and unused."""
    T = max(len(r) for r in rows_index)
    kv_len = max(r[-1] for r in rows_index) + 1
    nb = -(-kv_len // block_size)

    def padded(rows: list[list[int]], width: int, value: int, dtype=torch.int64) -> Tensor:
        rows = [r[:width] + [value] * (width - len(r[:width])) for r in rows]
        return torch.tensor(rows, dtype=dtype, device=device)

    bs = block_size
    slots = [[table[i // bs] * bs + i % bs for i in idx] for idx, table in zip(rows_index, tables)]
    index = padded(rows_index, T, 0)
    key = torch.arange(kv_len, device=device)
    mask = key[None, None, None, :] <= index[:, None, :, None]  # [B, 1, T, kv_len]
    for b, local in enumerate(local_masks or []):
        if local is not None:
            n, start = local.shape[0], rows_index[b][0]
            mask[b, 0, :n, start : start + n] = local.to(device)
    return PagedAttentionMetadata(
        positions=padded(rows_pos, T, 0),
        slots=padded(slots, T, SCRATCH_BLOCK * block_size),
        mask=mask,
        kv_len=kv_len,
        block_tables=padded(tables, nb, SCRATCH_BLOCK, torch.int32),  # int32: what the decode kernel reads
        context_lens=torch.tensor([r[-1] + 1 for r in rows_index], dtype=torch.int32, device=device),
        prefix_mask=not any(m is not None for m in local_masks or []),
        starts=torch.tensor([r[0] for r in rows_index]),
        counts=torch.tensor([len(r) for r in rows_index]),
        local_mask=step_local_masks(local_masks, rows_index, T),
    )


def step_local_masks(local_masks: list[Tensor | None] | None, rows_index: list[list[int]], T: int) -> Tensor | None:
    """[B, T, T] masks among each row's new tokens for the compiled CPU step (causal where a row has none), or None
    when every row is plain causal. The step requires consecutive indices per row, as every caller feeds them."""
    if not local_masks or all(m is None for m in local_masks):
        return None
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    out = causal.expand(len(rows_index), T, T).clone()
    for b, local in enumerate(local_masks):
        if local is not None:
            n = local.shape[0]
            out[b, :n, :n] = local.cpu()
    return out


def resolve_decode_kernel(decode_kernel: str, device: torch.device, block_size: int) -> str:
    """Resolve "auto": "triton" on CUDA (when triton is installed and the block size is a power of two),
    else "torch". An explicit "triton" that cannot run is an error here, not a silent fallback later."""
    if decode_kernel not in DECODE_KERNELS:
        raise ValueError(f"decode_kernel must be one of {DECODE_KERNELS}, got {decode_kernel!r}")
    has_triton = importlib.util.find_spec("triton") is not None
    pow2 = block_size & (block_size - 1) == 0
    if decode_kernel == "auto":
        return "triton" if device.type == "cuda" and has_triton and pow2 else "torch"
    if decode_kernel == "triton" and not has_triton:
        raise ValueError('decode_kernel="triton" needs triton installed')
    if decode_kernel == "triton" and not pow2:
        raise ValueError(f'decode_kernel="triton" needs a power-of-two block size, got {block_size}')
    return decode_kernel


def triton_decode_wins(dtype: torch.dtype, batch: int, kv_len: int) -> bool:
    """The per-shape rule "auto" follows on CUDA: whether the Triton paged-decode kernel beats gather + SDPA.

    16-bit: SDPA (measured on an H200, issue 13: the kernel ran at 0.30-0.44x of gather + SDPA in bf16/fp16 at
    4k context and at batch 64; no shape class where it won). fp32: the kernel (SDPA has no flash kernel for
    fp32 and the gather copies twice the bytes; unmeasured). ``python -m evals.speed.gpu_check`` times both on a grid
    of batch and context and prints, per cell, the faster one and whether this rule picked it."""
    return dtype == torch.float32


class PagedKVCache:
    """The block pool tensors; ``attend`` (and ``update``) is the model's cache contract over block tables.

    decode_kernel: "auto" (on CUDA, per shape class by ``triton_decode_wins``; torch on CPU), "triton" (also on
    CPU, where it needs
    TRITON_INTERPRET=1: for tests) or "torch" (always gather + SDPA). ``kernel_launches`` counts the
    Triton decode calls, so callers can see which path ran.
    kv_cache_dtype: auto (the compute dtype) | int8 | fp8_e4m3 | int4 (runtime.kv_quant); a quantized pool attends
    chunk by chunk (or, int8 / fp8 decode on CUDA, through the Triton kernel). int4 only: max_num_seqs and
    lookahead (a speculator's draft slots) size the residual of open key groups.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        decode_kernel: str = "auto",
        kv_cache_dtype: str = "auto",
        max_num_seqs: int = 0,
        lookahead: int = 0,
    ):
        self.kv_cache_dtype = check_kv_dtype(kv_cache_dtype)
        open_blocks = max_num_seqs * open_blocks_per_sequence(block_size, lookahead) if kv_cache_dtype == "int4" else 0
        self.pool = KVPool.for_model(
            config, num_blocks, block_size, kv_cache_dtype, dtype, device, lookahead, open_blocks
        )
        self.k, self.v = self.pool.k, self.pool.v  # [L, N, bs, Hkv, D] (int4: D / 2 packed bytes)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.decode_kernel = resolve_decode_kernel(decode_kernel, self.k.device, block_size)
        self.per_shape = decode_kernel == "auto"  # "auto" on CUDA: triton_decode_wins decides per step
        self.kernel_launches = 0
        self._decode_fn = None
        if self.decode_kernel == "triton" and kv_cache_dtype in ("auto", "int8", "fp8_e4m3"):
            from runtime.kernels import paged_attention  # imported only here: torch-only runs never load triton

            self._decode_fn = paged_attention.paged_decode_attention

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
        """Stored bytes of one block, every layer: codes + scales (runtime.kv_quant.bytes_per_token_head)."""
        elem = torch.empty((), dtype=dtype).element_size()
        per_token = bytes_per_token_head(kv_cache_dtype, config.head_dim, elem, group=block_size)
        return round(config.num_layers * block_size * config.num_kv_heads * per_token)

    @staticmethod
    def residual_bytes(
        config: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str, max_num_seqs: int, lookahead=0
    ) -> int:
        """int4: the full-precision keys of the open groups of max_num_seqs sequences (0 for other formats)."""
        if kv_cache_dtype != "int4":
            return 0
        elem = torch.empty((), dtype=dtype).element_size()
        per_block = residual_bytes_per_block(config.head_dim, config.num_kv_heads, config.num_layers, block_size, elem)
        return max_num_seqs * open_blocks_per_sequence(block_size, lookahead) * per_block

    @classmethod
    def blocks_for_budget(
        cls,
        config: ModelConfig,
        budget_bytes: int,
        block_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
        max_num_seqs: int = 0,
        lookahead: int = 0,
    ) -> int:
        """Blocks that fit the budget once the int4 residual of max_num_seqs sequences is set aside."""
        residual = cls.residual_bytes(config, block_size, dtype, kv_cache_dtype, max_num_seqs, lookahead)
        return max(0, budget_bytes - residual) // cls.bytes_per_block(config, block_size, dtype, kv_cache_dtype)

    def nbytes(self) -> int:
        return self.pool.nbytes()

    def block_freed(self, block_id: int) -> None:
        """BlockManager.on_free: an int4 block whose keys are still open is sealed and its residual slot freed."""
        self.pool.block_freed(block_id)

    def write(self, layer: int, k: Tensor, v: Tensor, meta: PagedAttentionMetadata) -> None:
        """Write the new k/v [B, Hkv, T, D] at meta.slots [B, T] (global pool slots)."""
        if self.kv_cache_dtype != "auto":
            slots = meta.slots.masked_fill(meta.slots < self.block_size, -1)  # padding (scratch block): no write
            ends = meta.context_lens.tolist() if self.kv_cache_dtype == "int4" and layer == 0 else []
            self.pool.write(layer, k, v, slots, meta.block_tables.long(), ends)
            return
        B, H, T, D = k.shape
        flat_k = self.k[layer].view(-1, H, D)  # [num_blocks * bs, Hkv, D]
        flat_v = self.v[layer].view(-1, H, D)
        slots = meta.slots.reshape(-1)
        flat_k.index_copy_(0, slots, k.transpose(1, 2).reshape(B * T, H, D))
        flat_v.index_copy_(0, slots, v.transpose(1, 2).reshape(B * T, H, D))

    def update(self, layer: int, k: Tensor, v: Tensor, meta: PagedAttentionMetadata) -> tuple[Tensor, Tensor]:
        """Write k/v [B, Hkv, T, D] at meta.slots [B, T]; return [B, Hkv, kv_len, D] gathered through
        meta.block_tables (full-precision pools only: a quantized pool is read inside ``attend``)."""
        if self.kv_cache_dtype != "auto":
            raise NotImplementedError("a quantized KV pool is read inside attend(), never gathered whole")
        self.write(layer, k, v, meta)
        return gather_blocks(self.k[layer], meta.block_tables, meta.kv_len), gather_blocks(
            self.v[layer], meta.block_tables, meta.kv_len
        )

    def copy_slots(self, src: Tensor, dst: Tensor) -> None:
        """Copy the k/v at global slots src to slots dst in every layer (a tree's accepted path moves to
        consecutive slots)."""
        self.pool.copy_slots(src, dst)

    def uses_decode_kernel(self, q: Tensor, meta: PagedAttentionMetadata) -> bool:
        """Pure decode (one query per row, prefix mask, context lengths given) with the Triton backend."""
        if not (self._decode_fn is not None and q.shape[2] == 1 and meta.prefix_mask and meta.context_lens is not None):
            return False
        # a quantized pool: the kernel reads the codes in place, the other path dequantizes chunk by chunk (unmeasured)
        quantized = self.kv_cache_dtype != "auto"
        return not self.per_shape or quantized or triton_decode_wins(q.dtype, q.shape[0], meta.kv_len)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, meta: PagedAttentionMetadata) -> Tensor:
        """The model's attention over the pool: q [B, H, T, D] (after rope), the new k/v [B, Hkv, T, D]
        -> out [B, H, T, D]. Writes k/v first, so a decode row attends to its own new key too."""
        quantized = self.kv_cache_dtype != "auto"
        if not self.uses_decode_kernel(q, meta):
            if quantized:
                self.write(layer, k, v, meta)
                tables, T = meta.block_tables.long(), q.shape[2]
                # each query's index in its sequence: a row's real tokens come first (right padding)
                real = (meta.slots >= self.block_size).sum(1, keepdim=True)
                index = meta.context_lens[:, None].long() - real + torch.arange(T, device=q.device)
                return self.pool.attend(layer, q, tables, meta.kv_len, meta.mask, meta.is_causal, query_index=index)
            k, v = self.update(layer, k, v, meta)
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=meta.mask, is_causal=meta.is_causal, enable_gqa=True
            )
        self.write(layer, k, v, meta)
        self.kernel_launches += 1
        scales = (self.pool.k_scale[layer], self.pool.v_scale[layer]) if quantized else (None, None)
        # SDPA's default scale, so both paths compute the same function; the kernel accumulates in fp32. int8 keys
        # are scored against the query on its 16-bit grid (kv_quant.round_query, fp32), as every int8 reader does
        query = round_query(q[:, :, 0]) if self.kv_cache_dtype == "int8" else q[:, :, 0]
        out = self._decode_fn(
            query, self.k[layer], self.v[layer], meta.block_tables, meta.context_lens, q.shape[-1] ** -0.5, *scales,
        )  # fmt: skip  # [B, H, D]
        return out[:, :, None].to(q.dtype)


def gather_blocks(pool: Tensor, block_tables: Tensor, kv_len: int) -> Tensor:
    """pool [N, bs, Hkv, D], block_tables [B, nb] -> [B, Hkv, kv_len, D] (the torch reference read)."""
    B, nb = block_tables.shape
    _, bs, H, D = pool.shape
    return pool[block_tables].view(B, nb * bs, H, D)[:, :kv_len].transpose(1, 2)
