"""The CPU step's linear kernels (runtime/kernels/cpu_step.cpp) against an fp64 reference (dequantize, then
matmul), for every weight format, every kernel family this CPU runs (AVX2, AVX-512, AVX512-BF16, and AMX under each
row policy), odd shapes and 1..64 activation rows; and a row's result never depends on the other rows of the call
(bit for bit; AMX's opt-in "approximate" policy excepted, as stated)."""

from __future__ import annotations

import pytest
import torch
from patching import kernel_family

from runtime.kernels import cpu_step

ext = cpu_step.extension()
pytestmark = pytest.mark.skipif(ext is None, reason="the CPU step cannot be built here")
FAMILIES = [f for f in ("avx2", "avx512", "avx512bf16", "amx") if ext is not None and cpu_step.isa_supported(f)]
FAMILIES += ["amx-dense", "amx-approximate"] if "amx" in FAMILIES else []  # amx: its default row policy (exact)
SHAPES = [(48, 64), (37, 90), (16, 576), (100, 200)]  # (N, K): whole tiles, ragged rows and columns


@pytest.fixture(params=FAMILIES)
def family(request):
    with kernel_family(request.param) as isa:
        assert isa == request.param.partition("-")[0]
        yield request.param


def rows(m: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


def check(y: torch.Tensor, x64: torch.Tensor, w64: torch.Tensor, slack: torch.Tensor | None = None) -> None:
    """|y - x w^T| within fp32 summation-order noise: 1e-5 of sum |x| |w| (a fused dot of K products in fp32 errs
    by at most ~K * 2^-24 of it; K <= 576 here), plus slack where the kernel sums offset codes."""
    ref = x64 @ w64.T
    bound = 1e-5 * (x64.abs() @ w64.abs().T) + 1e-30
    if slack is not None:
        bound = bound + slack
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), float((err / bound).max())


def assert_row_independent(handle, x: torch.Tensor) -> None:
    """A row's result is the same bits whichever rows share the call, 1 row or many. (Only AMX's opt-in
    "approximate" row policy switches kernels at AMX_MIN_ROWS rows: then it holds among calls of AMX_MIN_ROWS or
    more rows, and among calls of fewer.)"""
    big = ext.AMX_MIN_ROWS
    together = ext.linear(handle, x)
    for m in range(x.shape[0] - big + 1):
        assert torch.equal(ext.linear(handle, x[m : m + big])[0], together[m])
    alone = ext.linear(handle, x[:1])[0]
    assert torch.equal(ext.linear(handle, x[: big - 1])[0], alone)
    if not (ext.isa() == "amx" and ext.amx_mode() == "approximate"):
        assert torch.equal(alone, together[0])


@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense(family, N, K, dtype):
    w = rows(N, K, 1).to(dtype)
    handle = cpu_step.dense_handle(w)
    for M in (1, 3, 5, 7, 8, 9, 64):  # AVX2 splits 5 / 7 / 9 rows into blocks of 3 + 2 / 4 + 3 / 3 + 3 + 3
        x = rows(M, K, M)
        xr = x.to(dtype).double()  # bf16 layers see bf16 inputs, as the Python path casts them
        check(ext.linear(handle, x), xr, w.double())
    assert_row_independent(handle, rows(9, K, 5))


