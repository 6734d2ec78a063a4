"""Quantized KV storage (runtime.kv_quant): each format's quantize / dequantize against a reference written here,
attention over a quantized pool against SDPA over its dequantized copy, int4's residual window and chunk
independence, and the bytes the block budget counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime import kv_quant
from runtime.kv_cache import QuantizedKVCache
from runtime.kv_quant import (
    CHUNK,
    KVPool,
    as_bytes,
    bytes_per_token_head,
    dequantize_asym4,
    dequantize_scaled,
    pack_int4,
    quantize_asym4,
    quantize_fp8,
    quantize_int8,
    unpack_int4,
)
from tests.tiny_models import TINY_CONFIGS

FORMATS = ["auto", "int8", "fp8_e4m3", "int4"]
TINY = TINY_CONFIGS["llama"]


def e4m3_grid() -> torch.Tensor:
    """Every finite float8 e4m3fn value, from the format's definition (1 sign, 4 exponent bits with bias 7, 3
    mantissa bits, subnormals at exponent 0, no infinities, S.1111.111 is NaN): the oracle for fp8 rounding."""
    values = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN
            v = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
            values += [v, -v]
    return torch.tensor(sorted(set(values)), dtype=torch.float64)


def test_fp8_grid_oracle_agrees_with_torch_on_every_code():
    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn).float()
    finite = codes[~codes.isnan()].double().unique()
    assert torch.equal(finite, e4m3_grid().unique())
    assert e4m3_grid().max() == 448


def test_int8_round_trip_matches_the_reference_formula():
    x = torch.randn(50, 64) * torch.rand(50, 1) * 10
    x[3] = 0  # a zero vector: scale 1, codes 0, exact
    codes, scale = quantize_int8(x)
    ref_scale = (x.abs().amax(-1) / 127).to(torch.float16)
    ref_scale[3] = 1
    assert torch.equal(scale, ref_scale)
    ref_codes = torch.clamp(torch.round(x / ref_scale.float()[:, None]), -127, 127)
    assert torch.equal(codes.float(), ref_codes)
    deq = dequantize_scaled(codes, scale)
    assert torch.equal(deq, ref_codes * ref_scale.float()[:, None])
    assert (deq - x).abs().le(ref_scale.float()[:, None] * 0.5 + 1e-6).all()  # within half a step
    assert torch.equal(deq[3], torch.zeros(64))


def test_round_query_puts_each_vector_on_its_16_bit_grid():
    """round_query: each vector's elements become multiples of f = amax / 32767 (its largest at +-32767 f), the
    nearest multiple with ties to even, a zero vector stays zero; against the formula in float64."""
    q = torch.randn(40, 64, dtype=torch.float64) * torch.rand(40, 1, dtype=torch.float64) * 8
    q[3] = 0
    q[5, :4] = torch.tensor([2.5, 3.5, -2.5, 32767.0])  # amax 32767: f = 1, the ties land on even integers
    got = kv_quant.round_query(q.float())
    assert got.dtype == torch.float32
    x = q.float().double()
    f = (x.abs().amax(-1, keepdim=True).float() / 32767).double()  # fp32 division, as the step takes it
    f[3] = 1
    k = torch.round(got.double() / f)  # the grid's integers (got = k * f rounded to fp32: k is recovered exactly)
    assert torch.equal(got, (k * f).float())
    assert ((k - x / f).abs() <= 0.5 + 1e-3).all()  # the nearest multiple (to an fp32 division's precision)
    assert torch.equal(k.abs().amax(-1)[torch.arange(40) != 3], torch.full((39,), 32767.0, dtype=torch.float64))
    assert torch.equal(got[5, :4], torch.tensor([2.0, 4.0, -2.0, 32767.0]))  # ties to even
    assert torch.equal(got[3], torch.zeros(64))


def test_fp8_round_trip_rounds_to_the_nearest_e4m3_value():
    x = torch.randn(40, 64) * torch.rand(40, 1) * 100
    codes, scale = quantize_fp8(x)
    assert codes.dtype == torch.float8_e4m3fn
    assert torch.equal(scale, (x.abs().amax(-1) / 448).to(torch.float16))
    y = (x / scale.float()[:, None]).double().clamp(-448, 448)  # the scaled value each code must round
    got = codes.double()
    grid = e4m3_grid()
    nearest = (y[..., None] - grid).abs().min(-1).values
    assert torch.equal((got - y).abs(), nearest), "every code is a nearest e4m3 value of x / scale"
    assert torch.equal(dequantize_scaled(codes, scale), codes.float() * scale.float()[:, None])


def test_int4_packing_order_and_round_trip():
    codes = torch.randint(0, 16, (7, 64), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (7, 32)
    assert torch.equal(packed[:, 5], codes[:, 10] + 16 * codes[:, 11])  # channel 2i low nibble, 2i+1 high
    assert torch.equal(unpack_int4(packed), codes)


@pytest.mark.parametrize("dim", [0, -1])  # keys: per channel over a group of tokens; values: per token
def test_int4_asymmetric_matches_the_reference_formula(dim):
    x = torch.randn(64, 3, 64) * 4 + torch.randn(1, 3, 64)  # offset channels: asymmetric ranges
    packed, scale, low = quantize_asym4(x, dim)
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    ref_scale, ref_low = ((hi - lo) / 15).half(), lo.half()
    assert torch.equal(scale, ref_scale.squeeze(dim))
    assert torch.equal(low, ref_low.squeeze(dim))
    ref_codes = torch.clamp(torch.round((x - ref_low.float()) / ref_scale.float()), 0, 15)
    assert torch.equal(unpack_int4(packed).float(), ref_codes)
    deq = dequantize_asym4(packed, scale, low, dim)
    assert torch.equal(deq, ref_codes * ref_scale.float() + ref_low.float())
    assert (deq - x).abs().le(ref_scale.float() * 0.5 + 2e-3).all()  # half a step (+ fp16 rounding of min)


def test_bytes_per_token_head_count_codes_and_scales():
    assert bytes_per_token_head("auto", 64, 2) == 256  # bf16 k + v
    assert bytes_per_token_head("int8", 64, 2) == 2 * (64 + 2)
    assert bytes_per_token_head("fp8_e4m3", 64, 4) == 2 * (64 + 2)
    assert bytes_per_token_head("int4", 64, 2, group=64) == 32 + 32 + 4 + 4  # codes, value scale+min, key scale+min


def write_random(pool: KVPool, B: int, S: int, seed: int = 0, lookahead_chunks=None):
    """Fill each row's first S slots with random k/v (rows own consecutive blocks); returns tables [B, nb]."""
    gen = torch.Generator().manual_seed(seed)
    L, N, bs = pool.k.shape[:3]
    H = pool.k.shape[3]
    D = 16
    nb = N // B
    tables = torch.arange(N).view(B, nb)
    for layer in range(L):
        k = torch.randn(B, H, S, D, generator=gen) + torch.randn(1, H, 1, D, generator=gen)
        v = torch.randn(B, H, S, D, generator=gen)
        slots = torch.arange(S)[None] + (torch.arange(B) * nb * bs)[:, None]
        pool.write(layer, k, v, slots, tables, [S] * B)
    return tables


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "chunked"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_attention_over_a_quantized_pool_equals_sdpa_over_its_dequantized_copy(fmt, dense, monkeypatch):
    """Both readings: the whole dequantized cache through SDPA (up to DENSE_BYTES) and CHUNK-sized reads with an
    online softmax (beyond it); int8 keys scored against the query on its 16-bit grid (round_query)."""
    monkeypatch.setattr(kv_quant, "DENSE_BYTES", kv_quant.DENSE_BYTES if dense else 0)
    B, H, Hkv, D, bs, S, T = 2, 4, 2, 16, 16, 600, 3  # S spans several CHUNK-sized reads
    pool = KVPool(2, B * 40, bs, Hkv, D, fmt, torch.float32, open_blocks=8)
    tables = write_random(pool, B, S)
    q = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(1))
    positions = torch.tensor([[S - 3, S - 2, S - 1], [200, 201, 202]])  # a causal mask per row
    mask = torch.arange(S)[None, None, None, :] <= positions[:, None, :, None]
    for layer in range(2):
        k, v = pool.read_slots(layer, tables, 0, S)  # the dequantized copy, [B, Hkv, S, D]
        scored = kv_quant.round_query(q) if fmt == "int8" else q
        ref = F.scaled_dot_product_attention(scored, k[:, :, :S], v[:, :, :S], attn_mask=mask, enable_gqa=True)
        got = pool.attend(layer, q, tables, S, mask)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert S > 2 * CHUNK


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_whole_causal_prompt_is_sdpas_causal_case(fmt, monkeypatch):
    """A prompt attending to itself alone (kv_len == T, no mask) runs SDPA's causal kernel: the same attention as
    the online softmax over the chunks (and int4's fresh keys, written by this very call, read as its rule says)."""
    B, H, Hkv, D, bs, S = 1, 4, 2, 16, 16, 300
    gen = torch.Generator().manual_seed(3)
    k, v, q = (torch.randn(B, h, S, D, generator=gen) for h in (Hkv, Hkv, H))
    results = {}
    for dense in (True, False):
        monkeypatch.setattr(kv_quant, "DENSE_BYTES", 128 << 20 if dense else 0)
        pool = KVPool(1, 32, bs, Hkv, D, fmt, torch.float32, open_blocks=4)
        tables, slots = torch.arange(32)[None], torch.arange(S)[None]
        pool.write(0, k, v, slots, tables, [S])
        results[dense] = pool.attend(0, q, tables, S, is_causal=True, query_index=slots)
    torch.testing.assert_close(results[True], results[False], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "int4"])
