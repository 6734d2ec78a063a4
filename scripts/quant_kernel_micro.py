"""The CPU step's quantized linear kernel alone: int4 / int8 g64 layers of real shapes at 1 and 4 activation rows,
fp32 activations and int8 ones (W4A8 / W8A8), weights hot in cache, per kernel family named on the command line
(default avx2); median microseconds of 200 calls.
A kernel-level probe, not a speed claim (those come from evals.speed.bench_decode's whole steps).

    PYTHONPATH=. python scripts/quant_kernel_micro.py avx2 avx512
"""

from __future__ import annotations

import sys
import time

import torch

from runtime.kernels import cpu_step
from runtime.kernels.huge_pages import place

SHAPES = [(3072, 576), (576, 1536), (8960, 1536)]  # SmolLM2's gate_up, the 1.5B's o_proj and gate_up (N, K)


def layer(N: int, K: int, bits: int, int8_acts: bool, group: int = 64, seed: int = 0, bf16_acts: bool = False):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (N, K), generator=g, dtype=torch.uint8)
    groups = -(-K // group)
    scales = torch.rand(N, groups, generator=g) * 0.05 + 0.01
    zeros = torch.randint(0, 2**bits, (N, groups), generator=g).float() - (128 if bits == 8 else 0)
    kind = "i8" if bits == 8 else "i4"
    packed = place(cpu_step.pack_codes(codes, bits))  # huge pages, as the step's own layers
    tables = place(cpu_step.group_table(scales, N)), place(cpu_step.group_table(zeros, N))
    flags = {"bf16_activations": bf16_acts, "int8_activations": int8_acts}
    return cpu_step.KernelWeight(kind, N, K, group, packed, *tables, **flags).handle()


def median_us(ext, handle, x: torch.Tensor, calls: int = 200) -> float:
    for _ in range(20):
        ext.linear(handle, x)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        ext.linear(handle, x)
        times.append(time.perf_counter() - start)
    return sorted(times)[calls // 2] * 1e6


def main(families: list[str]) -> None:
    ext = cpu_step.extension()
    for family in families:
        ext.set_isa(family)
        for N, K in SHAPES:
            for bits, acts in ((4, False), (4, True), (8, False), (8, True)):
                handle = layer(N, K, bits, acts)
                name = f"{'W' if acts else 'int'}{bits}{'A8' if acts else ''}"
                for M in (1, 4):
                    us = median_us(ext, handle, torch.randn(M, K))
                    print(f"{family} N={N} K={K} {name} M={M}: {us:8.1f} us {N * K * M / us / 1e3:6.1f} G w*rows/s")


if __name__ == "__main__":
    main(sys.argv[1:] or ["avx2"])