@pytest.mark.parametrize("M", [1, 2, 8, 16, 17])
def test_bf16_values_round_as_torch_casts(family, M):
    """linear_bf16_values (the bf16 head's logits) equals linear's outputs cast to bf16 and back by torch, bit for
    bit (every finite value and infinity; NaN where torch has NaN): the AMX kernel rounds as it writes. Up to
    16 rows the AMX kernel writes a pass's outputs during the next pass (held back), so the shapes include one
    k block (K 32: written after the pass), an odd tile count (N 48) and one more chunk (17 rows)."""
    for N, K in [(48, 32), (100, 200), (64, 576)]:
        w = rows(N, K, 3).to(torch.bfloat16)
        handle = cpu_step.dense_handle(w)
        x = rows(M, K, M)
        x[0, 0] = float("nan")  # row 0: NaN outputs
        if M > 1:
            x[1, 0] = float("inf")  # row 1: +-inf outputs
        exact = ext.linear(handle, x)
        check(exact[2:], x[2:].to(torch.bfloat16).double(), w.double())  # the finite rows against fp64
        rounded = exact.to(torch.bfloat16).float()
        got = ext.linear_bf16_values(handle, x)
        nan = rounded.isnan()  # (a NaN's bits: 0x7fc0 as c10::BFloat16 writes it; torch's vector cast writes 0xffff)
        assert torch.equal(got.isnan(), nan), (N, K, M)
        assert torch.equal(got[~nan].view(torch.int32), rounded[~nan].view(torch.int32)), (N, K, M)
        assert bool(exact[0].isnan().any()), "row 0 was meant to hold NaN outputs"


