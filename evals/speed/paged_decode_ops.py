"""One op-level case of paged decode attention: the Triton paged kernel and gather_blocks + SDPA (the two paths
PagedKVCache.attend chooses between) on a random pool, each against an fp32 reference, CUDA-event timed.
evals.speed.bench_paged_decode and evals.speed.gpu_check run it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.kernels.paged_attention import paged_decode_attention, paged_decode_attention_reference
from runtime.paged_cache import gather_blocks

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOL = {"fp32": 1e-4, "fp16": 4e-3, "bf16": 3e-2}  # max |kernel - fp32 reference| (outputs are O(1))
SHAPES = {"tiny": (4, 2, 16), "smollm2-135m": (9, 3, 64), "llama-8b": (32, 8, 128)}  # (H, Hkv, D)


@dataclass
class OpCase:
    shape: str
    dtype: str
    batch: int
    ctx: int


def median_ms(fn, device: torch.device, iters: int) -> float | None:
    """Median CUDA-event time of fn; None off CUDA (the smoke run only checks agreement)."""
    if device.type != "cuda":
        fn()
        return None
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def op_case(case: OpCase, block_size: int, device: torch.device, iters: int, seed: int) -> dict:
    H, Hkv, D = SHAPES[case.shape]
    dtype = DTYPES[case.dtype]
    gen = torch.Generator(device).manual_seed(seed)  # on the device: pools of GBs are slow to make on CPU
    lens = torch.randint(max(1, case.ctx // 2), case.ctx + 1, (case.batch,), generator=gen, device=device)
    nb = math.ceil(case.ctx / block_size)
    num_blocks = case.batch * nb + 1
    perm = torch.randperm(num_blocks - 1, generator=gen, device=device)
    tables = (perm + 1).view(case.batch, nb).to(torch.int32)  # scattered, never the scratch block
    k_pool = torch.randn(num_blocks, block_size, Hkv, D, generator=gen, device=device).to(dtype)
    v_pool = torch.randn(num_blocks, block_size, Hkv, D, generator=gen, device=device).to(dtype)
    q = torch.randn(case.batch, H, D, generator=gen, device=device).to(dtype)
    lens = lens.to(torch.int32)
    kv_len = int(lens.max())
    mask = (torch.arange(kv_len, device=device)[None, :] < lens[:, None])[:, None, None, :]  # [B, 1, 1, S]

    def kernel():
        return paged_decode_attention(q, k_pool, v_pool, tables, lens)

    def gather_sdpa():  # what attend does off the kernel path
        k, v = gather_blocks(k_pool, tables, kv_len), gather_blocks(v_pool, tables, kv_len)
        return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, enable_gqa=True)[:, :, 0]

    ref = paged_decode_attention_reference(q.float(), k_pool.float(), v_pool.float(), tables, lens)
    err_kernel = (kernel().float() - ref).abs().max().item()
    err_sdpa = (gather_sdpa().float() - ref).abs().max().item()
    ms_kernel, ms_sdpa = median_ms(kernel, device, iters), median_ms(gather_sdpa, device, iters)
    kv_bytes = 2 * int(lens.sum()) * Hkv * D * k_pool.element_size()
    return {
        **vars(case),
        "heads": [H, Hkv, D],
        "err_kernel": err_kernel,
        "err_gather_sdpa": err_sdpa,
        "ok": err_kernel <= TOL[case.dtype],
        "ms_kernel": ms_kernel,
        "ms_gather_sdpa": ms_sdpa,
        "speedup": ms_sdpa / ms_kernel if ms_kernel else None,
        "kernel_gb_s": kv_bytes / ms_kernel / 1e6 if ms_kernel else None,
    }
