"""Bit packing of integer codes into int32 words, as GPTQ and AWQ checkpoints store them.

Both formats treat a run of codes as a little-endian bit stream: code j of a run occupies bits
[j*bits, (j+1)*bits) of consecutive 32-bit words, lowest bits first. For 2/4/8 bits a word holds a whole
number of codes; 3-bit codes straddle words (32 codes fill 3 words; codes 10 and 21 cross a boundary),
which is exactly GPTQ's 3-bit layout. AWQ additionally permutes the 8 codes within a word.
"""

from __future__ import annotations

from math import gcd

import torch
from torch import Tensor

# AWQ GEMM: nibble i of a packed word holds output column AWQ_ORDER[i] of its block of 8.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = tuple(AWQ_ORDER.index(i) for i in range(8))  # (0, 4, 1, 5, 2, 6, 3, 7)


def block_shape(bits: int) -> tuple[int, int]:
    """(codes, words) of the smallest run that fills whole int32 words: (8, 1) for 4-bit, (32, 3) for 3-bit."""
    g = gcd(32, bits)
    return 32 // g, bits // g


def packed_length(n: int, bits: int) -> int:
    """Number of int32 words holding n codes; n must fill whole words (see block_shape)."""
    codes, words = block_shape(bits)
    if n % codes:
        raise ValueError(f"{n} codes of {bits} bits do not fill whole int32 words (need a multiple of {codes})")
    return n // codes * words


def to_int32(words: Tensor) -> Tensor:
    """Unsigned 32-bit values held in int64 -> int32 with the same bits (two's complement wrap)."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """codes [n, cols] (integers in [0, 2**bits)) -> int32 [n * bits / 32, cols], packed along dim 0.

    Works in int32 throughout: torch's left shift of a signed int wraps like an unsigned one, so a code
    shifted into bit 31 lands as the word's sign bit, which is exactly the stored bit pattern (int64 and a
    final wrap cost 3-4x more time and memory: this runs for every layer on every save and load)."""
    n, cols = codes.shape
    per_block, words_per_block = block_shape(bits)
    n_words = packed_length(n, bits)
    v = codes.to(torch.int32).reshape(n // per_block, per_block, cols)  # [blocks, codes, cols]
    out = torch.zeros(n // per_block, words_per_block, cols, dtype=torch.int32, device=codes.device)
    for j in range(per_block):
        word, shift = divmod(j * bits, 32)
        out[:, word] |= v[:, j] << shift
        if shift + bits > 32:  # the code's high bits spill into the next word (3-bit only)
            out[:, word + 1] |= v[:, j] >> (32 - shift)
    return out.reshape(n_words, cols)


def unpack_codes(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of pack_codes: int32 [n * bits / 32, cols] -> uint8 codes [n, cols]."""
    per_block, words_per_block = block_shape(bits)
    n_words, cols = packed.shape
    if n_words != packed_length(n, bits):
        raise ValueError(f"{n_words} packed rows do not hold {n} codes of {bits} bits")
    mask = (1 << bits) - 1
    if words_per_block == 1:  # whole codes per word: one vectorised shift (masking undoes sign extension)
        shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
        return ((packed[:, None, :] >> shifts[None, :, None]) & mask).reshape(n, cols).to(torch.uint8)
    w = (packed.to(torch.int64) & 0xFFFFFFFF).reshape(n // per_block, words_per_block, cols)
    out = torch.empty(n // per_block, per_block, cols, dtype=torch.int64, device=packed.device)
    for j in range(per_block):
        word, shift = divmod(j * bits, 32)
        value = w[:, word] >> shift
        if shift + bits > 32:
            value = value | (w[:, word + 1] << (32 - shift))
        out[:, j] = value & mask
    return out.reshape(n, cols).to(torch.uint8)


def pack_codes_awq(codes: Tensor, bits: int = 4) -> Tensor:
    """AWQ GEMM: codes [rows, out] -> int32 [rows, out / 8], packed along dim 1 in AWQ_ORDER."""
    rows, out = codes.shape
    if bits != 4:
        raise ValueError(f"AWQ GEMM packs 4-bit codes, got {bits}")
    if out % 8:
        raise ValueError(f"AWQ GEMM packs 8 output columns per word; {out} is not a multiple of 8")
    v = codes.to(torch.int64).reshape(rows, out // 8, 8)[:, :, list(AWQ_ORDER)]  # nibble i <- column ORDER[i]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=codes.device)
    return to_int32((v << shifts).sum(-1))


def unpack_codes_awq(packed: Tensor, bits: int = 4) -> Tensor:
    """Inverse of pack_codes_awq: int32 [rows, out / 8] -> uint8 [rows, out]."""
    if bits != 4:
        raise ValueError(f"AWQ GEMM packs 4-bit codes, got {bits}")
    rows, n_words = packed.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=packed.device)
    nibbles = ((packed.to(torch.int64) & 0xFFFFFFFF)[..., None] >> shifts) & 0xF  # [rows, words, 8]
    return nibbles[:, :, list(AWQ_REVERSE_ORDER)].reshape(rows, n_words * 8).to(torch.uint8)