def test_argmax_rows_is_torch_argmax():
    """argmax_rows (greedy's next tokens) equals torch.argmax on every row: ties (the first index wins, within and
    across the kernel's 8 lanes and its scalar tail), NaN (the first NaN wins, in the vector part and the tail),
    all -inf rows, signed zeros, rows shorter than a vector, and 1..13 rows (the rows split over the cores)."""
    from runtime.sampling import argmax

    g = torch.Generator().manual_seed(5)
    for V in (1, 3, 8, 9, 17, 64, 1003, 49152):
        for M in (1, 2, 8, 13):
            x = torch.randn(M, V, generator=g).mul(4).round()  # small integers: many ties
            x[0] = -float("inf")
            if M > 1:
                x[1] = 0.0
                x[1, torch.randint(V, (1,), generator=g)] = -0.0
            if M > 2:
                x[2, torch.randint(V, (2,), generator=g)] = float("nan")
            if M > 3 and V > 8:
                x[3, -1] = float("nan")  # in the tail
                x[4, V // 2] = x[4].max() + 1
                x[4, V - 1] = x[4, V // 2]  # a tie after the maximum: the first one wins
            assert torch.equal(ext.argmax_rows(x), x.argmax(-1)), (V, M)
            assert torch.equal(argmax(x.view(1, M, V)), x.view(1, M, V).argmax(-1)), (V, M)
    for logits in (torch.randn(7, generator=g), torch.randn(2, 5, 33, generator=g).bfloat16()):  # [V]; a fallback
        assert torch.equal(argmax(logits), logits.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_weight_streams_change_no_bit(family, dtype):
    """Dense calls read each core's rows as 4 streams side by side (segments of its rows, remainder after); the
    layout reorders rows, never a row's sum: the same bits as one stream, whatever the rows and columns."""
    try:
        for N, K in [(8, 64), (37, 90), (100, 200), (301, 33)]:
            handle = cpu_step.dense_handle(rows(N, K, 2).to(dtype))
            for M in (1, 2, 5, 9, 13):  # 13: blocks of 7 + 6 rows, 3 weight rows a block
                x = rows(M, K, M)
                ext.set_dense_streams(0)
                one = ext.linear(handle, x)
                ext.set_dense_streams(4)
                assert torch.equal(ext.linear(handle, x), one), (N, K, M)
    finally:
        ext.set_dense_streams(4)


def quantized(N: int, K: int, bits: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (N, K), generator=g, dtype=torch.uint8)
    G = -(-K // group)
    scales = torch.rand(N, G, generator=g) * 0.05 + 0.01
    zeros = torch.randint(0, 2**bits, (N, G), generator=g).float()
    return codes, scales, zeros


@pytest.mark.parametrize("bf16_act", [False, True])
def test_quantized_tile_streams_and_quads_change_no_bit(family, bf16_act):
    """Quantized calls read each core's tiles as 8 streams side by side (AVX-512; segments of its tiles, remainder
    after), and int4 codes four pair columns a load (AVX512-BF16): both reorder reads, never a sum, so every
    setting gives the bits of one stream and one pair column a load. 300 / 1000 rows: 19 / 63 tiles, so each core
    has segments and a remainder."""
    try:
        for kind, bits, group in [("i4", 4, 64), ("i4", 4, 32), ("i4", 4, -1), ("i8", 8, 64), ("i8", 8, -1)]:
            for N, K in [(300, 200), (1000, 90)]:
                g = K if group == -1 else group
                codes, scales, zeros = quantized(N, K, bits, g, seed=N)
                weight = cpu_step.KernelWeight(
                    kind, N, K, g, cpu_step.pack_codes(codes, bits), cpu_step.group_table(scales, N),
                    cpu_step.group_table(zeros - 128 if bits == 8 else zeros, N), bf16_activations=bf16_act,
                )  # fmt: skip
                for M in (1, 2, 5, 9):
                    x = rows(M, K, M)
                    ext.set_quant_streams(0)
                    ext.set_quant_quads(0)
                    one = ext.linear(weight.handle(), x)
                    for streams, quads in [(8, 0), (0, 1), (8, 1)]:
                        ext.set_quant_streams(streams)
                        ext.set_quant_quads(quads)
                        assert torch.equal(ext.linear(weight.handle(), x), one), (kind, group, N, K, M, streams, quads)
    finally:
        ext.set_quant_streams(8)
        ext.set_quant_quads(1)


def dequantized(codes, scales, zeros, group):
    col_group = torch.arange(codes.shape[1]) // group
    return (codes.double() - zeros.double()[:, col_group]) * scales.double()[:, col_group]


@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (3, 64), (2, 32), (8, -1), (8, 32), (4, -1)])
@pytest.mark.parametrize("bf16_act", [False, True])
def test_int_codes(family, N, K, bits, group, bf16_act):
    group = K if group == -1 else min(group, K + K % 2)
    codes, scales, zeros = quantized(N, K, bits, group)
    stored_zeros = zeros - 128 if bits == 8 else zeros
    weight = cpu_step.KernelWeight(
        "i8" if bits == 8 else "i4", N, K, group, cpu_step.pack_codes(codes, bits),
        cpu_step.group_table(scales, N), cpu_step.group_table(stored_zeros, N), bf16_activations=bf16_act,
    )  # fmt: skip
    handle = weight.handle()
    w64 = dequantized(codes, scales, zeros, group)
    col_group = torch.arange(K) // group
    offset_w = (128 + codes.double()) * scales.double()[:, col_group]  # what the bf16-dot path sums
    for M in (1, 2, 5, 8, 64):
        x = rows(M, K, M + 7)
        xr = (x.bfloat16() if bf16_act else x).double()
        slack = 1e-5 * (xr.abs() @ offset_w.T) if bits <= 4 and bf16_act else None
        check(ext.linear(handle, x), xr, w64, slack)
    assert_row_independent(handle, rows(11, K, 3))


@pytest.mark.parametrize("bits,group", [(4, 64), (4, 32), (8, -1)])
@pytest.mark.parametrize("act", ["fp32", "bf16", "int8"])
def test_int8_zero_tables_give_the_fp32_tables_bits(family, bits, group, act):
    """Integer zero points are stored as int8 (a quarter of the bytes a decode step streams beside the codes); every
    kernel that reads them (exact rows, the prefill GEMM's dequantization, integer activations) returns the same bits
    as with the fp32 table. Fractional zero points keep the fp32 table."""
    N, K = 37, 192
    group = K if group == -1 else group
    codes, scales, zeros = quantized(N, K, bits, group, seed=3)
    stored = zeros - 128 if bits == 8 else zeros
    table8 = cpu_step.zero_table(stored, N)
    assert table8.dtype == torch.int8 and torch.equal(table8.float(), cpu_step.group_table(stored, N))
    assert cpu_step.zero_table(stored + 0.5, N).dtype == torch.float32

    def weight(zero_table):
        return cpu_step.KernelWeight(
            "i8" if bits == 8 else "i4", N, K, group, cpu_step.pack_codes(codes, bits),
            cpu_step.group_table(scales, N), zero_table, bf16_activations=act == "bf16",
            int8_activations=act == "int8",
        )  # fmt: skip

    wide, narrow = weight(cpu_step.group_table(stored, N)), weight(table8)
    for M in (1, 5, 64):
        x = rows(M, K, M)
        assert torch.equal(ext.linear(narrow.handle(), x), ext.linear(wide.handle(), x))
    if act != "int8":  # the prefill GEMM dequantizes through the same table
        x = rows(cpu_step.PREFILL_MIN_ROWS + 3, K)
        assert torch.equal(cpu_step.prefill_linear(narrow, x), cpu_step.prefill_linear(wide, x))
        assert torch.equal(cpu_step.dequantize(narrow), cpu_step.dequantize(wide))


def test_int_codes_round_trip():
    for bits in (2, 4, 8):
        codes, _, _ = quantized(37, 90, bits, 32)
        assert torch.equal(cpu_step.unpack_codes(cpu_step.pack_codes(codes, bits), bits, 37, 90), codes)


@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("block", [-1, 32])
def test_fp8(family, N, K, block):
    g = torch.Generator().manual_seed(4)
    group = K if block == -1 else block
    values = (torch.randn(N, K, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    values.view(torch.uint8)[0, : min(K, 8)] = torch.tensor([0, 1, 7, 8, 0x80, 0x81, 0x7E, 0xFE])[: min(K, 8)].to(
        torch.uint8
    )  # zero, subnormals, the largest finite values, and their negatives
    scales = torch.rand(N, -(-K // group), generator=g) * 0.01 + 1e-3
    weight = cpu_step.KernelWeight(
        "fp8", N, K, group, cpu_step.pack_fp8(values), cpu_step.group_table(scales * 256, N),
        cpu_step.group_table(torch.zeros_like(scales), N),
    )  # fmt: skip
    assert torch.equal(cpu_step.unpack_fp8(weight.data, N, K).view(torch.uint8), values.view(torch.uint8))
    col_group = torch.arange(K) // group
    w64 = values.double() * scales.double()[:, col_group]  # torch's own e4m3 decoding is the oracle
    for M in (1, 4, 64):
        x = rows(M, K, M)
        check(ext.linear(weight.handle(), x), x.double(), w64)


def test_act_order_permutation_and_bias(family):
    N, K, group = 40, 128, 32
    codes, scales, zeros = quantized(N, K, 4, group, seed=9)
    perm = torch.randperm(K, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(N)
    weight = cpu_step.KernelWeight("i4", N, K, group, cpu_step.pack_codes(codes, 4), cpu_step.group_table(scales, N),
                                   cpu_step.group_table(zeros, N), perm=perm, bias=bias)  # fmt: skip
    x = rows(6, K)
    # packed column j multiplies input column perm[j]
    ref = x.double()[:, perm] @ dequantized(codes, scales, zeros, group).T + bias.double()
    err = (ext.linear(weight.handle(), x).double() - ref).abs().max()
    assert float(err) < 1e-4


def test_bad_shapes_are_refused():
    with pytest.raises(RuntimeError, match="quantized data"):
        cpu_step.KernelWeight("i4", 16, 64, 32, torch.zeros(10, dtype=torch.uint8), torch.zeros(1, 2, 16),
                              torch.zeros(1, 2, 16)).handle()  # fmt: skip
    handle = cpu_step.dense_handle(torch.zeros(8, 16))
    with pytest.raises(RuntimeError, match="1..64 rows"):
        ext.linear(handle, torch.zeros(65, 16))
    with pytest.raises(RuntimeError, match=r"x must be \[M, 16\]"):
        ext.linear(handle, torch.zeros(2, 15))