def test_dequantized_pool_is_close_to_what_was_written(fmt):
    pool = KVPool(1, 8, 16, 2, 16, fmt, torch.float32, open_blocks=2)
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 64, 16, generator=gen), torch.randn(1, 2, 64, 16, generator=gen)
    pool.write(0, k, v, torch.arange(64)[None], torch.arange(8)[None], [64])
    got_k, got_v = pool.read_slots(0, torch.arange(4)[None], 0, 64)
    tol = {"int8": 0.03, "fp8_e4m3": 0.2, "int4": 0.6}[fmt]  # a few quantization steps of N(0, 1) data
    assert (got_k - k).abs().max() < tol and (got_v - v).abs().max() < tol
    assert not torch.equal(got_k, k)


def test_int4_keeps_the_open_group_in_full_precision_until_it_is_final():
    bs = 8
    pool = KVPool(1, 4, bs, 1, 16, "int4", torch.float32, lookahead=3, open_blocks=2)
    tables = torch.arange(4)[None]
    k = torch.randn(1, 1, 20, 16)
    v = torch.randn(1, 1, 20, 16)
    pool.write(0, k[:, :, :10], v[:, :, :10], torch.arange(10)[None], tables, [10])
    keys, _ = pool.read_slots(0, tables, 0, 2 * bs)
    # end 10 - lookahead 3 = 7 < 8: block 0 is still rewritable (a draft could land there), so open
    assert torch.equal(keys[:, :, :10], k[:, :, :10])
    assert (pool.open_of[:2] >= 0).all() and pool.free_open == []
    pool.write(0, k[:, :, 10:12], v[:, :, 10:12], torch.arange(10, 12)[None], tables, [12])
    keys, _ = pool.read_slots(0, tables, 0, 2 * bs)
    assert pool.open_of[0] == -1 and pool.open_of[1] >= 0  # 12 - 3 >= 8: block 0 sealed, its residual slot freed
    assert len(pool.free_open) == 1
    assert not torch.equal(keys[:, :, :8], k[:, :, :8])
    assert torch.equal(keys[:, :, 8:12], k[:, :, 8:12])
    packed, scale, low = quantize_asym4(k[0, :, :8].transpose(0, 1), dim=0)  # the block's keys, per channel
    assert torch.equal(keys[0, :, :8], dequantize_asym4(packed, scale, low, 0).transpose(0, 1))
    pool.block_freed(1)  # the engine freed block 1: sealed, residual returned
    assert pool.open_of[1] == -1 and sorted(pool.free_open) == [0, 1]


