"""The Triton paged-decode kernel (under TRITON_INTERPRET=1, in a subprocess so the interpreter flag is set
before triton is imported and other tests are unaffected) and its torch reference, against SDPA over the
paged cache's gathered KV (what the engine's forward computes)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from runtime.kernels.paged_attention import paged_decode_attention_reference
from runtime.paged_cache import gather_blocks

ROOT = Path(__file__).resolve().parents[1]


def random_paged_case(seed: int, B=5, H=6, Hkv=2, D=32, bs=16, num_blocks=40):
    gen = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(num_blocks, bs, Hkv, D, generator=gen)
    v_pool = torch.randn(num_blocks, bs, Hkv, D, generator=gen)
    context_lens = torch.randint(1, 5 * bs, (B,), generator=gen)
    context_lens[0] = 1  # a single key
    context_lens[1] = 2 * bs  # exactly full blocks
    nb = int((context_lens.max() + bs - 1) // bs)
    block_tables = torch.stack([torch.randperm(num_blocks - 1, generator=gen)[:nb] + 1 for _ in range(B)])
    q = torch.randn(B, H, D, generator=gen)
    return q, k_pool, v_pool, block_tables, context_lens


def test_reference_equals_sdpa_over_gathered_blocks():
    q, k_pool, v_pool, tables, lens = random_paged_case(0)
    kv_len = int(lens.max())
    k = gather_blocks(k_pool, tables, kv_len)  # [B, Hkv, S, D]
    v = gather_blocks(v_pool, tables, kv_len)
    mask = torch.arange(kv_len)[None, None, None, :] < lens[:, None, None, None]  # [B, 1, 1, S]
    sdpa = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, enable_gqa=True)[:, :, 0]
    torch.testing.assert_close(paged_decode_attention_reference(q, k_pool, v_pool, tables, lens), sdpa)


KERNEL_CHECK = textwrap.dedent(
    """
    import torch
    from runtime.kernels.paged_attention import paged_decode_attention, paged_decode_attention_reference
    from runtime.kv_quant import dequantize_scaled, quantize_fp8, quantize_int8
    from tests.test_serve_paged_kernel import random_paged_case

    import sys
    for seed, shape in enumerate(eval(sys.argv[1])):
        q, k_pool, v_pool, tables, lens = random_paged_case(seed, **shape)
        out = paged_decode_attention(q, k_pool, v_pool, tables, lens)
        ref = paged_decode_attention_reference(q, k_pool, v_pool, tables, lens)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        # a strided pool (one layer of the [L, N, bs, Hkv, D] cache tensor) works as well
        pool = torch.stack([k_pool, k_pool * 0]), torch.stack([v_pool * 0, v_pool])
        out = paged_decode_attention(q, pool[0][0], pool[1][1], tables, lens)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        # quantized pools (int8 / fp8 codes, per-token scales): the kernel dequantizes in registers, the same
        # function as the reference over the dequantized pools
        for quantize in (quantize_int8, quantize_fp8):
            (kc, ks), (vc, vs) = quantize(k_pool), quantize(v_pool)
            out = paged_decode_attention(q, kc, vc, tables, lens, None, ks, vs)
            k_deq, v_deq = dequantize_scaled(kc, ks), dequantize_scaled(vc, vs)
            deq = paged_decode_attention_reference(q, k_deq, v_deq, tables, lens)
            torch.testing.assert_close(out, deq, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(paged_decode_attention_reference(q, kc, vc, tables, lens, None, ks, vs), deq)
    print("KERNEL_OK")
    """
)


def run_kernel_check(cases: str) -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", KERNEL_CHECK, cases], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and "KERNEL_OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_triton_kernel_matches_reference_under_interpreter():
    run_kernel_check("[dict(B=3, H=4, Hkv=2, D=16, bs=8, num_blocks=12)]")  # GQA, ragged, 1-key and full-block rows


@pytest.mark.slow
def test_triton_kernel_matches_reference_model_shapes():
    run_kernel_check("[dict(), dict(H=4, Hkv=4, D=64, bs=8), dict(B=3, H=9, Hkv=3, D=64, bs=16)]")