@pytest.mark.parametrize("reading", ["dense", "dense-rows", "chunked"])
def test_int4_attention_does_not_depend_on_how_the_sequence_is_chunked(reading, monkeypatch):
    """A query reads each key group as it would have token by token: in full precision while the group was still
    open at the query's own step, quantized after, so chunked writes give token-by-token decoding's attention.
    Every reading: SDPA over the codes and the fresh keys side by side (all queries in one call, or 7 a call, each
    call trimmed to the keys its queries see), and the online softmax."""
    monkeypatch.setattr(kv_quant, "DENSE_BYTES", 0 if reading == "chunked" else kv_quant.DENSE_BYTES)
    monkeypatch.setattr(kv_quant, "QUERY_ROWS", 7 if reading == "dense-rows" else kv_quant.QUERY_ROWS)
    torch.manual_seed(0)
    bs, H, D = 8, 2, 16
    k, v, q = torch.randn(1, H, 30, D), torch.randn(1, H, 30, D), torch.randn(1, 4, 30, D)

    def attend(chunks, lookahead):
        pool = KVPool(1, 8, bs, H, D, "int4", torch.float32, lookahead=lookahead, open_blocks=4)
        tables = torch.arange(8)[None]
        outs = []
        for a, b in chunks:
            slots = torch.arange(a, b)[None]
            pool.write(0, k[:, :, a:b], v[:, :, a:b], slots, tables, [b])
            mask = torch.arange(b)[None, None, None, :] <= slots[:, None, :, None]
            outs.append(pool.attend(0, q[:, :, a:b], tables, b, mask, query_index=slots))
        return torch.cat(outs, 2)

    for lookahead in (0, 3):
        one_by_one = attend([(i, i + 1) for i in range(30)], lookahead)
        for chunks in ([(0, 5), (5, 13), (13, 30)], [(0, 30)], [(0, 16), (16, 17), (17, 30)]):
            torch.testing.assert_close(attend(chunks, lookahead), one_by_one, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_copy_slots_moves_tokens_in_every_format(fmt):
    bs = 8
    pool = KVPool(2, 6, bs, 2, 16, fmt, torch.float32, lookahead=8, open_blocks=4)
    tables = torch.arange(6)[None]
    gen = torch.Generator().manual_seed(0)
    for layer in range(2):
        k, v = torch.randn(1, 2, 20, 16, generator=gen), torch.randn(1, 2, 20, 16, generator=gen)
        pool.write(layer, k, v, torch.arange(20)[None], tables, [20])
    before = [pool.read_slots(layer, tables, 0, 3 * bs) for layer in range(2)]
    src, dst = torch.tensor([15, 17, 19]), torch.tensor([13, 14, 15])  # a tree's accepted path, within the lookahead
    pool.copy_slots(src, dst)
    for layer in range(2):
        k, v = pool.read_slots(layer, tables, 0, 3 * bs)
        for x, old in zip((k, v), before[layer]):
            assert torch.equal(x[:, :, dst], old[:, :, src])
            assert torch.equal(x[:, :, :13], old[:, :, :13])


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "int4"])
def test_a_quantized_pool_stores_each_heads_rows_of_a_block_together(fmt):
    """The stored codes are [L, N, Hkv, bs, ...]: block n's rows of kv head h are adjacent, in slot order (what the
    CPU step streams); the [L, N, bs, Hkv, ...] attributes are views of the same memory."""
    bs, Hkv, D = 8, 3, 16
    pool = KVPool(1, 4, bs, Hkv, D, fmt, torch.float32, open_blocks=2)
    k = torch.randn(1, Hkv, 32, D, generator=torch.Generator().manual_seed(0))
    pool.write(0, k, k.clone(), torch.arange(32)[None], torch.arange(4)[None], [32])
    stored = as_bytes(pool.stored["v"])
    assert stored.is_contiguous() and stored.shape[:4] == (1, 4, Hkv, bs)
    assert as_bytes(pool.v).data_ptr() == stored.data_ptr()
    for block in range(4):
        for h in range(Hkv):
            for off in range(bs):
                assert torch.equal(stored[0, block, h, off], as_bytes(pool.v)[0, block, off, h])
    assert pool.stored["v_scale"].shape == (1, 4, Hkv, bs) and pool.stored["v_scale"].is_contiguous()


def test_a_contiguous_int8_cache_is_stored_like_the_full_precision_cache():
    """One block per row: codes [L, B, Hkv, S, D], the order of runtime.kv_cache.KVCache."""
    cache = QuantizedKVCache(TINY, batch_size=2, max_seq_len=40, kv_dtype="int8", block_size=8)
    L, Hkv, D = TINY.num_layers, TINY.num_kv_heads, TINY.head_dim
    assert cache.pool.stored["k"].shape == (L, 2, Hkv, 40, D) and cache.pool.block_size == 40
